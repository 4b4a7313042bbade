"""GPU check of the refit path (tests/gpu/refit_check.sh runs it).

Two processes: one plays the trainer (two Shard(0) ranks' worth of weights), the other the
receiver. The plan's walk moves a BF16 model of --gb GB, every destination tensor is
checked against the source bytes, and the script prints GB/s for the walk and for one raw
message of the same bytes on the same transport. With two or more GPUs the processes sit on
different GPUs and talk NCCL. With one GPU they share it; NCCL refuses two ranks of one
communicator on one device, so the colocated path (CUDA IPC handles) is used instead;
--transport forces a choice.

    python -m hpc_rl.refit.gpu_check [--gb 2] [--timeout 120] [--out bench/results/refit_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path


def _specs(gb: float):
    hidden, ffn = 4096, 14336
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, int(gb * 1e9 / 2 / per_layer))
    specs = {}
    for l in range(layers):
        p = f"model.layers.{l}."
        for n, shape in [("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden, hidden)),
                         ("self_attn.v_proj", (hidden, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                         ("mlp.gate_proj", (ffn, hidden)), ("mlp.up_proj", (ffn, hidden)),
                         ("mlp.down_proj", (hidden, ffn)), ("input_layernorm", (hidden,)),
                         ("post_attention_layernorm", (hidden,))]:
            specs[p + n + ".weight"] = (shape, "bfloat16")
    return specs


def _fill(name, shape, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(torch.bfloat16).to(device)


def _proc(rank: int, port: int, gb: float, timeout: float, gpus: int, kind: str, out, bucket_mb: int = 256,
          reps: int = 4, direct_min_mb: float = None) -> None:
    import torch
    import torch.distributed as dist

    from hpc_rl.refit.layout import chunk_bounds
    from hpc_rl.refit.session import RefitEndpoint
    from hpc_rl.refit.transports import make_transport
    from hpc_rl.refit.engine_group import refit_setup

    try:
        device = f"cuda:{rank % gpus}"
        torch.cuda.set_device(device)
        specs = _specs(gb)
        setup = refit_setup(specs, 2, 1, "refit/gpu", timeout_s=timeout, bucket_bytes=bucket_mb << 20)
        if direct_min_mb is not None:  # slices below it are packed into one message per bucket and peer
            setup.direct_min = int(direct_min_mb * (1 << 20))
        setup.proc_of = {0: 0, 1: 0, 2: 1}  # process 0 holds both trainer shards; process 1 receives
        setup.names = {0: "trainer", 1: "receiver"}
        store = dist.TCPStore("127.0.0.1", port, is_master=(rank == 0), timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
        transport = make_transport(kind, store, setup.prefix, rank, 2, setup.names, timeout, cuda=True)
        sources = {}
        if rank == 0:
            for r in (0, 1):
                sources[r] = {}
                for name, (shape, _) in specs.items():
                    a, b = chunk_bounds(shape[0], 2)[r]
                    full = _fill(name, shape, device)
                    sources[r][name] = ((a,) + (0,) * (len(shape) - 1), full[a:b].contiguous())
        ep = RefitEndpoint(setup, rank, transport, sources=sources, device=device)
        nbytes = sum(t.nbytes for t in ep.plan.transfers)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times, raw = [], []
        # walk 0 is untimed: the receiver would otherwise time the sender building its 2 GB of
        # sources on the CPU (seen: 11-15 s first walks on an H200, bench/results/refit_gpu*.json)
        for i in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ep.run(timeout)
            torch.cuda.synchronize()
            walk_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            handle = transport.send(flat, 1, 0) if rank == 0 else transport.recv(flat, 0, 0)
            transport.wait(handle, 1 - rank, time.monotonic() + timeout, "the raw message with")
            torch.cuda.synchronize()
            if i:
                times.append(walk_s)
                raw.append(time.perf_counter() - t0)
        bad = 0
        if rank == 1:
            for name, boxes in ep.walk.holdings.dst[2].items():
                shape = specs[name][0]
                bad += int(not torch.equal(boxes[0][1], _fill(name, shape, device)))
        # the fastest timed walk and message are what the summary reports (min); all are kept
        out.put({"rank": rank, "bytes": nbytes, "walk_s": sorted(times), "raw_s": sorted(raw),
                 "walk_s_in_order": times, "buckets": len(ep.plan.buckets), "bad_tensors": bad})
    except Exception as exc:  # reported by the parent, with NCCL's own words
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--transport", choices=["auto", "torch", "cuda_ipc"], default="auto")
    ap.add_argument("--out", default="bench/results/refit_gpu.json")
    ap.add_argument("--bucket-mb", type=int, default=256, help="refit.bucket_bytes of the plan, in MiB")
    ap.add_argument("--reps", type=int, default=4, help="walks (and raw messages) per process")
    ap.add_argument("--direct-min-mb", type=float, default=None,
                    help="RefitSetup.direct_min in MiB (default: the setup's); huge: pack every slice")
    args = ap.parse_args()
    code, record = _check(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"check": "refit_gpu", "gb": args.gb, "rc": code, **record}, indent=2) + "\n")
    return code


def _check(args) -> tuple:
    """(exit code, what was measured): the JSON records a failure as much as a pass."""
    import torch

    if not torch.cuda.is_available():
        print("refit_check: no CUDA device visible to torch", flush=True)
        return 2, {"ran": False, "why": "no CUDA device visible to torch"}
    gpus = torch.cuda.device_count()
    print(f"refit_check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    kind = args.transport if args.transport != "auto" else ("torch" if gpus >= 2 else "cuda_ipc")
    record = {"ran": True, "bucket_mb": args.bucket_mb, "reps": args.reps, "direct_min_mb": args.direct_min_mb,
              "gpus": gpus, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "transport": kind}
    print(f"refit_check: transport {kind} ({'NCCL' if kind == 'torch' else 'CUDA IPC, both processes on GPU 0'})",
          flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_proc, args=(r, port, args.gb, args.timeout, gpus, kind, out, args.bucket_mb, args.reps,
                                                  args.direct_min_mb))
             for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + args.timeout + 120
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            r = out.get(timeout=5)
            results[r["rank"]] = r
        except Exception:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    print(json.dumps(results, indent=1), flush=True)
    record["processes"] = results
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        if any("Duplicate GPU" in e or "invalid usage" in e.lower() for e in errors) and gpus == 1:
            print("refit_check: NCCL refuses two ranks on one GPU; rerun with --transport cuda_ipc", flush=True)
            return 3, record
        return 1, record
    if len(results) < 2:
        print("refit_check: a process did not report (hung or died)", flush=True)
        return 1, record
    r = results[1]
    walk, raw = min(r["walk_s"]), min(r["raw_s"])
    print(f"refit_check: {r['bytes'] / 1e9:.2f} GB; walk {walk * 1e3:.1f} ms = {r['bytes'] / walk / 1e9:.1f} GB/s; "
          f"raw {kind} {raw * 1e3:.1f} ms = {r['bytes'] / raw / 1e9:.1f} GB/s; efficiency {raw / walk:.2f}; "
          f"wrong tensors {r['bad_tensors']}", flush=True)
    record.update(bytes=r["bytes"], walk_s=walk, raw_s=raw, walk_gb_s=r["bytes"] / walk / 1e9,
                  raw_gb_s=r["bytes"] / raw / 1e9, efficiency=raw / walk, bad_tensors=r["bad_tensors"])
    return (0 if r["bad_tensors"] == 0 else 1), record


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    sys.exit(main())

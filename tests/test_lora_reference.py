"""The reference model with LoRA (issue 47): the student's base with the adapters off, scored by the
trainer ranks (models/lora.py adapters_off), no teacher group, no second copy of the weights. On a real
tiny Llama with real peft and the real fsdp2 backend; the plan's roles from the real config loader."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpc_rl.config import load_config
from hpc_rl.config.resources import reference_on_trainer, role_sections, teacher_groups
from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
from hpc_rl.models.lora import adapters_off, is_adapter

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
OPT = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)
LORA = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=None)
BASE = ["+recipe=tiny_grpo", "launcher=dry_run", "trainer.lora.enabled=true", "algo.ref_kl_coef=0.05"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(8, 100, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # a left-padded row
    return ids, attn


def test_reference_is_the_base_with_adapters_off(tiny_ckpt):
    torch.manual_seed(0)
    b = FSDP2Backend(str(tiny_ckpt), optim=OPT, lora=LORA)
    ids, attn = _batch()
    mask = attn.bool()
    mask[:, 0] = False  # the first token has no log-prob
    # step 0: B = 0, so the policy is the base and the reference's log-probs are the policy's exactly
    policy0 = b.logprobs(ids, attn)
    with adapters_off(b.model):
        ref0 = b.logprobs(ids, attn)
    assert torch.equal(ref0[mask], policy0[mask])  # KL exactly 0 at step 0, bit for bit
    for _ in range(2):
        b.train_step(ids, attn, lambda lp, rows: (-lp[rows].mean(), {}))
    # the adapters still train after the scope put them back on (peft's enable_adapters sets requires_grad)
    assert all(p.requires_grad == is_adapter(n) for n, p in b.model.named_parameters())
    policy = b.logprobs(ids, attn)
    with adapters_off(b.model):
        ref = b.logprobs(ids, attn)
    assert torch.equal(b.logprobs(ids, attn), policy)  # back on: the trained policy again
    fresh = FSDP2Backend(str(tiny_ckpt), optim=OPT).logprobs(ids, attn)  # the base, loaded fresh, no LoRA
    gap_ref = float((ref - fresh)[mask].abs().max())
    gap_policy = float((policy - fresh)[mask].abs().max())
    print(f"reference vs fresh base max |dlogp| {gap_ref:.3g}; trained policy vs fresh base {gap_policy:.3g}")
    # fp32 forwards of the same weights through the same ops: equal to rounding (~1e-6 relative on log-probs of ~5)
    assert gap_ref <= 1e-5
    assert gap_policy > 1e-3  # the check can fail: the adapters moved the policy


def _two_rank_worker(rank, world, path, out):
    import torch.distributed as dist

    torch.manual_seed(0)
    b = FSDP2Backend(str(path), optim=OPT, lora=LORA, group=dist.group.WORLD)
    ids, attn = _batch()
    b.train_step(ids, attn, lambda lp, rows: (-lp[rows].mean(), {}))
    with adapters_off(b.model):  # every rank switches alike: the same FSDP2 all-gathers run
        ref = b.logprobs(ids, attn)
    torch.save({"ref": ref, "policy": b.logprobs(ids, attn)}, Path(out) / f"rank{rank}.pt")


def test_two_fsdp2_ranks_score_the_base_with_adapters_off(tiny_ckpt, tmp_path):
    from gloo_ranks import run_ranks

    run_ranks(_two_rank_worker, 2, tmp_path / "store", str(tiny_ckpt), str(tmp_path))
    ids, attn = _batch()
    mask = attn.bool()
    mask[:, 0] = False
    fresh = FSDP2Backend(str(tiny_ckpt), optim=OPT).logprobs(ids, attn)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        gap_ref = float((got["ref"] - fresh)[mask].abs().max())
        gap_policy = float((got["policy"] - fresh)[mask].abs().max())
        print(f"rank {r}: reference vs fresh base {gap_ref:.3g}; policy vs fresh base {gap_policy:.3g}")
        assert gap_ref <= 1e-5 and gap_policy > 1e-3


def test_lora_reference_plans_no_reference_ranks():
    cfg = load_config(BASE)
    assert reference_on_trainer(cfg) and not teacher_groups(cfg)
    assert [r[0] for r in role_sections(cfg)] == ["trainer", "generator", "env"]
    full = load_config(["+recipe=tiny_grpo", "launcher=dry_run", "algo.ref_kl_coef=0.05"])
    assert "teacher/reference" in [r[0] for r in role_sections(full)]  # without LoRA: a group of its own
    from hpc_rl.plan.job_plan import build_plan
    from hpc_rl.plan.report import routing_table

    assert "the student's base with the LoRA adapters off) -> the trainer ranks" in routing_table(cfg, build_plan(cfg))
    # the student's base named as the reference is what it is anyway: accepted
    ok = load_config([*BASE, f"reference.checkpoint={cfg.model.path}"])
    assert not teacher_groups(ok)


def test_lora_reference_reward_penalty_validates():
    cfg = load_config([*BASE, "algo.ref_kl.apply_to=reward"])
    assert reference_on_trainer(cfg) and cfg.algo.ref_kl.apply_to == "reward"


@pytest.mark.slow
@pytest.mark.parametrize("apply_to", ["loss", "reward"])
def test_lora_grpo_launch_with_reference_kl(tmp_path, apply_to):
    """tiny_grpo with LoRA and the reference KL in the loss or the reward: the trainer scores the reference itself
    (no teacher rank in the job), the KL is 0 at step 1 (the adapters start at B = 0) and > 0 after."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_grpo", "run.max_steps=3",
                           "algo.prompts_per_step=16", "trainer.global_batch_size=128", "data.samples_per_task=32",
                           "data.eval_prompts_per_task=8", "trainer.lora.enabled=true", "trainer.lora.rank=8",
                           "trainer.lora.alpha=16", "trainer.optimizer.lr=5e-3", "algo.ref_kl_coef=0.05",
                           f"algo.ref_kl.apply_to={apply_to}", f"run.dir={run}"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list((run / "logs").glob("teacher*")), sorted(p.name for p in (run / "logs").iterdir())
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    term = "ref_kl_loss" if apply_to == "loss" else "ref_kl_reward_penalty_mean"
    print(f"ref_kl, {term} by step:", [(s["step"], s["ref_kl"], s[term]) for s in steps])
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["ref_kl"] == 0.0 and steps[0][term] == 0.0
    assert all(s["ref_kl"] > 0 for s in steps[1:])
    assert all(s["ref_logprobs_s"] > 0 for s in steps)

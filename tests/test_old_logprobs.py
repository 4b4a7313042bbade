"""Old log-probs from the training forward (issue 49, hpc_rl/roles/old_logprobs.py): a batch
trained in one optimizer step from the weights that sampled it skips the separate log-prob
pass and gives the same loss, gradients and recorded log-probs as with it; the shortcut is
never taken when the batch spans several optimizer steps, under asynchronous rollouts, with
samples of other weights, or where the algorithm needs the whole batch's log-probs first.
The fsdp2 backend trains for real on a tiny Llama (one gloo rank, and two)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpc_rl.config import load_config
from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
from hpc_rl.roles.old_logprobs import SEPARATE_PASS, TRAINING_FORWARD
from hpc_rl.roles.trainer import TrainerRole
from backend_batches import masked_batch
from gloo_ranks import run_ranks

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
GRPO = ["+recipe=tiny_grpo", "algo.prompts_per_step=2", "algo.generations_per_prompt=4"]
MOPD = ["+recipe=tiny_mopd", "algo.prompts_per_step=2", "algo.generations_per_prompt=4", "algo.opd.baseline=none"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def _role(cfg, backend) -> TrainerRole:
    role = TrainerRole.__new__(TrainerRole)
    role.cfg, role.backend = cfg, backend
    role.ctx = SimpleNamespace(groups=SimpleNamespace(role=dist.group.WORLD))
    return role


def _rows(n: int, version: int = 0, truncated=(), lengths=()):
    return [SimpleNamespace(version_first=version, version_last=version, truncated=i in truncated,
                            response_ids=[0] * (lengths[i] if lengths else 8)) for i in range(n)]


REWARDS = (1.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.0, 1.0)


def _step(ckpt: str, overrides, separate: bool, truncated=(), lengths=(), ref_shift: float = 0.0, rewards=REWARDS):
    """One RL train step of 8 rows on a fresh student; the gradients the optimizer applied.
    Rows `truncated` were cut at max_tokens; `lengths` are their response lengths; the
    reference model's log-probs are the student's starting ones less `ref_shift` * noise."""
    world = dist.get_world_size()
    cfg = load_config(overrides)
    backend = FSDP2Backend(ckpt, group=dist.group.WORLD if world > 1 else None, optim=OptimConfig(lr=1e-2))
    role = _role(cfg, backend)
    ids, attn = masked_batch(8, 12)
    mask = attn.bool().clone()
    mask[:, :4] = False  # the prompt
    g = torch.Generator().manual_seed(1)
    lp = backend.logprobs(ids, attn).float()
    # the engine's log-probs: near the trainer's, so the mismatch weights are not all 1
    gen = lp + 0.05 * torch.randn(lp.shape, generator=g)
    ref = lp - ref_shift * torch.rand(lp.shape, generator=torch.Generator().manual_seed(2))
    batch = SimpleNamespace(rows=_rows(8, 0, truncated, lengths), items=8, sibling_of=[], ref_logprobs=ref,
                            student_logprobs=lp if separate else None,
                            rewards=torch.tensor(rewards), advantages=None,
                            teacher_logprobs=lp - torch.rand(lp.shape, generator=g),
                            rollouts=SimpleNamespace(response_mask=mask, generation_logprobs=gen, input_ids=ids,
                                                     attention_mask=attn))
    # the separate pass over these ids (the batch's rows are stand-ins without token ids)
    role.student_logprobs = lambda rows: backend.logprobs(ids, attn).float()
    grads = {}
    apply = backend.optimizer.step

    def step(*a, **k):
        for name, p in backend.model.named_parameters():
            grads[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        return apply(*a, **k)

    backend.optimizer.step = step
    metrics = role.train(batch)
    return {"metrics": metrics, "grads": grads, "student_logprobs": batch.student_logprobs,
            "advantages": batch.advantages, "separate": lp, "ref": ref, "mask": mask}


CASES = {
    "grpo_ppo_tis_micro": GRPO + ["trainer.global_batch_size=8", "trainer.micro_batch_size=2",
                                  "algo.loss.kind=ppo", "algo.mismatch.kind=tis"],
    "grpo_icepop_threshold_one_micro": GRPO + ["trainer.global_batch_size=8", "trainer.micro_batch_size=8",
                                               "algo.mismatch.kind=icepop", "algo.mismatch.min=0.9",
                                               "algo.mismatch.max=1.1",
                                               "algo.mismatch.seq_logprob_error_threshold=1.04"],
    "mopd_none_micro": MOPD + ["trainer.global_batch_size=8", "trainer.micro_batch_size=2"],
    "two_minibatches": GRPO + ["trainer.global_batch_size=4", "trainer.micro_batch_size=2"],
}


def _worker(rank: int, world: int, ckpt: str, names, out: str) -> None:
    torch.manual_seed(0)
    got = {name: {"separate": _step(ckpt, CASES[name], True), "skipped": _step(ckpt, CASES[name], False)}
           for name in names}
    if rank == 0:
        torch.save(got, out)


def _same(a, b):
    assert a["metrics"]["loss"] == pytest.approx(b["metrics"]["loss"], rel=1e-5, abs=1e-7)
    assert set(a["grads"]) == set(b["grads"]) and len(a["grads"]) > 10
    for name, g in a["grads"].items():
        torch.testing.assert_close(b["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # a row that trains nothing is left out (trainer.skip_zero_advantage): on the training forward's
    # path it has no trainer log-probs (NaN), exactly the rows not trained
    kept = ~torch.isnan(b["student_logprobs"]).any(dim=1)
    assert int(kept.sum()) == b["metrics"]["samples_trained"] or b["metrics"]["old_logprobs_path"] == SEPARATE_PASS
    torch.testing.assert_close(b["student_logprobs"][kept], a["student_logprobs"][kept], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["advantages"], a["advantages"], rtol=1e-5, atol=1e-6)
    for k in ("advantage_mean", "seqs_masked_by_mismatch", "optimizer_steps", "ratio_mean", "num_tokens"):
        assert b["metrics"][k] == pytest.approx(a["metrics"][k], rel=1e-5, abs=1e-6), k


def test_one_step_batches_skip_the_pass_with_the_same_loss_and_gradients(tiny_ckpt, tmp_path):
    names = ["grpo_ppo_tis_micro", "grpo_icepop_threshold_one_micro", "mopd_none_micro", "two_minibatches"]
    run_ranks(_worker, 1, tmp_path / "store", str(tiny_ckpt), names, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    for name in names[:3]:
        a, b = got[name]["separate"], got[name]["skipped"]
        assert a["metrics"]["old_logprobs_path"] == SEPARATE_PASS, name
        assert b["metrics"]["old_logprobs_path"] == TRAINING_FORWARD, name
        assert b["metrics"]["optimizer_steps"] == 1 and "late_logprobs_s" not in b["metrics"]
        _same(a, b)
        # the records get the whole batch's log-probs: the separate pass's values
        torch.testing.assert_close(b["student_logprobs"], a["separate"], rtol=1e-5, atol=1e-6)
    assert got["grpo_icepop_threshold_one_micro"]["skipped"]["metrics"]["seqs_masked_by_mismatch"] > 0
    # two optimizer steps: the batch came without log-probs, and the train step ran the pass itself
    a, b = got["two_minibatches"]["separate"], got["two_minibatches"]["skipped"]
    assert b["metrics"]["optimizer_steps"] == 2 and b["metrics"]["old_logprobs_path"] == SEPARATE_PASS
    assert b["metrics"]["late_logprobs_s"] > 0
    _same(a, b)


def test_two_data_parallel_ranks_gather_the_batch_the_separate_pass_gives(tiny_ckpt, tmp_path):
    run_ranks(_worker, 2, tmp_path / "store", str(tiny_ckpt), ["grpo_ppo_tis_micro"], str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")["grpo_ppo_tis_micro"]
    assert got["skipped"]["metrics"]["old_logprobs_path"] == TRAINING_FORWARD
    _same(got["separate"], got["skipped"])


def _reason(overrides, n=8, version=0, rows_version=0, dp=1, capable=True):
    backend = SimpleNamespace(dp_size=dp, old_logprobs_from_train_forward=capable)
    return _role(load_config(overrides), backend).old_logprobs_reason(_rows(n, rows_version), version)


def test_the_shortcut_is_never_taken_where_it_would_change_the_math():
    one = ["trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
    assert _reason(GRPO + one) is None
    assert _reason(MOPD + one) is None
    assert _reason(GRPO + one, version=None) is None
    # several optimizer steps per batch
    assert "several optimizer steps" in _reason(GRPO + ["trainer.global_batch_size=4", "trainer.micro_batch_size=2"])
    # asynchronous rollouts: older weights
    assert "asynchronous" in _reason(GRPO + one + ["algo.async_rollout.enabled=true"])
    # a sample of other weights than the trainer holds
    assert "other weights" in _reason(GRPO + one, version=3, rows_version=2)
    # the batch-wide baseline, and the sequence mask's denominator over micro-batches
    assert "baseline" in _reason(MOPD[:-1] + ["algo.opd.baseline=token_mean"] + one)
    assert "threshold" in _reason(GRPO + one + ["algo.mismatch.seq_logprob_error_threshold=1.5"])
    assert _reason(GRPO + one + ["algo.mismatch.seq_logprob_error_threshold=1.5"], dp=4) is None  # 2 rows a rank
    # a backend whose loss does not see every row (megatron)
    assert "does not hand" in _reason(GRPO + one, capable=False)

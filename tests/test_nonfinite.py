"""Non-finite training steps (issue 43): a NaN loss or gradient skips the optimizer step on
every trainer rank, is counted, and more than trainer.max_nonfinite_steps in a row fail the
run; checkpoints say whether their weights were finite, retention keeps the newest finite one
and resume passes the others over. The fsdp2 backend runs for real (one process, and two
gloo ranks); the Megatron backend's step logic runs with megatron-core's parts stubbed (its
training needs CUDA), through the same guard (hpc_rl/models/nonfinite.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpc_rl.algo import policy_loss
from hpc_rl.ckpt import apply_retention, find_resumable, list_checkpoints, load_checkpoint, model_fingerprint, save_checkpoint
from hpc_rl.ckpt.checkpoint import read_manifest
from hpc_rl.config import ConfigError, load_config
from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
from hpc_rl.models.nonfinite import KEY, NonFiniteGuard, NonFiniteStepsError, tensors_finite
from hpc_rl.rl.step_record import brief
from backend_batches import masked_batch
from gloo_ranks import run_ranks

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
RECIPE = "test_recipe"
CONFIG_YAML = f"recipe: {RECIPE}\n"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def _pg_loss(attn: torch.Tensor, adv: torch.Tensor):
    """The trainer's policy-gradient loss (reinforce) over the response tokens, each
    micro-batch scaled to its share: a NaN advantage anywhere makes the loss NaN, the way a
    non-finite reward does through the GRPO advantages."""
    mask = attn.clone()
    mask[:, 0] = 0

    def fn(lp, rows):
        loss, m = policy_loss(lp, None, adv[rows], mask[rows], kind="reinforce")
        return loss * (mask[rows].sum() / mask.sum()), m
    return fn


def _nan_adv(rows: int = 4, bad: int = 2) -> torch.Tensor:
    adv = torch.linspace(-1.0, 1.0, rows)
    adv[bad] = float("nan")
    return adv


def _weights(b: FSDP2Backend) -> dict:
    return {k: v.clone() for k, v in b.full_state_dict().items()}


def _all_finite(state: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values())


# -------------------------------------------------------------------- the shared guard


def test_guard_allows_max_in_a_row_resets_on_a_finite_step_and_then_fails_naming_the_key():
    g = NonFiniteGuard(2)
    assert g.record(False, "loss nan") == {"nonfinite_skipped": 1.0, "nonfinite_skipped_total": 1.0}
    g.record(False, "loss nan")
    assert g.record(True, "loss 1")["nonfinite_skipped_total"] == 2.0 and g.in_a_row == 0  # a finite step resets
    g.record(False, "loss nan")
    g.record(False, "loss nan")
    with pytest.raises(NonFiniteStepsError, match=rf"3 optimizer steps in a row.*{KEY}=2.*non-finite rewards"):
        g.record(False, "loss inf")
    assert NonFiniteStepsError.no_retry  # a requeue would replay the same prompts from the same checkpoint
    zero = NonFiniteGuard(0)
    with pytest.raises(NonFiniteStepsError, match=rf"{KEY}=0"):
        zero.record(False, "loss nan")
    back = NonFiniteGuard(2)
    back.load_state_dict(g.state_dict())
    assert (back.in_a_row, back.skipped_total) == (3, 5)


def test_tensors_finite_sees_one_nan_or_inf_anywhere():
    ts = [torch.ones(3, 4), torch.zeros(5, dtype=torch.bfloat16), torch.arange(4)]
    assert bool(tensors_finite(ts)) and bool(tensors_finite([]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(3, 4)
        t[2, 1] = bad
        assert not bool(tensors_finite([torch.ones(2), t]))
    # finite float32 values whose float32 sum would overflow are still finite
    assert bool(tensors_finite([torch.full((4,), 3e38)]))


def _agree_worker(rank: int, world: int, out: str) -> None:
    guard = NonFiniteGuard(3, dist.group.WORLD)
    seen = [guard.agree(rank != 1), guard.agree(True)]  # only rank 1 found a NaN, then nobody
    torch.save(seen, f"{out}.{rank}")


def test_every_rank_skips_when_one_rank_saw_a_nan(tmp_path):
    run_ranks(_agree_worker, 2, tmp_path / "store", str(tmp_path / "seen"))
    assert [torch.load(f"{tmp_path / 'seen'}.{r}") for r in range(2)] == [[False, True], [False, True]]


def test_max_nonfinite_steps_is_validated():
    assert load_config(["+recipe=tiny_grpo", "trainer.max_nonfinite_steps=0"]).trainer.max_nonfinite_steps == 0
    with pytest.raises(ConfigError) as info:
        load_config(["+recipe=tiny_grpo", "trainer.max_nonfinite_steps=-1"])
    assert "trainer.max_nonfinite_steps" in str(info.value) and ">= 0" in str(info.value)


# ------------------------------------------------------------------ the fsdp2 backend


def test_a_nan_advantage_skips_the_step_and_leaves_no_trace(tiny_ckpt):
    """The skipped step changes nothing (weights, Adam's state, the schedule's position): the
    finite step after it lands exactly where a backend that never saw the NaN lands."""
    ids, attn = masked_batch(4, 12)
    opt = OptimConfig(lr=1e-2, warmup_steps=3, warmup_start_lr=1e-3, max_nonfinite_steps=3)  # the lr moves per step
    b = FSDP2Backend(str(tiny_ckpt), optim=opt)
    before = _weights(b)
    m = b.train_step(ids, attn, _pg_loss(attn, _nan_adv()), micro_batch_size=2)
    assert m["nonfinite_skipped"] == 1.0 and m["nonfinite_skipped_total"] == 1.0 and math.isnan(m["loss"])
    after = _weights(b)
    assert _all_finite(after) and all(torch.equal(after[k], v) for k, v in before.items())
    assert b.step_count == 0 and not b.optimizer.state
    assert all(p.grad is None for p in b.model.parameters())

    good = torch.linspace(-1.0, 1.0, 4)
    m = b.train_step(ids, attn, _pg_loss(attn, good), micro_batch_size=2)
    assert m["nonfinite_skipped"] == 0.0 and m["nonfinite_skipped_total"] == 1.0 and b.step_count == 1
    clean = FSDP2Backend(str(tiny_ckpt), optim=opt)
    clean.train_step(ids, attn, _pg_loss(attn, good), micro_batch_size=2)
    trained, want = _weights(b), _weights(clean)
    assert any(not torch.equal(trained[k], before[k]) for k in before)
    assert all(torch.equal(trained[k], want[k]) for k in want)


def test_more_nonfinite_steps_in_a_row_than_the_key_allows_fail_the_run(tiny_ckpt):
    ids, attn = masked_batch(4, 12)
    b = FSDP2Backend(str(tiny_ckpt), optim=OptimConfig(lr=1e-2, max_nonfinite_steps=2))
    before = _weights(b)
    inf_loss = _pg_loss(attn, torch.full((4,), float("inf")))
    for _ in range(2):
        assert b.train_step(ids, attn, _pg_loss(attn, _nan_adv()))["nonfinite_skipped"] == 1.0
    with pytest.raises(NonFiniteStepsError, match=r"3 optimizer steps in a row.*trainer\.max_nonfinite_steps=2"):
        b.train_step(ids, attn, inf_loss)
    after = _weights(b)
    assert _all_finite(after) and all(torch.equal(after[k], v) for k, v in before.items()) and b.step_count == 0


def _sharded_worker(rank: int, world: int, ckpt: str, root: str, out: str) -> None:
    """Rank 1's rows alone carry a NaN advantage; then a finite step; then a checkpoint of
    weights that rank 1's shard alone has poisoned."""
    torch.manual_seed(0)
    ids, attn = masked_batch(4, 12)
    b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OptimConfig(lr=1e-2, max_nonfinite_steps=1))

    def mine():  # this rank's shards (the full state dict comes whole to rank 0 only)
        return {k: t.clone() for k, (_, t) in b.local_shards().items()}

    before = mine()
    adv = _nan_adv() if rank == 1 else torch.linspace(-1.0, 1.0, 4)
    skipped = b.train_step(ids, attn, _pg_loss(attn, adv))
    unchanged = all(torch.equal(v, before[k]) for k, v in mine().items())
    stepped = b.train_step(ids, attn, _pg_loss(attn, torch.linspace(-1.0, 1.0, 4)))
    trained = mine()
    save_checkpoint(root, 1, b, {}, CONFIG_YAML, group=dist.group.WORLD)
    if rank == 1:
        with torch.no_grad():
            next(iter(b.model.parameters())).to_local().view(-1)[0] = float("nan")
    save_checkpoint(root, 2, b, {}, CONFIG_YAML, group=dist.group.WORLD)
    torch.save({"skipped": skipped["nonfinite_skipped"], "unchanged": unchanged, "stepped": stepped["nonfinite_skipped"],
                "moved": any(not torch.equal(v, before[k]) for k, v in trained.items()), "trained": trained,
                "step_count": b.step_count}, f"{out}.{rank}")


def test_two_gloo_ranks_skip_together_when_one_ranks_rows_are_nan(tiny_ckpt, tmp_path):
    root, out = tmp_path / "checkpoints", tmp_path / "out"
    run_ranks(_sharded_worker, 2, tmp_path / "store", str(tiny_ckpt), str(root), str(out))
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    for g in got:
        assert g["skipped"] == 1.0 and g["unchanged"] and g["stepped"] == 0.0 and g["step_count"] == 1
        assert g["moved"] and _all_finite(g["trained"]) and len(g["trained"]) > 10
    # the checkpoints: rank 1's poisoned shard is seen by the manifest rank 0 writes
    assert read_manifest(root / "step_00000001")["weights_finite"] is True
    assert read_manifest(root / "step_00000002")["weights_finite"] is False
    assert read_manifest(root / "step_00000002")["nonfinite_steps"] == {"in_a_row": 0, "skipped_total": 1}


def _grpo_role_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    """The trainer role's GRPO step over two minibatches of one prompt group each; the second
    group holds a NaN reward (what an environment could return before issue 43)."""
    from hpc_rl.roles.trainer import TrainerRole

    role = TrainerRole.__new__(TrainerRole)
    role.cfg = load_config(["+recipe=tiny_grpo", "algo.prompts_per_step=2", "algo.generations_per_prompt=4",
                            "trainer.global_batch_size=4", "trainer.micro_batch_size=2"])
    role.ctx = SimpleNamespace(groups=SimpleNamespace(role=dist.group.WORLD))
    role.backend = FSDP2Backend(ckpt, optim=OptimConfig(lr=1e-2))
    ids, attn = masked_batch(8, 12)
    mask = attn.bool().clone()
    mask[:, :4] = False  # the first 4 tokens are the prompt
    lp = role.backend.logprobs(ids, attn)
    batch = SimpleNamespace(rows=[None] * 8, items=8, sibling_of=[], student_logprobs=lp,
                            rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, float("nan"), 0.0, 1.0]),
                            rollouts=SimpleNamespace(response_mask=mask, generation_logprobs=lp, input_ids=ids,
                                                     attention_mask=attn))
    torch.save({"metrics": role.train(batch), "step_count": role.backend.step_count}, out)


def test_the_trainer_role_counts_the_minibatch_a_nan_reward_spoiled(tiny_ckpt, tmp_path):
    run_ranks(_grpo_role_worker, 1, tmp_path / "store", str(tiny_ckpt), str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    m = got["metrics"]
    assert (m["optimizer_steps"], m["nonfinite_skipped"], m["nonfinite_skipped_total"]) == (2, 1, 1)
    assert got["step_count"] == 1 and math.isnan(m["advantage_mean"])


# ----------------------------------------------------------- checkpoints and retention


def test_retention_keeps_the_newest_finite_checkpoint_and_resume_takes_it(tiny_ckpt, tmp_path):
    """Saves 1-2 finite, 3-5 of NaN weights (as if they had got past the guard), keep_last=2
    after each: 2 survives beside 4 and 5; resume passes 5 and 4 over for 2, which loads."""
    ids, attn = masked_batch(4, 12)
    root = tmp_path / "checkpoints"
    b = FSDP2Backend(str(tiny_ckpt), optim=OptimConfig(lr=1e-2))
    b.train_step(ids, attn, _pg_loss(attn, _nan_adv()))  # a skip: the manifest carries the guard's counts
    for step in range(1, 6):
        b.train_step(ids, attn, _pg_loss(attn, torch.linspace(-1.0, 1.0, 4)))
        if step == 3:
            with torch.no_grad():
                next(iter(b.model.parameters())).view(-1)[0] = float("nan")
        save_checkpoint(root, step, b, {"data_pos": step}, CONFIG_YAML)
        apply_retention(root, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [2, 4, 5]
    assert [read_manifest(p)["weights_finite"] for _, p in list_checkpoints(root)] == [True, False, False]
    scan = find_resumable(root, model_fingerprint(b.model), RECIPE)
    assert scan.step == 2 and [p.name for p, _ in scan.skipped] == ["step_00000005", "step_00000004"]
    assert all("not finite" in why for _, why in scan.skipped)
    fresh = FSDP2Backend(str(tiny_ckpt), optim=OptimConfig(lr=1e-2))
    assert load_checkpoint(scan.path, fresh)["data_pos"] == 2
    assert _all_finite(_weights(fresh)) and fresh.nonfinite.skipped_total == 1 and fresh.step_count == 2
    # a later finite save lets the old one go
    fresh.train_step(ids, attn, _pg_loss(attn, torch.linspace(-1.0, 1.0, 4)))
    save_checkpoint(root, 6, fresh, {"data_pos": 6}, CONFIG_YAML)
    apply_retention(root, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [5, 6]


# ------------------------------------------------------------- the megatron backend


class _Optimizer:
    def __init__(self, result):
        self.param_groups, self.result, self.steps, self.zeroed = [{}], result, 0, 0

    def zero_grad(self):
        self.zeroed += 1

    def step(self):
        self.steps += 1
        return self.result


def _megatron(precision: str, limit: int, loss: float, grad: float, result=(True, 0.5, None)):
    """A MegatronBackend whose megatron-core parts are stubs: the schedule returns `loss`,
    every parameter's main_grad holds `grad`; its train_step is the real one."""
    from hpc_rl.config.schema import TrainerConfig
    from hpc_rl.models.megatron.backend import MegatronBackend

    b = MegatronBackend.__new__(MegatronBackend)
    b.precision, b.train_cfg, b.step_count = precision, TrainerConfig(), 0
    b.optimizer = _Optimizer(result)
    b.model = SimpleNamespace(train=lambda: None, zero_grad_buffer=lambda: None)
    b.core = torch.nn.Linear(3, 2)
    for p in b.core.parameters():
        p.main_grad = torch.full_like(p, grad)
    b.nonfinite = NonFiniteGuard(limit)
    b._chunks = lambda ids, mbs: [None]
    b._run = lambda batches, forward_only, loss_fn: [{"loss": loss, "rows": 2, "num_tokens": 5.0}]
    return b


def _megatron_step(b):
    return b.train_step(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4), loss_fn=None, micro_batch_size=2)


def test_megatron_skips_a_nan_loss_or_gradient_before_its_optimizer_step():
    ok = _megatron("bf16", 1, 1.5, 0.1)
    m = _megatron_step(ok)
    assert ok.optimizer.steps == 1 and ok.step_count == 1 and m["nonfinite_skipped"] == 0.0 and m["grad_norm"] == 0.5

    nan_loss = _megatron("bf16", 1, float("nan"), 0.1)
    m = _megatron_step(nan_loss)
    assert nan_loss.optimizer.steps == 0 and nan_loss.step_count == 0 and m["nonfinite_skipped"] == 1.0
    assert math.isnan(m["grad_norm"])

    inf_grad = _megatron("bf16", 1, 1.5, float("inf"))
    assert _megatron_step(inf_grad)["nonfinite_skipped"] == 1.0 and inf_grad.optimizer.steps == 0
    with pytest.raises(NonFiniteStepsError, match=r"2 optimizer steps in a row.*trainer\.max_nonfinite_steps=1"):
        _megatron_step(inf_grad)
    assert inf_grad.optimizer.steps == 0


def test_megatron_fp16_leaves_scaled_gradients_to_the_loss_scaler():
    """Under fp16 an overflow of the scaled gradients is megatron's loss scaler's business
    (it skips the update and lowers the scale): not counted, not fatal; a NaN loss is."""
    b = _megatron("fp16", 0, 1.5, float("inf"), result=(False, None, None))
    for _ in range(3):
        m = _megatron_step(b)
        assert m["nonfinite_skipped"] == 0.0 and m["grad_norm"] == 0.0
    assert b.optimizer.steps == 3 and b.step_count == 0  # the scaler's skips do not move the schedule
    b._run = lambda batches, forward_only, loss_fn: [{"loss": float("nan"), "rows": 2}]
    with pytest.raises(NonFiniteStepsError):
        _megatron_step(b)
    assert b.optimizer.steps == 3


def test_the_step_line_names_skipped_steps():
    rec = {"loss": float("nan"), "nonfinite_skipped": 1, "optimizer_steps": 2, "nonfinite_skipped_total": 3,
           "timing": {"step_s": 1.0}}
    assert "NON-FINITE loss or gradients: 1 of 2 optimizer steps skipped (3 in the run)" in brief(rec)
    assert "NON-FINITE" not in brief({**rec, "nonfinite_skipped": 0})

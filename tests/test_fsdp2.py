"""The FSDP2 backend: logprob convention, sharded == unsharded on 2 gloo ranks, checkpoint checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import CheckpointError, FSDP2Backend, OptimConfig, check_checkpoint, lr_at, token_logprobs
from backend_batches import masked_batch, masked_loss
from gloo_ranks import run_ranks

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
OPT = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def test_logprob_convention_matches_a_plain_forward(tiny_ckpt):
    ids, attn = masked_batch(4, 12)
    backend = FSDP2Backend(str(tiny_ckpt), train=False)
    lp = backend.logprobs(ids, attn)
    logits = backend.model(input_ids=ids, attention_mask=attn).logits
    manual = torch.log_softmax(logits[0, 2], -1)[ids[0, 3]]
    assert lp.shape == ids.shape and torch.all(lp[:, 0] == 0)
    assert torch.allclose(lp[0, 3], manual, atol=1e-6)
    assert torch.allclose(token_logprobs(logits, ids), lp)


def test_warmup_schedule():
    o = OptimConfig(lr=2e-6, warmup_steps=10, warmup_start_lr=3e-7)
    assert lr_at(0, o) == pytest.approx(3e-7) and lr_at(5, o) == pytest.approx(3e-7 + 0.5 * (2e-6 - 3e-7))
    assert lr_at(10, o) == lr_at(500, o) == 2e-6


def _sharded_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    torch.manual_seed(0)
    ids, attn = masked_batch(4, 12)
    backend = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OPT)
    before = backend.logprobs(ids, attn)
    metrics = backend.train_step(ids, attn, masked_loss(attn))
    after = backend.logprobs(ids, attn)
    state = backend.full_state_dict()
    if rank == 0:
        torch.save({"before": before, "after": after, "state": state, "metrics": metrics}, out)


def test_fsdp2_over_two_gloo_ranks_equals_one_process(tiny_ckpt, tmp_path):
    ids, attn = masked_batch(4, 12)
    single = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    ref_before = single.logprobs(ids, attn)
    ref_metrics = single.train_step(ids, attn, masked_loss(attn))
    ref_after = single.logprobs(ids, attn)
    ref_state = single.full_state_dict()

    out = tmp_path / "sharded.pt"
    run_ranks(_sharded_worker, 2, tmp_path / "store", str(tiny_ckpt), str(out))
    got = torch.load(out)
    assert torch.allclose(got["before"], ref_before, atol=1e-5)
    assert got["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
    assert torch.allclose(got["after"], ref_after, atol=1e-4)
    assert not torch.allclose(ref_after, ref_before, atol=1e-4)  # the step changed the model
    assert set(got["state"]) == set(ref_state)
    for name, tensor in ref_state.items():
        assert torch.allclose(got["state"][name], tensor, atol=1e-5), name


def test_checkpoint_checks_name_the_problem(tiny_ckpt, tmp_path):
    assert check_checkpoint(str(tiny_ckpt))["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(CheckpointError, match="no config.json"):
        check_checkpoint(str(tmp_path))
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        (no_tok / f).write_bytes((tiny_ckpt / f).read_bytes())
    with pytest.raises(CheckpointError, match="no tokenizer"):
        check_checkpoint(str(no_tok))
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (no_tok / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported"):
        check_checkpoint(str(no_tok))


def _grads_at_the_optimizer_step(backend: FSDP2Backend) -> dict:
    """Run the backend's real optimizer, but first keep the gradients it is handed: what
    micro-batching claims to reproduce is the accumulated gradient, not Adam's update."""
    seen, step = {}, backend.optimizer.step

    def keep_then_step(*args, **kwargs):
        seen.update({n: p.grad.detach().clone() for n, p in backend.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    backend.optimizer.step = keep_then_step
    return seen


def test_micro_batches_accumulate_to_the_full_batch_step(tiny_ckpt):
    """trainer.micro_batch_size is honoured: four micro-batches of one row, each loss scaled
    to its share, accumulate the same gradient as one pass over the four rows.

    Compared: the gradients handed to the optimizer, not the weights after it. Adam divides
    each gradient by its own running magnitude, so a float-order difference in a near-zero
    gradient becomes an update of order lr (a fresh CPU failed 1e-5 on one element of
    27,296 that way). The model runs in float64 here: summing the same terms in another
    order then moves a gradient by about n * 2^-53 of the sum of their magnitudes (n: the
    terms, here hundreds), far below 1e-9 of the tensor's largest gradient on any IEEE
    machine, while a micro-batch scaled to the wrong share moves it by a factor (about 4x
    for one row of four)."""
    ids, attn = masked_batch(4, 12)
    opt = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1e9)  # no clipping: raw gradients
    full = FSDP2Backend(str(tiny_ckpt), optim=opt)
    micro = FSDP2Backend(str(tiny_ckpt), optim=opt)
    full.model.double()
    micro.model.double()
    g_full, g_micro = _grads_at_the_optimizer_step(full), _grads_at_the_optimizer_step(micro)
    m_full = full.train_step(ids, attn, masked_loss(attn))
    m_micro = micro.train_step(ids, attn, masked_loss(attn), micro_batch_size=1)
    assert (m_full["micro_batches"], m_micro["micro_batches"]) == (1, 4)
    assert m_micro["loss"] == pytest.approx(m_full["loss"], rel=1e-12)
    assert g_full.keys() == g_micro.keys() and len(g_full) > 10
    for name, g in g_full.items():
        assert g.dtype == torch.float64
        scale = float(g.abs().max())
        assert float((g - g_micro[name]).abs().max()) <= 1e-9 * scale, name


def test_optimizer_name_is_honoured(tiny_ckpt):
    """adam puts weight decay into the gradient, adamw decouples it: with decay on, one
    step of each lands on different weights, and each backend holds the named class."""
    ids, attn = masked_batch(4, 12)
    states = {}
    for name, cls in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        b = FSDP2Backend(str(tiny_ckpt), optim=OptimConfig(name=name, lr=1e-2, weight_decay=0.1))
        assert type(b.optimizer) is cls
        b.train_step(ids, attn, masked_loss(attn))
        states[name] = b.full_state_dict()
    assert any(not torch.equal(states["adam"][k], states["adamw"][k]) for k in states["adam"])

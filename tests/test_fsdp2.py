"""The FSDP2 backend: logprob convention, sharded == unsharded on 2 gloo ranks, checkpoint checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import CheckpointError, FSDP2Backend, OptimConfig, check_checkpoint, lr_at, token_logprobs

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
OPT = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 100, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0  # right padding
    attn[3, 6:] = 0
    return ids, attn


def _loss(mask):
    def fn(lp):
        m = mask.float()
        return -(lp * m).sum() / m.sum(), {}
    return fn


def test_logprob_convention_matches_a_plain_forward(tiny_ckpt):
    ids, attn = _batch()
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


def _sharded_worker(rank: int, world: int, ckpt: str, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        ids, attn = _batch()
        backend = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OPT)
        before = backend.logprobs(ids, attn)
        metrics = backend.train_step(ids, attn, _loss(attn))
        after = backend.logprobs(ids, attn)
        state = backend.full_state_dict()
        if rank == 0:
            torch.save({"before": before, "after": after, "state": state, "metrics": metrics}, out)
    finally:
        dist.destroy_process_group()


def test_fsdp2_over_two_gloo_ranks_equals_one_process(tiny_ckpt, tmp_path):
    ids, attn = _batch()
    single = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    ref_before = single.logprobs(ids, attn)
    ref_metrics = single.train_step(ids, attn, _loss(attn))
    ref_after = single.logprobs(ids, attn)
    ref_state = single.full_state_dict()

    out = tmp_path / "sharded.pt"
    mp.start_processes(_sharded_worker, args=(2, str(tiny_ckpt), str(tmp_path / "store"), str(out)), nprocs=2,
                       join=True, start_method="spawn")
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

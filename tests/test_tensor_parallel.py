"""Tensor parallel (DTensor, with and without sequence parallel) on gloo ranks against the
data-parallel-only backend in one process: fp32 log-probs, one optimizer step, micro-batches,
greedy answers, and the refit source layout read from the live shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
from hpc_rl.models.parallel.mesh import ParallelDims
from hpc_rl.models.parallel.tensor_parallel import tp_problems
from backend_batches import masked_batch, masked_loss  # odd length: sequence parallel pads it
from gloo_ranks import run_ranks

SPEC = ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64)
# Adam's first step is lr * g / (|g| + eps): for gradients near eps it magnifies float32
# reduction-order noise (the same sums in another order) by ~1e7. Measured here: lr=1e-2
# gives max weight differences of 1.8e-5 (tp) and 2.7e-5 (tp, micro-batches of 1) against
# the dp-only step; lr=1e-3 keeps the comparison within the 1e-5, and the step still
# moves every weight by ~1e-3 (checked below, so equal weights are not untouched ones).
OPT = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("tiny_tp"), SPEC, seed=0)





def _prompts():
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])  # left-padded
    return ids, (ids != 0).long()


def _tp_worker(rank: int, world: int, ckpt: str, out: str, sp: bool, mbs, parallel=None) -> None:
    ids, attn = masked_batch(4, 11)
    b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OPT, parallel=parallel or {"tp": 2}, sequence_parallel=sp)
    before = b.logprobs(ids, attn)
    metrics = b.train_step(ids, attn, masked_loss(attn), micro_batch_size=mbs)
    state = b.full_state_dict()
    shards = {n: (start, t.clone()) for n, (start, t) in b.local_shards().items()}
    layout = b.source_layout("float32").to_dict()
    pids, pattn = _prompts()
    greedy = b.greedy(pids, pattn, 6, eos_id=7, pad_id=0)
    vocab_here = None
    if b.dims.tp > 1:  # the logits a rank holds: its slice of the vocabulary only
        from hpc_rl.models.parallel.forward import local_logits

        with torch.no_grad():
            vocab_here = local_logits(b.model, ids[:, :10], attn[:, :10])[0].shape[-1]
    torch.save({"vocab_here": vocab_here, "before": before, "metrics": metrics, "state": state, "shards": shards, "layout": layout,
                "greedy": greedy, "dp": (b.dp_rank, b.dp_size)}, f"{out}.{rank}")


def _run_tp(tmp_path, ckpt, sp, mbs=None, world=2, parallel=None):
    out = str(tmp_path / f"tp{int(sp)}")
    run_ranks(_tp_worker, world, tmp_path / f"store{int(sp)}", str(ckpt), out, sp, mbs, parallel)
    return [torch.load(f"{out}.{r}") for r in range(world)]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """The dp-only backend in one process: log-probs, one step, greedy answers."""
    ids, attn = masked_batch(4, 11)
    single = FSDP2Backend(str(tiny_ckpt), optim=OPT)
    before = single.logprobs(ids, attn)
    metrics = single.train_step(ids, attn, masked_loss(attn))
    pids, pattn = _prompts()
    greedy = single.greedy(pids, pattn, 6, eos_id=7, pad_id=0)
    return {"before": before, "metrics": metrics, "state": single.full_state_dict(), "greedy": greedy}


@pytest.mark.slow
@pytest.mark.parametrize("sp,mbs", [(True, 1), (False, None)], ids=["sequence_parallel-microbatch1", "tp_only"])
def test_tp2_equals_dp_only_logprobs_and_step(tiny_ckpt, reference, tmp_path, sp, mbs):
    ranks = _run_tp(tmp_path, tiny_ckpt, sp, mbs)
    ids, attn = masked_batch(4, 11)
    vocab = reference["state"]["lm_head.weight"].shape[0]
    for got in ranks:
        assert got["vocab_here"] == vocab // 2  # log-probs from half the vocabulary's logits per rank
        assert got["dp"] == (0, 1)  # two tp ranks of one data-parallel rank: the same rows
        assert torch.allclose(got["before"], reference["before"], atol=1e-5, rtol=0)
        assert got["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-5)
        assert got["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-4)
        assert got["metrics"]["micro_batches"] == (4 if mbs == 1 else 1)
        assert torch.equal(got["greedy"], reference["greedy"])
    for name, tensor in reference["state"].items():  # the whole weights come back on rank 0
        assert torch.allclose(ranks[0]["state"][name], tensor, atol=1e-5, rtol=0), name
    # the step moved the weights: the comparison above is not between two untouched models
    moved = max(float((ranks[0]["state"][n] - t).abs().max()) for n, t in _untrained(tiny_ckpt).items())
    assert moved > 5e-4

    # each rank holds half of every projection (column: rows, row: columns), whole norms
    st = reference["state"]
    for rank, got in enumerate(ranks):
        for name, (start, t) in got["shards"].items():
            whole = ranks[0]["state"][name]
            box = tuple(slice(a, a + n) for a, n in zip(start, t.shape))
            assert torch.equal(whole[box], t), name
        q = got["shards"]["model.layers.0.self_attn.q_proj.weight"]
        o = got["shards"]["model.layers.0.self_attn.o_proj.weight"]
        assert q[0] == (rank * st["model.layers.0.self_attn.q_proj.weight"].shape[0] // 2, 0)
        assert o[0] == (0, rank * st["model.layers.0.self_attn.o_proj.weight"].shape[1] // 2)
        assert got["shards"]["model.norm.weight"][1].shape == st["model.norm.weight"].shape
    # the source layout gathered from both ranks names exactly those boxes
    lay = ranks[0]["layout"]
    assert lay == ranks[1]["layout"]
    pieces = lay["model.layers.1.mlp.down_proj.weight"]["pieces"]
    assert pieces == [[0, [0, 0], [32, 32]], [1, [0, 32], [32, 64]]]


@pytest.mark.slow
def test_fsdp2_dp2_by_tp2_over_four_ranks_equals_dp_only(tiny_ckpt, reference, tmp_path):
    """2-D: FSDP2 over dp=2 on top of tp=2. Every rank is given the whole batch (FSDP2
    averages the dp ranks' gradients, so the step equals the one-process step on it)."""
    ranks = _run_tp(tmp_path, tiny_ckpt, True, world=4)
    assert [g["dp"] for g in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # tp innermost: ranks 0,1 share rows
    for got in ranks:
        assert torch.allclose(got["before"], reference["before"], atol=1e-5, rtol=0)
        assert got["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-4)
    for name, tensor in reference["state"].items():
        assert torch.allclose(ranks[0]["state"][name], tensor, atol=1e-5, rtol=0), name
    # rank 3 (dp 1, tp 1): the second half (dp) of q_proj's second half (tp): rows 24..31
    q = ranks[3]["shards"]["model.layers.0.self_attn.q_proj.weight"]
    assert q[0] == (24, 0) and tuple(q[1].shape) == (8, 32)
    lay = ranks[0]["layout"]["model.layers.0.self_attn.o_proj.weight"]["pieces"]
    assert sorted(lay) == [[0, [0, 0], [16, 16]], [1, [0, 16], [16, 32]], [2, [16, 0], [32, 16]], [3, [16, 16], [32, 32]]]


@pytest.mark.slow
def test_context_parallel_2_equals_dp_only(tiny_ckpt, reference, tmp_path):
    """cp=2: each rank its half of the tokens (11 -> padded to 12), K/V all-gathered in the
    attention, log-probs gathered; FSDP2 over the two cp ranks averages their gradients."""
    ranks = _run_tp(tmp_path, tiny_ckpt, False, mbs=2, parallel={"cp": 2})
    for got in ranks:
        assert got["dp"] == (0, 1)  # both cp ranks score the same rows
        assert torch.allclose(got["before"], reference["before"], atol=1e-5, rtol=0)
        assert got["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-5)
        assert got["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-4)
        assert torch.equal(got["greedy"], reference["greedy"])  # generation runs whole on each rank
    for name, tensor in reference["state"].items():
        assert torch.allclose(ranks[0]["state"][name], tensor, atol=1e-5, rtol=0), name


def _untrained(ckpt):
    return FSDP2Backend(str(ckpt), train=False).full_state_dict()


def test_mesh_rank_order_keeps_tp_innermost():
    d = ParallelDims.for_world(8, tp=2, cp=2)
    assert d.dp == 2
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.coords(5) == {"dp": 1, "cp": 0, "tp": 1}
    assert ParallelDims.for_world(8, tp=2, ep=4).ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="does not divide"):
        ParallelDims.for_world(6, tp=4)


def test_tp_problems_name_what_does_not_divide():
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 104,
           "tie_word_embeddings": False}
    assert tp_problems(cfg, 2) == []
    found = tp_problems(cfg, 4)
    assert any("num_key_value_heads=2" in p for p in found) and any("intermediate_size" not in p for p in found)
    assert any("tie_word_embeddings" in p for p in tp_problems(dict(cfg, tie_word_embeddings=True), 2))

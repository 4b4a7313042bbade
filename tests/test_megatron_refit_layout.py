"""Refit from Megatron's sharding (issue #16): the HF boxes each Megatron rank holds, the
source layout derived from shapes, and the planner moving real converted tensors into vLLM
engines with tensor and pipeline parallel workers. The cases NeMo RL's reshard refit does
not take are here on purpose: expert tensor parallel 2 and generator pipeline parallel 2."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.models.megatron.hf_mapping import ModelDims, Style, hf_to_megatron, padded_vocab, split_fused_experts
from hpc_rl.models.megatron.refit_layout import (layer_count, local_hf_shards, megatron_layout, megatron_refit_setup,
                                                 vllm_engine_layout, vllm_stage_layers)
from hpc_rl.models.families.nemotron_h.megatron_refit import pieces
from hpc_rl.models.megatron.shards import Parallel, local_state
from hpc_rl.refit.layout import Layout, LayoutError, merge
from hpc_rl.refit.planner import plan_refit
from hpc_rl.refit.vllm_layout import specs_of

from test_megatron_mapping import _model


@pytest.fixture(scope="module")
def tiny():
    out = {}
    for key in ("llama", "llama_tied", "qwen3", "qwen3_moe"):
        cfg, model = _model(key)
        hf = split_fused_experts({k: v.detach().clone() for k, v in model.state_dict().items()})
        d = ModelDims.from_hf_config(cfg.to_dict())
        if d.tied:
            hf.pop("lm_head.weight", None)
        out[key] = (d, hf)
    return out


def _shards(d, hf, p):
    s = Style(padded_vocab=padded_vocab(d.vocab, p.tp))
    whole = hf_to_megatron(hf, d, s)
    return s, {r: local_hf_shards(local_state(whole, d, p, r), d, s, p, r) for r in range(p.world)}


def _box(t, start, shape):
    return t[tuple(slice(a, a + n) for a, n in zip(start, shape))]


CASES = [("llama", Parallel(tp=2, pp=2, dp=2)), ("llama_tied", Parallel(tp=2, pp=2)), ("qwen3", Parallel(tp=2, cp=2)),
         ("qwen3_moe", Parallel(tp=2, pp=2, ep=2, etp=2, dp=2)), ("qwen3_moe", Parallel(tp=1, dp=4, ep=4))]
IDS = [f"{k}-tp{p.tp}cp{p.cp}dp{p.dp}pp{p.pp}ep{p.ep}etp{p.etp}" for k, p in CASES]


@pytest.mark.parametrize("key,p", CASES, ids=IDS)
def test_each_ranks_boxes_are_the_hf_tensors_and_the_layout_says_so(tiny, key, p):
    d, hf = tiny[key]
    s, shards = _shards(d, hf, p)
    lay = megatron_layout(specs_of(hf), d, s, p)
    for rank, boxes in shards.items():
        for name, (start, t) in boxes.items():
            assert torch.equal(t, _box(hf[name], start, t.shape)), (rank, name)
        got = {(n, tuple(st), tuple(a + b for a, b in zip(st, t.shape))) for n, (st, t) in boxes.items()}
        said = {(n, pc.start, pc.stop) for n, tl in lay.tensors.items() for pc in tl.pieces if pc.rank == rank}
        assert got == said, rank
    assert sorted(lay.tensors) == sorted(hf)  # every HF tensor has a source


def _run(plan, src_shards, hf, dst: Layout):
    """Execute a plan on real tensors: stage 0 reads the sender's Megatron-derived boxes,
    stage 1 forwards what a landing rank received. Every destination box must come out as
    the HF tensor's slice."""
    got = {}

    def read(boxes, name, start, stop):
        for st, t in boxes:
            if all(a >= s0 and b <= s0 + n for a, b, s0, n in zip(start, stop, st, t.shape)):
                return t[tuple(slice(a - s0, b - s0) for a, b, s0 in zip(start, stop, st))]
        raise AssertionError(f"{name} {start}..{stop}: the sender does not hold it")

    for bucket in plan.buckets:
        for tr in bucket:
            if tr.stage == 0:
                src = src_shards[tr.src]
                block = read(pieces(src[tr.name]) if tr.name in src else [], tr.name, tr.start, tr.stop)
            else:
                block = read(got.get((tr.src, tr.name), []), tr.name, tr.start, tr.stop)
            got.setdefault((tr.dst, tr.name), []).append((tr.start, block.clone()))
    for name, tl in dst.tensors.items():
        for pc in tl.pieces:
            if pc.numel() == 0:  # vLLM's padded vocabulary: a last TP rank may keep only padding rows
                continue
            parts = got[(pc.rank, name)]
            full = torch.full(hf[name].shape, float("nan"))
            for st, t in parts:
                full[tuple(slice(a, a + n) for a, n in zip(st, t.shape))] = t
            want = hf[name][tuple(slice(a, b) for a, b in zip(pc.start, pc.stop))]
            assert torch.equal(full[tuple(slice(a, b) for a, b in zip(pc.start, pc.stop))], want), (pc.rank, name)


@pytest.mark.parametrize("key,p,engines", [
    ("qwen3_moe", Parallel(tp=2, pp=2, ep=2, etp=2, dp=2), [(2, 2), (1, 1)]),  # etp 2 -> vLLM tp2 x pp2 and tp1
    ("llama", Parallel(tp=2, pp=2, dp=2), [(1, 4), (4, 1)]),  # trainer pp 2 -> generator pp 4
    ("qwen3", Parallel(tp=2, cp=2), [(2, 1)]),
], ids=["moe-etp2-to-tp2pp2", "llama-pp2-to-pp4", "qwen3-cp2-to-tp2"])
def test_planner_moves_megatron_shards_into_vllm_engines_exactly(tiny, key, p, engines):
    d, hf = tiny[key]
    s, shards = _shards(d, hf, p)
    specs = specs_of(hf)
    src = megatron_layout(specs, d, s, p)
    first, dsts = p.world, []
    for tp, pp in engines:
        dsts.append(vllm_engine_layout(specs, list(range(first, first + tp * pp)), tp, pp, d.num_layers))
        first += tp * pp
    dst = merge(*dsts)
    plan = plan_refit(src, dst)
    _run(plan, shards, hf, dst)
    # replicas share the sending: more than one data/context-parallel copy sends something
    senders = {t.src for t in plan.transfers if t.stage == 0}
    assert len(senders) > p.world // (p.dp * p.cp) or p.dp * p.cp == 1
    # nothing is received twice: bytes per destination rank equal what it keeps
    for r, n in plan.bytes_received().items():
        assert n == dst.bytes_on(r), r


def test_refit_setup_for_a_megatron_trainer_plans(tiny):
    d, hf = tiny["qwen3_moe"]
    p = Parallel(tp=2, ep=2, etp=2, dp=2)
    s = Style(padded_vocab=padded_vocab(d.vocab, p.tp))
    setup = megatron_refit_setup(specs_of(hf, "bfloat16"), d, s, p, n_engines=2, prefix="t", engine_tp=2, engine_pp=2)
    assert setup.world == 4 + 2 * 4 and setup.names[4 + 4 + 3] == "generator:1/w3"
    plan = setup.plan()
    assert plan.stats["bytes"] > 0 and {t.dst for t in plan.transfers} == set(range(4, 12))


def test_vllm_stage_split_is_vllms():
    from vllm.distributed.utils import get_pp_indices

    for layers in (4, 7, 9, 61):
        for pp in (1, 2, 3, 4):
            for st in range(pp):
                r = vllm_stage_layers(layers, pp, st)
                assert (r.start, r.stop) == get_pp_indices(layers, st, pp), (layers, pp, st)


def test_tied_embeddings_with_generator_pp_are_refused(tiny):
    d, hf = tiny["llama_tied"]
    with pytest.raises(LayoutError, match="tied embeddings"):
        vllm_engine_layout(specs_of(hf), [0, 1], tp=1, pp=2, num_layers=layer_count(specs_of(hf)))

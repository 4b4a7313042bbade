"""The vLLM destination with expert parallel on (enable_expert_parallel, data parallel 1):
whole routed experts per worker in vLLM's linear placement, the rest tensor parallel as
without it; the planner fed from an FSDP2 trainer and from the trainer's expert-parallel
shards; the setup check against the shapes an EP worker reports. No engine is started."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.models.parallel.expert_names import checkpoint_shards, checkpoint_specs
from hpc_rl.refit.layout import Layout, LayoutError, Piece, fsdp2, merge
from hpc_rl.refit.planner import plan_refit
from hpc_rl.refit.engine_group import refit_setup
from hpc_rl.refit.vllm_layout import check_against_model, ep_expert_blocks, vllm_tp_layout

E, H, I, V = 4, 64, 96, 104  # experts, hidden, moe intermediate, vocabulary
F32 = "float32"


def _fused_specs():
    """A tiny Qwen3-MoE as transformers 5 holds it in memory (fused experts)."""
    specs = {"model.embed_tokens.weight": ((V, H), F32), "model.norm.weight": ((H,), F32),
             "lm_head.weight": ((V, H), F32)}
    for i in range(2):
        p = f"model.layers.{i}."
        specs.update({
            p + "self_attn.q_proj.weight": ((64, H), F32),
            p + "self_attn.k_proj.weight": ((32, H), F32),
            p + "self_attn.v_proj.weight": ((32, H), F32),
            p + "self_attn.o_proj.weight": ((H, 64), F32),
            p + "self_attn.q_norm.weight": ((16,), F32),
            p + "self_attn.k_norm.weight": ((16,), F32),
            p + "input_layernorm.weight": ((H,), F32),
            p + "post_attention_layernorm.weight": ((H,), F32),
            p + "mlp.gate.weight": ((E, H), F32),
            p + "mlp.experts.gate_up_proj": ((E, 2 * I, H), F32),
            p + "mlp.experts.down_proj": ((E, H, I), F32),
        })
    return specs


SPECS = checkpoint_specs(_fused_specs())  # the refit's names: one tensor per expert
EXPERT_KINDS = ("gate_proj", "up_proj", "down_proj")


def _boxes(lay: Layout, name: str):
    return {p.rank: (p.start, p.stop) for p in lay.tensors[name].pieces}


def test_vllm_places_experts_in_contiguous_blocks_the_first_ranks_taking_the_remainder():
    assert ep_expert_blocks(4, 2) == [(0, 2), (2, 4)]
    assert ep_expert_blocks(5, 2) == [(0, 3), (3, 5)]
    assert ep_expert_blocks(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ep_expert_blocks(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # workers without experts


def test_each_expert_goes_whole_to_its_owner_and_the_rest_stays_tensor_parallel():
    ep, tp = vllm_tp_layout(SPECS, [2, 3], expert_parallel=True), vllm_tp_layout(SPECS, [2, 3])
    for i in range(2):
        for e in range(E):
            owner = 2 if e < 2 else 3
            for kind in EXPERT_KINDS:
                name = f"model.layers.{i}.mlp.experts.{e}.{kind}.weight"
                shape = (H, I) if kind == "down_proj" else (I, H)
                assert _boxes(ep, name) == {owner: ((0, 0), shape)}
    # without the flag the same expert is sliced over both workers (column / row parallel)
    assert _boxes(tp, "model.layers.0.mlp.experts.3.up_proj.weight") == {2: ((0, 0), (48, H)), 3: ((48, 0), (I, H))}
    assert _boxes(tp, "model.layers.0.mlp.experts.3.down_proj.weight") == {2: ((0, 0), (H, 48)), 3: ((0, 48), (H, I))}
    for name in SPECS:
        if ".experts." not in name:
            assert _boxes(ep, name) == _boxes(tp, name), name
    assert _boxes(ep, "model.layers.1.self_attn.k_proj.weight") == {2: ((0, 0), (16, H)), 3: ((16, 0), (32, H))}
    assert _boxes(ep, "model.layers.1.self_attn.o_proj.weight") == {2: ((0, 0), (H, 32)), 3: ((0, 32), (H, 64))}
    assert _boxes(ep, "model.layers.0.mlp.gate.weight") == {2: ((0, 0), (E, H)), 3: ((0, 0), (E, H))}
    assert _boxes(ep, "lm_head.weight") == {2: ((0, 0), (64, H)), 3: ((64, 0), (V, H))}


def test_shared_experts_stay_tensor_parallel_under_expert_parallel():
    p = "model.layers.0.mlp."
    specs = dict(SPECS)
    specs.update({p + "shared_expert.gate_proj.weight": ((32, H), F32),
                  p + "shared_expert.up_proj.weight": ((32, H), F32),
                  p + "shared_expert.down_proj.weight": ((H, 32), F32),
                  p + "shared_expert_gate.weight": ((1, H), F32)})
    lay = vllm_tp_layout(specs, [0, 1], expert_parallel=True)
    assert _boxes(lay, p + "shared_expert.up_proj.weight") == {0: ((0, 0), (16, H)), 1: ((16, 0), (32, H))}
    assert _boxes(lay, p + "shared_expert.down_proj.weight") == {0: ((0, 0), (H, 16)), 1: ((0, 16), (H, 32))}
    assert _boxes(lay, p + "shared_expert_gate.weight") == {0: ((0, 0), (1, H)), 1: ((0, 0), (1, H))}


def test_bytes_per_worker_are_those_of_tensor_parallel_only_the_experts_move_whole():
    ep, tp = vllm_tp_layout(SPECS, [0, 1], expert_parallel=True), vllm_tp_layout(SPECS, [0, 1])
    # per layer and worker, in floats: q 2048 + k 1024 + v 1024 + o 2048 + q/k norms 32
    # + two layer norms 128 + router 256 = 6560; experts: 2 of 3 * 96*64 = 36864 (the same
    # count as half of every expert under TP); vocabulary 64 (worker 0) or 40 rows of 64
    # for embed and lm_head; final norm 64
    assert [ep.bytes_on(r) for r in (0, 1)] == [4 * (2 * (6560 + 36864) + 2 * 64 * 64 + 64),
                                               4 * (2 * (6560 + 36864) + 2 * 40 * 64 + 64)]
    assert [ep.bytes_on(r) for r in (0, 1)] == [380416, 368128]
    assert [tp.bytes_on(r) for r in (0, 1)] == [380416, 368128]
    every_expert = 4 * 2 * E * 3 * I * H  # all experts of both layers, in bytes
    expert_bytes = [sum(p.numel() * 4 for n, t in ep.tensors.items() if ".experts." in n for p in t.pieces
                        if p.rank == r) for r in (0, 1)]
    assert expert_bytes == [every_expert // 2, every_expert // 2] == [294912, 294912]


def _covers_exactly_once(plan, src: Layout, dst: Layout) -> None:
    """Every element a destination worker keeps arrives exactly once, nothing else arrives,
    and every transfer reads a box its source rank holds."""
    for t in plan.transfers:
        assert t.stage == 0 and any(p.rank == t.src and all(a <= x and y <= b for a, x, y, b in
                                    zip(p.start, t.start, t.stop, p.stop)) for p in src.tensors[t.name].pieces), t
    got = {}
    for t in plan.transfers:
        hits = got.setdefault((t.dst, t.name), torch.zeros(dst.tensors[t.name].shape, dtype=torch.int32))
        hits[tuple(slice(a, b) for a, b in zip(t.start, t.stop))] += 1
    want = {}
    for name, tl in dst.tensors.items():
        for p in tl.pieces:
            need = want.setdefault((p.rank, name), torch.zeros(tl.shape, dtype=torch.int32))
            need[tuple(slice(a, b) for a, b in zip(p.start, p.stop))] += 1
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _trainer_ep_source(ranks, ep):
    """The boxes an expert-parallel trainer reports (hpc_rl/models/parallel): ep group rank
    j holds experts [j*E/ep, (j+1)*E/ep) of the fused tensors, split into checkpoint names
    by checkpoint_shards; everything else FSDP2 Shard(0) over all the trainer's ranks."""
    fused = _fused_specs()
    experts = {n: v for n, v in fused.items() if n.endswith(("gate_up_proj", "down_proj"))}
    lay = fsdp2({n: v for n, v in fused.items() if n not in experts}, ranks)
    per = E // ep
    for r in ranks:
        lo = (r % ep) * per
        for name, (shape, dtype) in experts.items():
            local = torch.empty((per,) + shape[1:], device="meta")
            for hf, (start, piece) in checkpoint_shards(name, shape, (lo, 0, 0), local).items():
                stop = tuple(a + n for a, n in zip(start, piece.shape))
                lay.add(hf, SPECS[hf][0], dtype, [Piece(r, start, stop)])
    return lay


@pytest.mark.parametrize("source", ["fsdp2", "trainer_ep2", "trainer_ep2_edp2"])
def test_plan_fills_every_ep_worker_exactly_once(source):
    n = 4 if source == "trainer_ep2_edp2" else 2
    src = fsdp2(SPECS, list(range(n))) if source == "fsdp2" else _trainer_ep_source(list(range(n)), 2)
    dst = merge(vllm_tp_layout(SPECS, [n, n + 1], expert_parallel=True),
                vllm_tp_layout(SPECS, [n + 2, n + 3], expert_parallel=True))  # two engines
    plan = plan_refit(src, dst)
    _covers_exactly_once(plan, src, dst)
    assert plan.bytes_received() == {n: 380416, n + 1: 368128, n + 2: 380416, n + 3: 368128}
    if source != "fsdp2":  # an expert comes from a trainer rank of its ep block only
        for t in plan.transfers:
            if ".experts." in t.name:
                e = int(t.name.split(".experts.")[1].split(".")[0])
                assert t.src % 2 == e // 2, t


def test_refit_setup_passes_the_flag_and_keeps_tensor_parallel_by_default():
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    ep = Layout.from_dict(refit_setup(SPECS, 2, 1, "t", engine_tp=2, engine_ep=True).dst)
    assert _boxes(ep, name) == {3: ((0, 0), (I, H))}
    tp = Layout.from_dict(refit_setup(SPECS, 2, 1, "t", engine_tp=2).dst)
    assert _boxes(tp, name) == {2: ((0, 0), (48, H)), 3: ((48, 0), (I, H))}


def _worker0_params(w13, w2):
    """Names and local shapes an enable_expert_parallel TP-2 worker 0 of vLLM 0.32 reports
    for this model (experts under `.mlp.experts.routed_experts.`, as bench/results shows)."""
    out = {"model.embed_tokens.weight": ((64, H), F32), "lm_head.weight": ((64, H), F32),
           "model.norm.weight": ((H,), F32)}
    for i in range(2):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.qkv_proj.weight": ((64, H), F32), p + "self_attn.o_proj.weight": ((H, 32), F32),
                    p + "self_attn.q_norm.weight": ((16,), F32), p + "self_attn.k_norm.weight": ((16,), F32),
                    p + "input_layernorm.weight": ((H,), F32), p + "post_attention_layernorm.weight": ((H,), F32),
                    p + "mlp.gate.weight": ((E, H), F32),
                    p + "mlp.experts.routed_experts.w13_weight": (w13, F32),
                    p + "mlp.experts.routed_experts.w2_weight": (w2, F32)})
    return out


def test_check_against_an_ep_worker_accepts_whole_experts_and_names_sliced_ones():
    check_against_model(SPECS, _worker0_params((2, 2 * I, H), (2, H, I)), tp_size=2, expert_parallel=True)
    sliced = _worker0_params((E, I, H), (E, H, I // 2))  # what the same engine holds without EP
    check_against_model(SPECS, sliced, tp_size=2)
    with pytest.raises(LayoutError) as err:
        check_against_model(SPECS, sliced, tp_size=2, expert_parallel=True)
    text = str(err.value)
    assert ("model.layers.0.mlp.experts.3.up_proj.weight: shape (96, 64) does not fit expert 3 of vLLM's "
            "model.layers.0.mlp.experts.routed_experts.w13_weight (4, 96, 64) (expert parallel: 2 whole experts "
            "of (192, 64) expected)") in text
    assert ("model.layers.1.mlp.experts.0.down_proj.weight: shape (64, 96) does not fit expert 0 of vLLM's "
            "model.layers.1.mlp.experts.routed_experts.w2_weight (4, 64, 48)") in text
    assert text.count("does not fit expert") == 2 * E * 3  # every expert tensor, nothing else
    with pytest.raises(LayoutError, match=r"experts\.2\.gate_proj\.weight: .*\(3, 192, 64\)"):
        check_against_model(SPECS, _worker0_params((3, 2 * I, H), (2, H, I)), tp_size=2, expert_parallel=True)


def test_a_layer_missing_an_expert_is_refused_rather_than_misplaced():
    specs = {n: v for n, v in SPECS.items() if ".experts.1." not in n or "layers.0" not in n}
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.mlp\.experts: expert ids \[0, 2, 3\] are not 0\.\.2"):
        vllm_tp_layout(specs, [0, 1], expert_parallel=True)

"""The vLLM side in HF names: fused q/k/v and gate/up members, vLLM's padded vocabulary
split, and the setup check against a model's parameters (here the names and loader-format
shapes vLLM 0.32 reports for a TP-1 Llama; the RL loop tests check a live engine)."""

from __future__ import annotations

import pytest

from hpc_rl.refit.layout import LayoutError
from hpc_rl.refit.vllm_layout import (check_against_model, fused_targets, vllm_name, vllm_tp_layout,
                                      vocab_bounds)

SPECS = {
    "model.embed_tokens.weight": ((104, 64), "float32"),
    "model.layers.0.self_attn.q_proj.weight": ((64, 64), "float32"),
    "model.layers.0.self_attn.k_proj.weight": ((32, 64), "float32"),
    "model.layers.0.self_attn.v_proj.weight": ((32, 64), "float32"),
    "model.layers.0.self_attn.o_proj.weight": ((64, 64), "float32"),
    "model.layers.0.mlp.gate_proj.weight": ((192, 64), "float32"),
    "model.layers.0.mlp.up_proj.weight": ((192, 64), "float32"),
    "model.layers.0.mlp.down_proj.weight": ((64, 192), "float32"),
    "model.layers.0.input_layernorm.weight": ((64,), "float32"),
    "lm_head.weight": ((104, 64), "float32"),
}
VLLM_TP1 = {
    "model.embed_tokens.weight": ((128, 64), "float32"),  # padded to a multiple of 64
    "model.layers.0.self_attn.qkv_proj.weight": ((128, 64), "float32"),
    "model.layers.0.self_attn.o_proj.weight": ((64, 64), "float32"),
    "model.layers.0.mlp.gate_up_proj.weight": ((384, 64), "float32"),
    "model.layers.0.mlp.down_proj.weight": ((64, 192), "float32"),
    "model.layers.0.input_layernorm.weight": ((64,), "float32"),
    "lm_head.weight": ((128, 64), "float32"),
}


def test_fused_members_land_at_their_offsets_on_each_tp_rank():
    t = fused_targets(SPECS, tp_size=2)
    q, k, v = (t[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert (q.param, q.shard_id, q.offset, q.rows) == ("model.layers.0.self_attn.qkv_proj.weight", "q", 0, 32)
    assert (k.offset, k.rows, v.offset, v.rows) == (32, 16, 48, 16)
    up = t["model.layers.0.mlp.up_proj.weight"]
    assert (up.param, up.shard_id, up.offset) == ("model.layers.0.mlp.gate_up_proj.weight", 1, 96)
    assert vllm_name("model.layers.3.mlp.gate_proj.weight") == "model.layers.3.mlp.gate_up_proj.weight"


def test_vocabulary_is_split_the_way_vllm_pads_it():
    assert vocab_bounds(104, 1) == [(0, 104)]
    assert vocab_bounds(104, 2) == [(0, 64), (64, 104)]  # padded 128 -> 64 rows each, the last clipped
    assert vocab_bounds(129280, 32) == [(r * 4040, (r + 1) * 4040) for r in range(32)]
    lay = vllm_tp_layout(SPECS, [7, 8])
    heads = {p.rank: (p.start, p.stop) for p in lay.tensors["lm_head.weight"].pieces}
    assert heads == {7: ((0, 0), (64, 64)), 8: ((64, 0), (104, 64))}
    down = {p.rank: (p.start, p.stop) for p in lay.tensors["model.layers.0.mlp.down_proj.weight"].pieces}
    assert down == {7: ((0, 0), (64, 96)), 8: ((0, 96), (64, 192))}  # row parallel: split along dim 1


def test_check_against_a_tp1_model_passes_and_names_every_mismatch():
    check_against_model(SPECS, VLLM_TP1)
    bad = dict(SPECS)
    bad["model.layers.0.mlp.router.weight"] = ((8, 64), "float32")  # vLLM has no such parameter
    bad["model.layers.0.self_attn.k_proj.weight"] = ((16, 64), "float32")  # qkv would not add up
    bad["model.layers.0.input_layernorm.weight"] = ((64,), "bfloat16")
    with pytest.raises(LayoutError) as err:
        check_against_model(bad, VLLM_TP1)
    text = str(err.value)
    assert "model.layers.0.mlp.router.weight: vLLM's model has no parameter" in text
    assert "qkv_proj.weight: its members add up to 112 rows, vLLM's parameter has 128" in text
    assert "input_layernorm.weight: dtype bfloat16 (trainer side) vs float32" in text


def test_a_pre_sharded_slice_answers_only_the_narrow_to_itself():
    """What a TP>1 worker hands vLLM's loaders (live TP-2 engines are exercised by
    test_families): the global shape, the slice for the loader's own narrow, and a
    clear error for anything else, so a split that disagrees cannot load silently."""
    import torch

    from hpc_rl.refit.presharded import PreShardedWeight, as_loader_weight

    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    rows = as_loader_weight(full[2:4].clone(), (6, 4), (2, 0), "x.q_proj.weight")
    assert isinstance(rows, PreShardedWeight) and tuple(rows.shape) == (6, 4) and rows.dim() == 2
    assert torch.equal(rows.narrow(0, 2, 2), full[2:4]) and torch.equal(torch.narrow(rows, 0, 2, 2), full[2:4])
    cols = as_loader_weight(full[:, 2:].clone(), (6, 4), (0, 2), "x.o_proj.weight")
    assert torch.equal(cols.narrow(1, 2, 2), full[:, 2:])
    with pytest.raises(RuntimeError, match=r"x.q_proj.weight: vLLM's loader asked for rows 0:2 of dim 0, this worker received rows 2:4"):
        rows.narrow(0, 0, 2)
    with pytest.raises(RuntimeError, match="x.q_proj.weight: vLLM's loader applied aten.copy_"):
        torch.empty(6, 4).copy_(rows)
    with pytest.raises(RuntimeError, match="only a narrow to that slice"):
        rows + 1
    whole = full.clone()
    assert as_loader_weight(whole, (6, 4), (0, 0), "norm.weight") is whole  # whole tensors go as they are
    with pytest.raises(ValueError, match="not a slice along one dimension"):
        PreShardedWeight(full[2:4, 2:].clone(), (6, 4), (2, 2), "x")

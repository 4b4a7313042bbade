"""The Megatron backend's CPU-testable half (issue #16): HF <-> Megatron conversion and
Megatron's sharding on tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints built with
transformers (no forward), the names checked against GPTModels megatron-core builds on CPU,
the rank order against megatron-core's RankGenerator, and the TransformerConfig mapping
validated by megatron-core's own dataclass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_rl.models.megatron import config_map
from hpc_rl.models.megatron.hf_mapping import (MappingError, ModelDims, Style, hf_to_megatron, megatron_to_hf,
                                               padded_vocab, split_fused_experts)
from hpc_rl.models.megatron.shards import Coords, Parallel, coords_of, gather, local_state

REPO = Path(__file__).resolve().parents[1]
_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    # layer 1 dense (mlp_only_layers), the others MoE: both kinds of layer in one model
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                       decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)),
}


def _model(key: str):
    import transformers

    cfg_cls, model_cls, extra = CONFIGS[key]
    torch.manual_seed(hash(key) % 1000)
    cfg = getattr(transformers, cfg_cls)(**_BASE, **extra)
    return cfg, getattr(transformers, model_cls)(cfg)


@pytest.fixture(scope="module")
def models():
    out = {}
    for key in CONFIGS:
        cfg, model = _model(key)
        out[key] = (cfg.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _assert_bitwise(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _checkpoint_names(hf):
    return split_fused_experts(hf)


STYLES = [Style(te=True, grouped_experts=True), Style(te=False, grouped_experts=False),
          Style(te=True, grouped_experts=False, padded_vocab=128)]


@pytest.mark.parametrize("key", list(CONFIGS))
@pytest.mark.parametrize("style", STYLES, ids=["te_grouped", "local_sequential", "te_padded"])
def test_hf_megatron_hf_round_trip_is_bitwise(models, key, style):
    cfg, hf = models[key]
    d = ModelDims.from_hf_config(cfg)
    mc = hf_to_megatron(hf, d, style)
    back = megatron_to_hf(mc, d, style)
    expect = _checkpoint_names(hf)
    if d.tied:
        expect.pop("lm_head.weight", None)
    _assert_bitwise(back, expect)
    if style.padded_vocab:
        assert mc["embedding.word_embeddings.weight"].shape[0] == 128
        assert not mc["embedding.word_embeddings.weight"][96:].any()


def test_qkv_is_grouped_by_key_value_head(models):
    cfg, hf = models["qwen3"]
    d = ModelDims.from_hf_config(cfg)
    qkv = hf_to_megatron(hf, d)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    # group 1 = query heads 2,3, then key head 1, then value head 1 (head_dim 8)
    g1 = qkv[32:64]
    assert torch.equal(g1[:16], q[16:32]) and torch.equal(g1[16:24], k[8:16]) and torch.equal(g1[24:32], v[8:16])


def test_fused_in_memory_experts_split_like_save_pretrained(tmp_path):
    from safetensors.torch import load_file

    _, model = _model("qwen3_moe")
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    mine = split_fused_experts(model.state_dict())
    mine.pop("lm_head.weight", None) if "lm_head.weight" not in saved else None
    _assert_bitwise({k: v.contiguous() for k, v in mine.items()}, saved)


def test_leftover_or_missing_tensors_are_named(models):
    cfg, hf = models["llama"]
    d = ModelDims.from_hf_config(cfg)
    extra = dict(hf, **{"model.layers.0.mlp.extra.weight": torch.zeros(1)})
    with pytest.raises(MappingError, match="extra"):
        hf_to_megatron(extra, d)
    missing = {k: v for k, v in hf.items() if "layers.3.mlp.up_proj" not in k}
    with pytest.raises(MappingError, match="layers.3.mlp.up_proj"):
        hf_to_megatron(missing, d)
    with pytest.raises(MappingError, match="nemotron_h"):
        ModelDims.from_hf_config({"model_type": "nemotron_h"})


DENSE_MESHES = [Parallel(tp=2, pp=2, dp=2), Parallel(tp=2, cp=2, pp=4)]
MOE_MESHES = [Parallel(tp=2, pp=2, ep=2, etp=1), Parallel(tp=2, cp=2, pp=2, ep=2, etp=2), Parallel(tp=1, dp=4, ep=4, etp=1),
              Parallel(tp=2, dp=2, ep=4, etp=1)]
CASES = [(k, m) for k in ("llama_tied", "qwen2", "qwen3") for m in DENSE_MESHES] + [("qwen3_moe", m) for m in MOE_MESHES]


@pytest.mark.parametrize("key,mesh", CASES, ids=[f"{k}-tp{p.tp}cp{p.cp}dp{p.dp}pp{p.pp}ep{p.ep}etp{p.etp}" for k, p in CASES])
def test_shard_over_the_mesh_and_gather_back_is_bitwise(models, key, mesh):
    cfg, hf = models[key]
    d = ModelDims.from_hf_config(cfg)
    style = Style(padded_vocab=padded_vocab(d.vocab, mesh.tp))
    whole = hf_to_megatron(hf, d, style)
    shards = {r: local_state(whole, d, mesh, r) for r in range(mesh.world)}
    # every rank holds a part of the model, no rank holds it all (unless nothing is split)
    assert all(shards.values())
    back = gather(shards, {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}, d, mesh)
    _assert_bitwise(megatron_to_hf(back, d, style), megatron_to_hf(whole, d, style))
    # a tied model's last stage holds the embedding as its output layer when pp > 1
    last = max(r for r in shards if coords_of(r, mesh).pp == mesh.pp - 1)
    assert ("output_layer.weight" in shards[last]) == (not d.tied or mesh.pp > 1)


def test_local_shapes_follow_megatron_rules(models):
    cfg, hf = models["qwen3_moe"]
    d = ModelDims.from_hf_config(cfg)
    mesh = Parallel(tp=2, dp=2, pp=2, ep=2, etp=2)
    style = Style(padded_vocab=padded_vocab(d.vocab, 2))
    s = local_state(hf_to_megatron(hf, d, style), d, mesh, 7)  # tp 1, ep 1, etp 1, stage 1
    assert coords_of(7, mesh) == Coords(tp=1, cp=0, dp=1, pp=1, etp=1, ep=1, edp=0)
    # stage 1 holds layers 2, 3 as local 0, 1; ep rank 1 holds experts 2, 3 as local 0, 1
    assert s["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 8 // 2, 32)
    assert s["decoder.layers.1.mlp.experts.linear_fc1.weight1"].shape == (16, 32)  # 2*16 rows / etp 2
    assert s["decoder.layers.1.mlp.experts.linear_fc2.weight1"].shape == (32, 8)
    whole = hf_to_megatron(hf, d, style)
    gate_up = whole["decoder.layers.3.mlp.experts.linear_fc1.weight3"]
    assert torch.equal(s["decoder.layers.1.mlp.experts.linear_fc1.weight1"], torch.cat([gate_up[8:16], gate_up[24:32]]))
    assert "embedding.word_embeddings.weight" not in s and s["output_layer.weight"].shape == (128, 32)  # 256 padded rows / tp 2


def test_rank_order_is_megatrons():
    from megatron.core.parallel_state import RankGenerator

    p = Parallel(tp=2, cp=2, dp=2, pp=2, ep=4, etp=1)
    dense = RankGenerator(tp=p.tp, ep=1, dp=p.dp, pp=p.pp, cp=p.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=p.etp, ep=p.ep, dp=p.edp, pp=p.pp, cp=1, order="tp-cp-ep-dp-pp")
    for token, attr, gen in (("tp", "tp", dense), ("cp", "cp", dense), ("dp", "dp", dense), ("pp", "pp", dense),
                             ("ep", "ep", expert), ("tp", "etp", expert), ("dp", "edp", expert)):
        for group in gen.get_ranks(token):
            # inside one group the coordinate runs 0..n-1 in order and the others stay fixed
            coords = [coords_of(r, p) for r in group]
            assert [getattr(c, attr) for c in coords] == list(range(len(group))), (token, group)


def test_transformer_config_mapping_builds_megatrons_dataclass(models):
    cfg, _ = models["qwen3_moe"]
    p = Parallel(tp=2, cp=2, dp=2, pp=2, ep=2, etp=1)
    kw = config_map.transformer_kwargs(cfg, p, sequence_parallel=True, precision="bf16", te=False)
    tc = config_map.transformer_config(kw)
    assert (tc.tensor_model_parallel_size, tc.context_parallel_size, tc.pipeline_model_parallel_size,
            tc.expert_model_parallel_size, tc.expert_tensor_parallel_size) == (2, 2, 2, 2, 1)
    assert tc.num_query_groups == 2 and tc.kv_channels == 8 and tc.qk_layernorm and tc.sequence_parallel
    assert tc.moe_layer_freq == [1, 0, 1, 1] and tc.num_moe_experts == 4 and tc.moe_router_topk == 2
    assert tc.moe_router_pre_softmax is False  # norm_topk_prob: top-k, then softmax over the k
    assert tc.params_dtype == torch.bfloat16 and tc.bf16 and tc.hidden_dropout == 0.0
    mk = config_map.model_kwargs(cfg, p, 256)
    assert mk["vocab_size"] == 256 and mk["rotary_base"] == 10000 and not mk["share_embeddings_and_output_weights"]


def test_optimizer_mapping_is_the_distributed_optimizer():
    from hpc_rl.config import load_config

    train = load_config(["+recipe=ultra_mopd"]).trainer
    oc = config_map.optimizer_config(config_map.optimizer_kwargs(train, "bf16"))
    assert oc.use_distributed_optimizer and oc.lr == 2.0e-6 and oc.clip_grad == 1.0
    assert oc.decoupled_weight_decay is False  # the recipe's optimizer.name=adam: decay in the gradient


def test_layout_problems_name_every_reason(models):
    cfg, _ = models["qwen3_moe"]
    d = ModelDims.from_hf_config(cfg)
    got = config_map.layout_problems(d, Parallel(tp=8, pp=3, ep=3, etp=1, dp=3), sequence_parallel=False, max_seq_len=100)
    text = " | ".join(got)
    for needle in ("attention heads", "pipeline parallel 3", "expert parallel 3", "sequence parallel"):
        assert needle in text, (needle, text)
    assert config_map.layout_problems(d, Parallel(tp=2, pp=2, ep=2, dp=2), True, 128) == []


def test_names_and_shapes_match_gptmodels_megatron_builds_on_cpu(models, tmp_path):
    """The local (non-TE) layer spec's state dict, built by megatron-core itself, has
    exactly the names and shapes hf_to_megatron writes (sequential experts, vocabulary
    padded to 128)."""
    wanted = ["llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe"]
    (tmp_path / "cfgs.json").write_text(json.dumps({k: models[k][0] for k in wanted}, default=str))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_names.py"), str(tmp_path / "cfgs.json")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in wanted:
        cfg, hf = models[key]
        d = ModelDims.from_hf_config(cfg)
        mc = hf_to_megatron(hf, d, Style(te=False, grouped_experts=False, padded_vocab=padded_vocab(d.vocab, 1)))
        assert {k: list(v.shape) for k, v in mc.items()} == built[key], key


def test_process_groups_are_megatrons():
    from megatron.core.parallel_state import RankGenerator

    from hpc_rl.models.megatron.shards import mesh_groups

    p = Parallel(tp=2, cp=2, dp=2, pp=2, ep=2, etp=2)
    dense = RankGenerator(tp=p.tp, ep=1, dp=p.dp, pp=p.pp, cp=p.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=p.etp, ep=p.ep, dp=p.edp, pp=p.pp, cp=1, order="tp-cp-ep-dp-pp")
    ours = mesh_groups(p)
    for name, gen, token in (("tp", dense, "tp"), ("cp", dense, "cp"), ("dp", dense, "dp"), ("pp", dense, "pp"),
                             ("tp_cp", dense, "tp-cp"), ("dp_cp", dense, "cp-dp"), ("mp", dense, "tp-pp"),
                             ("tp_dp_cp", dense, "tp-cp-dp"), ("ep", expert, "ep"), ("expt_tp", expert, "tp"),
                             ("expt_dp", expert, "dp"), ("tp_ep", expert, "tp-ep"), ("tp_ep_pp", expert, "tp-ep-pp")):
        assert ours[name] == sorted(sorted(g) for g in gen.get_ranks(token)), name
    assert ours["embd"][0] == [0, 8] and ours["pos_embd"][0] == [0]


def test_loading_helpers_read_the_checkpoint_and_follow_fsdp2s_schedule(tmp_path):
    from hpc_rl.config import load_config
    from hpc_rl.models.assets import ModelSpec, save_untrained
    from hpc_rl.models.fsdp2 import OptimConfig, lr_at as fsdp2_lr_at
    from hpc_rl.models.megatron.loading import lr_at, meta_hf_model, read_hf

    ckpt = save_untrained(tmp_path / "tiny", ModelSpec(hidden=64, intermediate=128, layers=1, heads=2), seed=0)
    cfg, state = read_hf(str(ckpt))
    assert cfg["model_type"] == "llama" and "model.layers.0.mlp.up_proj.weight" in state
    meta = meta_hf_model(str(ckpt))
    assert meta.config.vocab_size == cfg["vocab_size"] and next(meta.parameters()).device.type == "meta"
    train = load_config(["+recipe=ultra_mopd"]).trainer
    o, s = train.optimizer, train.scheduler
    ref = OptimConfig(lr=o.lr, warmup_steps=s.warmup_steps, warmup_start_lr=s.warmup_start_lr)
    assert [lr_at(k, train) for k in range(12)] == [fsdp2_lr_at(k, ref) for k in range(12)]

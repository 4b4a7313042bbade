"""Nemotron-H on the Megatron backend, its CPU-testable half (issue #25): the HF <-> Megatron
mapping of the tiny dense (M*M-) and MoE (MEM*E: latent MoE, shared expert, router bias)
hybrids, megatron-core's Mamba tensor-parallel layout, and the TransformerConfig / MambaModel
arguments validated by megatron-core's own dataclass. Random checkpoints of the tiny assets'
shapes (save_untrained: seconds, no training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.models.assets import NemotronHModelSpec, NemotronHMoeModelSpec, save_untrained
from hpc_rl.models.megatron import config_map
from hpc_rl.models.megatron.hf_mapping import MappingError, Style, padded_vocab
from hpc_rl.models.families.nemotron_h.megatron_mapping import NemotronHDims, hf_to_megatron, megatron_to_hf, pattern_of
from hpc_rl.models.families.nemotron_h.megatron_refit import pieces
from hpc_rl.models.megatron.refit_layout import local_hf_shards, megatron_layout, vllm_engine_layout
from hpc_rl.models.megatron.shards import Parallel, coords_of, gather, local_state
from hpc_rl.refit.layout import merge
from hpc_rl.refit.planner import plan_refit
from hpc_rl.refit.vllm_layout import specs_of

from test_megatron_refit_layout import _run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for key, spec in (("dense", NemotronHModelSpec()), ("moe", NemotronHMoeModelSpec())):
        path = save_untrained(tmp_path_factory.mktemp(key), spec, seed=3)
        out[key] = (json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors")))
    return out


def _bitwise(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("key", ["dense", "moe"])
def test_hf_megatron_hf_round_trip_is_bitwise(checkpoints, key):
    cfg, hf = checkpoints[key]
    d = NemotronHDims.from_hf_config(cfg)
    assert d.pattern == {"dense": "M*M-", "moe": "MEM*E"}[key]
    s = Style(padded_vocab=padded_vocab(d.vocab, 2))
    mc = hf_to_megatron(hf, d, s)
    assert mc["embedding.word_embeddings.weight"].shape[0] == 256  # 104 rows padded to 128 * tp
    _bitwise(megatron_to_hf(mc, d, s), hf)


def test_mamba_and_moe_tensors_land_under_megatrons_names(checkpoints):
    cfg, hf = checkpoints["moe"]
    d = NemotronHDims.from_hf_config(cfg)
    mc = hf_to_megatron(hf, d)
    # the block norm fuses into the mixer's in_proj (TE's LayerNormLinear); [z, x, B, C, dt] kept
    assert torch.equal(mc["decoder.layers.0.mixer.in_proj.layer_norm_weight"], hf["backbone.layers.0.norm.weight"])
    assert torch.equal(mc["decoder.layers.0.mixer.in_proj.weight"], hf["backbone.layers.0.mixer.in_proj.weight"])
    assert mc["decoder.layers.0.mixer.A_log"].dtype == torch.float32
    # an MoE layer: its own pre-MLP norm, the router's correction bias as megatron's expert bias
    assert torch.equal(mc["decoder.layers.1.pre_mlp_layernorm.weight"], hf["backbone.layers.1.norm.weight"])
    bias = mc["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, hf["backbone.layers.1.mixer.gate.e_score_correction_bias"])
    assert torch.equal(mc["decoder.layers.1.mlp.experts.linear_fc1.weight3"], hf["backbone.layers.1.mixer.experts.3.up_proj.weight"])
    assert torch.equal(mc["decoder.layers.4.mlp.fc2_latent_proj.weight"], hf["backbone.layers.4.mixer.fc2_latent_proj.weight"])
    assert torch.equal(mc["decoder.final_norm.weight"], hf["backbone.norm_f.weight"])
    # attention: q/k/v rows grouped per key/value head, the norm fused into linear_qkv
    assert mc["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (3 * 64, 64)
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in mc


def test_in_memory_names_and_fused_experts_map_like_the_checkpoint(checkpoints):
    """transformers' module says `model.` and keeps an MoE layer's experts fused [E, out, in]."""
    cfg, hf = checkpoints["moe"]
    d = NemotronHDims.from_hf_config(cfg)
    mem = {}
    for name, t in hf.items():
        name = "model." + name[len("backbone."):] if name.startswith("backbone.") else name
        mem[name] = t
    for layer in (1, 4):
        for kind in ("up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mixer.experts.{e}.{kind}.weight" for e in range(4)]
            mem[f"model.layers.{layer}.mixer.experts.{kind}"] = torch.stack([mem.pop(n) for n in names])
    _bitwise(hf_to_megatron(mem, d), hf_to_megatron(hf, d))


def test_the_pattern_is_read_from_either_config_key_and_mtp_is_left_to_the_export(checkpoints):
    cfg, hf = checkpoints["dense"]
    assert pattern_of({"hybrid_override_pattern": "M*M-"}) == pattern_of(cfg) == "M*M-"
    with pytest.raises(MappingError, match="one of M, \\*, -, E"):
        pattern_of({"hybrid_override_pattern": "M*X"})
    d = NemotronHDims.from_hf_config(cfg)
    with_mtp = dict(hf, **{"mtp.layers.0.eh_proj.weight": torch.zeros(64, 128)})
    _bitwise(hf_to_megatron(with_mtp, d), hf_to_megatron(hf, d))  # carried by ckpt/carry.py, not trained
    broken = dict(hf)
    broken.pop("backbone.layers.0.mixer.dt_bias")
    with pytest.raises(MappingError, match="backbone.layers.0.mixer.dt_bias: missing"):
        hf_to_megatron(broken, d)


MESHES = {"dense": [Parallel(tp=2), Parallel(pp=2), Parallel(tp=2, pp=2), Parallel(tp=2, dp=2)],
          "moe": [Parallel(tp=2), Parallel(dp=2, ep=2), Parallel(tp=2, ep=2, etp=1), Parallel(tp=2, ep=1, etp=2)]}


@pytest.mark.parametrize("key,mesh", [(k, m) for k, ms in MESHES.items() for m in ms])
def test_shard_over_the_mesh_and_gather_back_is_bitwise(checkpoints, key, mesh):
    cfg, hf = checkpoints[key]
    d = NemotronHDims.from_hf_config(cfg)
    whole = hf_to_megatron(hf, d, Style(padded_vocab=padded_vocab(d.vocab, mesh.tp)))
    locals_ = {r: local_state(whole, d, mesh, r) for r in range(mesh.world)}
    _bitwise(gather(locals_, {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}, d, mesh), whole)


def test_a_tp_rank_holds_its_piece_of_every_mamba_part(checkpoints):
    """mamba_ssm's (and megatron-core's) tensor-parallel mixer: rank r's in_proj rows are
    [z_r, x_r, B_r, C_r, dt_r], its conv1d channels [x_r, B_r, C_r], its heads' A_log/D/dt_bias,
    its inner rows of the gated norm, its columns of out_proj."""
    cfg, hf = checkpoints["dense"]
    d = NemotronHDims.from_hf_config(cfg)
    whole = hf_to_megatron(hf, d, Style(padded_vocab=padded_vocab(d.vocab, 2)))
    p = Parallel(tp=2)
    w = whole["decoder.layers.0.mixer.in_proj.weight"]  # z 64, x 64, B 32, C 32, dt 4
    for r in (0, 1):
        loc = local_state(whole, d, p, r)
        z, x, b, c, dt = (w[a:a + n] for a, n in ((0, 64), (64, 64), (128, 32), (160, 32), (192, 4)))
        want = torch.cat([t[r * (t.shape[0] // 2):(r + 1) * (t.shape[0] // 2)] for t in (z, x, b, c, dt)])
        assert torch.equal(loc["decoder.layers.0.mixer.in_proj.weight"], want)
        conv = whole["decoder.layers.0.mixer.conv1d.weight"]
        want = torch.cat([conv[a + r * n // 2:a + (r + 1) * n // 2] for a, n in ((0, 64), (64, 32), (96, 32))])
        assert torch.equal(loc["decoder.layers.0.mixer.conv1d.weight"], want)
        assert torch.equal(loc["decoder.layers.0.mixer.A_log"], whole["decoder.layers.0.mixer.A_log"][2 * r:2 * r + 2])
        assert loc["decoder.layers.0.mixer.out_proj.weight"].shape == (64, 32)
        assert torch.equal(loc["decoder.layers.0.mixer.in_proj.layer_norm_weight"],
                           whole["decoder.layers.0.mixer.in_proj.layer_norm_weight"])
        assert loc["decoder.layers.3.mlp.linear_fc1.weight"].shape == (96, 64)  # non-gated: plain rows
    assert coords_of(1, p).tp == 1


@pytest.mark.parametrize("key", ["dense", "moe"])
def test_transformer_config_mapping_builds_megatrons_dataclass(checkpoints, key):
    cfg, _ = checkpoints[key]
    for p in (Parallel(), Parallel(tp=2)):
        kw = config_map.transformer_kwargs(cfg, p, sequence_parallel=True, precision="bf16", te=True, cpu_init=True)
        tc = config_map.transformer_config(kw)
        assert tc.is_hybrid_model and tc.mamba_num_heads == 4 and tc.mamba_num_groups == 2 and tc.mamba_state_dim == 16
        assert not tc.gated_linear_unit and tc.activation_func.__name__ == "squared_relu"
        if key == "moe":
            assert (tc.num_moe_experts, tc.moe_router_score_function, tc.moe_router_enable_expert_bias) == (4, "sigmoid", True)
            assert (tc.moe_latent_size, tc.moe_shared_expert_intermediate_size, tc.moe_router_topk) == (32, 64, 2)
    mk = config_map.model_kwargs(cfg, Parallel(tp=2), 128)
    assert mk["hybrid_override_pattern"] == cfg.get("hybrid_override_pattern", pattern_of(cfg))
    assert mk["position_embedding_type"] == "none" and mk["vocab_size"] == 256


def test_layout_problems_name_every_reason(checkpoints):
    cfg, _ = checkpoints["moe"]
    problem = config_map.check(cfg, Parallel(tp=4, ep=3, dp=3), sequence_parallel=False, max_seq_len=128, te=False)
    for words in ("4 must divide the attention heads", "must divide the 2 Mamba groups", "expert parallel 3",
                  "Transformer Engine only", "sequence parallelism"):
        assert words in problem, problem
    assert config_map.check(cfg, Parallel(tp=2, dp=1), sequence_parallel=True, max_seq_len=128, te=True) is None
    dense, _ = checkpoints["dense"]
    assert "conv of 4 taps" in config_map.check(dict(dense, conv_kernel=3), Parallel(), False, 128)
    assert "renormalises" in config_map.check(dict(cfg, norm_topk_prob=False), Parallel(), False, 128)


REFITS = [("dense", Parallel(tp=2), [2, 1]), ("dense", Parallel(tp=2, pp=2, dp=2), [2]),
          ("moe", Parallel(tp=2, ep=2, etp=1), [2, 1]), ("moe", Parallel(dp=2, ep=2), [2])]


@pytest.mark.parametrize("key,p,engines", REFITS,
                         ids=[f"{k}-tp{p.tp}pp{p.pp}dp{p.dp}ep{p.ep}-to-tp{'+'.join(map(str, e))}" for k, p, e in REFITS])
def test_planner_moves_megatron_shards_into_vllm_nemotron_h_engines_exactly(checkpoints, key, p, engines):
    """Megatron's Mamba pieces ([z_r, x_r, B_r, C_r, dt_r] per TP rank) into vLLM's
    Nemotron-H layout (models/families/nemotron_h/refit_layout.py) of TP-2 and TP-1 engines: every
    destination box equals the HF tensor's slice, and nothing is received twice."""
    cfg, hf = checkpoints[key]
    d = NemotronHDims.from_hf_config(cfg)
    s = Style(padded_vocab=padded_vocab(d.vocab, p.tp))
    whole = hf_to_megatron(hf, d, s)
    shards = {r: local_hf_shards(local_state(whole, d, p, r), d, s, p, r) for r in range(p.world)}
    for rank, boxes in shards.items():  # each box is the HF tensor's own slice
        for name, held in boxes.items():
            for start, t in pieces(held):
                assert torch.equal(t, hf[name][tuple(slice(a, a + n) for a, n in zip(start, t.shape))]), (rank, name)
    specs = specs_of(hf)
    src = megatron_layout(specs, d, s, p)
    assert sorted(src.tensors) == sorted(hf)
    first, dsts = p.world, []
    for tp in engines:
        dsts.append(vllm_engine_layout(specs, list(range(first, first + tp)), tp, 1, d.num_layers))
        first += tp
    dst = merge(*dsts)
    plan = plan_refit(src, dst)
    _run(plan, shards, hf, dst)
    for r, n in plan.bytes_received().items():
        assert n == dst.bytes_on(r), r
    if p.tp == 2 and engines[0] == 2:  # equal tp: each in_proj piece travels whole to its worker
        moved = [t for t in plan.transfers if t.name.endswith("layers.0.mixer.in_proj.weight") and t.dst == p.world]
        assert sorted(t.start[0] for t in moved) == [0, 64, 128, 160, 192]


def test_names_and_shapes_match_the_mambamodel_megatron_core_builds(checkpoints, tmp_path):
    """megatron-core's own MambaModel (the Transformer Engine stack spec, bf16), built on CPU
    with TEST-ONLY stand-ins for Transformer Engine and mamba-ssm (tests/te_mamba_stand_in.py:
    parameters named and split as TE's), has exactly the names and shapes hf_to_megatron
    writes, and keeps the mixers' A_log and D and the router's expert bias in fp32."""
    (tmp_path / "cfgs.json").write_text(json.dumps({k: v[0] for k, v in checkpoints.items()}))
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "tests" / "megatron_names_nemotron_h.py"),
                           str(tmp_path / "cfgs.json")], capture_output=True, text=True, timeout=300, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, (cfg, hf) in checkpoints.items():
        d = NemotronHDims.from_hf_config(cfg)
        mc = hf_to_megatron(hf, d, Style(padded_vocab=padded_vocab(d.vocab, 1)))
        assert {k: list(v.shape) for k, v in mc.items()} == {k: shape for k, (shape, _) in built[key].items()}, key
        kept = {k: dtype for k, (_, dtype) in built[key].items() if dtype == "float32"}
        assert {k.rsplit(".", 1)[1] for k in kept} == ({"A_log", "D", "expert_bias"} if key == "moe" else {"A_log", "D"}), kept


def _hf_specs(d: NemotronHDims):
    """HF checkpoint names and shapes of a Nemotron-H of dims `d` (bf16), without weights."""
    h, out = d.hidden, {"backbone.embeddings.weight": (d.vocab, d.hidden), "backbone.norm_f.weight": (d.hidden,),
                        "lm_head.weight": (d.vocab, d.hidden)}
    for i, kind in enumerate(d.pattern):
        p = f"backbone.layers.{i}."
        out[p + "norm.weight"] = (h,)
        if kind == "M":
            out.update({p + "mixer.in_proj.weight": (sum(d.in_proj_parts()), h), p + "mixer.conv1d.weight": (sum(d.conv_parts()), 1, 4),
                        p + "mixer.conv1d.bias": (sum(d.conv_parts()),), p + "mixer.A_log": (d.mamba_heads,),
                        p + "mixer.D": (d.mamba_heads,), p + "mixer.dt_bias": (d.mamba_heads,),
                        p + "mixer.norm.weight": (d.mamba_inner,), p + "mixer.out_proj.weight": (h, d.mamba_inner)})
        elif kind == "E":
            w = d.latent or h
            out.update({p + "mixer.gate.weight": (d.num_experts, h), p + "mixer.gate.e_score_correction_bias": (d.num_experts,),
                        p + "mixer.shared_experts.up_proj.weight": (d.shared_ffn, h),
                        p + "mixer.shared_experts.down_proj.weight": (h, d.shared_ffn),
                        p + "mixer.fc1_latent_proj.weight": (w, h), p + "mixer.fc2_latent_proj.weight": (h, w)})
            for e in range(d.num_experts):
                out.update({p + f"mixer.experts.{e}.up_proj.weight": (d.moe_ffn, w),
                            p + f"mixer.experts.{e}.down_proj.weight": (w, d.moe_ffn)})
    return {n: (s, "float32" if n.endswith("e_score_correction_bias") else "bfloat16") for n, s in out.items()}


def test_megatron_tp8_ep8_plans_into_a_tp8_ep8_engine_at_the_flagships_widths():
    """Shapes only (no tensors): a Mamba + MoE slice of the flagship's widths (stand-in
    numbers, tests/test_engine_spanning.py) from a Megatron trainer of tp 8 x ep 8 into one
    vLLM engine of TP 8 with expert parallel: every destination byte arrives exactly once,
    and each Mamba in_proj piece of a trainer rank goes to the worker of the same TP rank."""
    from hpc_rl.refit.vllm_layout import vllm_tp_layout

    cfg = {"model_type": "nemotron_h", "hybrid_override_pattern": "ME", "hidden_size": 8192, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 256, "mamba_head_dim": 64, "n_groups": 8,
           "ssm_state_size": 128, "intermediate_size": 16384, "n_routed_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 2048, "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 4096,
           "moe_latent_size": 1024, "vocab_size": 131072, "tie_word_embeddings": False}
    d = NemotronHDims.from_hf_config(cfg)
    p = Parallel(tp=8, ep=8)
    assert config_map.check(cfg, p, sequence_parallel=True, max_seq_len=4096) is None
    specs = _hf_specs(d)
    src = megatron_layout(specs, d, Style(padded_vocab=padded_vocab(d.vocab, 8)), p)
    dst = vllm_tp_layout(specs, list(range(8, 16)), expert_parallel=True)
    plan = plan_refit(src, dst)
    for r, n in plan.bytes_received().items():
        assert n == dst.bytes_on(r), r
    z = d.mamba_inner // 8
    moved = sorted((t.src, t.dst, t.start[0]) for t in plan.transfers if t.name == "backbone.layers.0.mixer.in_proj.weight")
    assert [(s, r) for s, r, _ in moved] == [(s, s + 8) for s in range(8) for _ in range(5)]
    assert [a for s, _, a in moved if s == 1][:2] == [z, d.mamba_inner + z]  # z_1, then x_1

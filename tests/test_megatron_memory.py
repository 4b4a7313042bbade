"""The megatron backend's memory savers on CPU (issue #44): trainer.activation_checkpointing and
trainer.megatron.* mapped onto megatron-core's own TransformerConfig and OptimizerConfig (their
__post_init__ checks run here), the combinations megatron-core asserts on refused before
submission, and what depends on the checkpoint (layers per stage, the modules it has) refused
at launch. A train step with them needs a GPU: hpc_rl/models/megatron/gpu_check.py (not run)."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.support import unsupported
from hpc_rl.models.megatron import config_map
from hpc_rl.models.megatron.hf_mapping import ModelDims
from hpc_rl.models.megatron.memory import (FULL_EVERY_LAYER, optimizer_offload_kwargs, recompute_kwargs,
                                           recompute_problems)
from hpc_rl.models.families.nemotron_h.megatron_mapping import NemotronHDims
from hpc_rl.models.megatron.shards import Parallel

MEGATRON = ["+recipe=tiny_mopd", "cluster=h100", "trainer.backend=megatron"]
FULL = ["trainer.megatron.recompute_granularity=full", "trainer.megatron.recompute_method=uniform",
        "trainer.megatron.recompute_num_layers=2"]
_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
# a hybrid with every kind of layer: Mamba, attention, dense MLP, MoE with a shared expert
NEMOTRON_H = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*-E", "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2,
              "ssm_state_size": 16, "intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 64,
              "vocab_size": 96, "tie_word_embeddings": False}


def _hf(kind: str) -> dict:
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**_BASE).to_dict()
    # layer 1 dense (mlp_only_layers), the others MoE
    return transformers.Qwen3MoeConfig(**_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                       mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True).to_dict()


def _trainer(*overrides):
    return load_config([*MEGATRON, *overrides]).trainer


def _violations(*overrides):
    try:
        cfg = load_config([*MEGATRON, *overrides])
    except ConfigError as e:
        return {v.key: v for v in e.violations}
    return {v.key: v for v in unsupported(cfg)}


def _tc(hf: dict, recompute: dict, pp: int = 1):
    """megatron-core's TransformerConfig with the backend's arguments (its own checks run)."""
    kw = config_map.transformer_kwargs(hf, Parallel(pp=pp), sequence_parallel=False, precision="bf16", te=False)
    return config_map.transformer_config({**kw, **recompute})


def test_activation_checkpointing_is_megatrons_full_recompute_of_every_layer():
    assert recompute_kwargs(_trainer()) == {}  # the default keeps every activation
    kw = recompute_kwargs(_trainer("trainer.activation_checkpointing=true"))
    assert kw == FULL_EVERY_LAYER
    tc = _tc(_hf("llama"), kw)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)


def test_the_megatron_keys_reach_transformer_config():
    tc = _tc(_hf("llama"), recompute_kwargs(_trainer(*FULL)), pp=2)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 2)
    block = recompute_kwargs(_trainer("trainer.megatron.recompute_granularity=full", "trainer.megatron.recompute_method=block",
                                      "trainer.megatron.recompute_num_layers=1"))
    assert _tc(_hf("llama"), block).recompute_method == "block"
    sel = recompute_kwargs(_trainer("trainer.megatron.recompute_granularity=selective",
                                    "trainer.megatron.recompute_modules=[core_attn,moe,layernorm]"))
    tc = _tc(_hf("qwen3_moe"), sel)
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["core_attn", "moe", "layernorm"]
    default = recompute_kwargs(_trainer("trainer.megatron.recompute_granularity=selective"))
    assert _tc(_hf("llama"), default).recompute_modules == ["core_attn"]  # megatron-core's default


@pytest.mark.parametrize("overrides,refused_key,megatron_kw", [
    (["trainer.megatron.recompute_granularity=full", "trainer.megatron.recompute_num_layers=1"],
     "trainer.megatron.recompute_method", {"recompute_granularity": "full", "recompute_num_layers": 1}),
    (["trainer.megatron.recompute_granularity=full", "trainer.megatron.recompute_method=uniform"],
     "trainer.megatron.recompute_num_layers", {"recompute_granularity": "full", "recompute_method": "uniform"}),
    (["trainer.megatron.recompute_granularity=selective", "trainer.megatron.recompute_num_layers=1"],
     "trainer.megatron.recompute_num_layers", {"recompute_granularity": "selective", "recompute_num_layers": 1}),
    (["trainer.megatron.recompute_granularity=selective", "trainer.megatron.recompute_modules=[mla_up_proj]"],
     "trainer.megatron.recompute_modules", {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]}),
])
def test_validation_refuses_what_megatron_core_asserts(overrides, refused_key, megatron_kw):
    found = _violations(*overrides)
    assert refused_key in found, sorted(found)
    assert refused_key in found[refused_key].fix or "trainer.megatron" in found[refused_key].fix
    with pytest.raises((ValueError, AssertionError)):  # megatron-core's own check of the same combination
        _tc(_hf("llama"), megatron_kw)


def test_settings_that_would_be_ignored_are_refused():
    both = _violations("trainer.activation_checkpointing=true", *FULL)
    assert "trainer.megatron.recompute_granularity" in both  # one thing asked twice
    assert "trainer.megatron.recompute_method" in _violations("trainer.megatron.recompute_method=block")
    assert "trainer.megatron.recompute_modules" in _violations("trainer.megatron.recompute_granularity=full",
                                                               "trainer.megatron.recompute_method=uniform",
                                                               "trainer.megatron.recompute_num_layers=1",
                                                               "trainer.megatron.recompute_modules=[mlp]")
    assert "trainer.megatron.optimizer_offload_fraction" in _violations("trainer.megatron.optimizer_offload_fraction=0.5")
    for bad in ("0", "1.5"):
        v = _violations("trainer.megatron.optimizer_cpu_offload=true", f"trainer.megatron.optimizer_offload_fraction={bad}")
        assert "trainer.megatron.optimizer_offload_fraction" in v
    adam = _violations("trainer.megatron.optimizer_cpu_offload=true", "trainer.optimizer.name=adam")
    assert "AdamW only" in adam["trainer.megatron.optimizer_cpu_offload"].problem
    # the fsdp2 keys on megatron, the megatron keys on fsdp2
    assert "trainer.cpu_offload" in _violations("trainer.cpu_offload=true")
    fsdp2 = load_config(["+recipe=tiny_mopd", "trainer.megatron.optimizer_cpu_offload=true"])
    assert "trainer.megatron.optimizer_cpu_offload" in {v.key for v in unsupported(fsdp2)}
    # and the accepted ones leave nothing
    assert _violations(*FULL) == {} and _violations("trainer.activation_checkpointing=true") == {}
    assert _violations("trainer.megatron.optimizer_cpu_offload=true", "trainer.optimizer.name=adamw",
                       "trainer.megatron.optimizer_offload_fraction=0.5") == {}


def test_optimizer_offload_is_megatrons_hybrid_optimizer_with_the_precision_aware_optimizer(monkeypatch):
    import megatron.core.optimizer.optimizer_config as mc_optimizer_config

    from hpc_rl.models.megatron.memory import offload_problems

    t = _trainer("trainer.megatron.optimizer_cpu_offload=true", "trainer.optimizer.name=adamw",
                 "trainer.megatron.optimizer_offload_fraction=0.5")
    # megatron-core 0.16.1 reads Transformer Engine's version for the precision-aware optimizer and
    # fails without TE (TypeError comparing None with a Version): the backend refuses that node first
    with pytest.raises(TypeError):
        config_map.optimizer_config(config_map.optimizer_kwargs(t, "bf16"))
    assert "Transformer Engine" in offload_problems(t, te=False)[0] and offload_problems(t, te=True) == []
    assert offload_problems(_trainer(), te=False) == []
    # TEST-ONLY stand-in for TE >= 2.1 being installed (the gpu extra has 2.20.2); nothing else is patched
    monkeypatch.setattr(mc_optimizer_config, "is_te_min_version", lambda version: True)
    oc = config_map.optimizer_config(config_map.optimizer_kwargs(t, "bf16"))  # megatron-core's dataclass
    assert oc.optimizer_cpu_offload and oc.optimizer_offload_fraction == 0.5
    assert oc.use_precision_aware_optimizer and oc.use_distributed_optimizer and oc.decoupled_weight_decay
    # its main weights are the hybrid optimizer's fp32 copies (no fp32 shard kept on the GPU)
    assert oc.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and oc.main_params_dtype == torch.float32
    plain = config_map.optimizer_config(config_map.optimizer_kwargs(_trainer(), "bf16"))
    assert not plain.optimizer_cpu_offload and not plain.use_precision_aware_optimizer
    assert optimizer_offload_kwargs(_trainer()) == {}


def test_recompute_problems_follow_the_checkpoints_layers():
    llama, moe = ModelDims.from_hf_config(_hf("llama")), ModelDims.from_hf_config(_hf("qwen3_moe"))
    hybrid = NemotronHDims.from_hf_config(NEMOTRON_H)
    full = lambda method, n: {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": n}  # noqa: E731
    sel = lambda *m: {"recompute_granularity": "selective", "recompute_modules": list(m)}  # noqa: E731
    assert recompute_problems(llama, 2, full("uniform", 2)) == []  # 4 layers, 2 per stage
    assert "must divide the 2 layers of a pipeline stage" in recompute_problems(llama, 2, full("uniform", 4))[0]
    assert "more than the 2 layers" in recompute_problems(llama, 2, full("block", 3))[0]
    assert recompute_problems(llama, 2, full("block", 2)) == []
    assert "MambaStack" in recompute_problems(hybrid, 1, FULL_EVERY_LAYER)[0]
    assert recompute_problems(hybrid, 1, sel("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts")) == []
    dense = " | ".join(recompute_problems(llama, 1, sel("moe", "moe_act", "shared_experts", "layernorm", "mlp")))
    for module in ("'moe'", "'moe_act'", "'shared_experts'", "'layernorm'"):
        assert module in dense, (module, dense)
    assert "'mlp'" not in dense
    assert recompute_problems(llama, 1, sel("layernorm"), te=False) == []  # local specs keep separate norms
    assert "'shared_experts'" in " ".join(recompute_problems(moe, 1, sel("shared_experts")))  # Qwen3-MoE has none
    assert "grouped GEMM" in " ".join(recompute_problems(moe, 1, sel("moe_act"), te=False))
    # the backend's start-up check joins them with the layout's
    assert "pipeline stage" in config_map.check(_hf("llama"), Parallel(pp=2, dp=1), False, 64,
                                                recompute=full("uniform", 4))


def test_the_launch_checks_recompute_against_the_checkpoint(tmp_path):
    from hpc_rl.rl.inputs import _check_megatron_recompute

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(_hf("llama")))
    out = []
    _check_megatron_recompute(out, str(ckpt), _trainer("trainer.activation_checkpointing=true"))
    assert out == []  # every layer, one at a time: fits any layer count
    _check_megatron_recompute(out, str(ckpt), _trainer("trainer.megatron.recompute_granularity=full",
                                                       "trainer.megatron.recompute_method=uniform",
                                                       "trainer.megatron.recompute_num_layers=3"))
    assert [v.key for v in out] == ["trainer.megatron.recompute_granularity"] and "must divide" in out[0].problem
    (ckpt / "config.json").write_text(json.dumps(NEMOTRON_H))
    out = []
    _check_megatron_recompute(out, str(ckpt), _trainer("trainer.activation_checkpointing=true"))
    assert [v.key for v in out] == ["trainer.activation_checkpointing"] and "MambaStack" in out[0].problem

"""The plan-time memory model (issue 44; hpc_rl/memory/, config/memory_inputs.py, config/memory_fit.py,
plan/memory_plan.py, docs/memory.md): hand-computed figures for a known shape, the constants it
shares with the code it models, the dry run's per-role table for the flagship on both GPU clusters,
and the refusal of a plan that does not fit, naming the keys that would make it fit.
Measured against the fsdp2 trainer on CPU: bench/memory_model.py (bench/results/memory_model.json)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.memory_fit import candidates, memory_misfits
from hpc_rl.config.memory_inputs import recompute_offload, role_inputs
from hpc_rl.memory import model as mm
from hpc_rl.memory.shape import Shape, from_hf, params

ULTRA = ["+recipe=ultra_mopd"]
# the tiny Llama student's config.json (tiny_assets/): hidden 64, 2 layers, 2 heads of 32, vocab 104
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 104,
              "tie_word_embeddings": False}


def _fsdp2(tokens: int, recompute: bool = False) -> mm.Setup:
    return mm.Setup(kind="trainer", backend="fsdp2", precision="fp32", parallel={}, device="cpu",
                    train_tokens=tokens, recompute=recompute)


# -- the arithmetic, by hand ----------------------------------------------------------------------


def test_parameters_of_a_known_shape_by_hand():
    n = params(from_hf(TINY_LLAMA))
    # per layer: 2 norms of 64; q, k, v, o each 64 x 64; gate, up, down each 64 x 192
    layer = 2 * 64 + 4 * 64 * 64 + 3 * 64 * 192
    assert layer == 53376
    assert n.dense == 2 * layer + 64  # + the final norm
    assert n.embedding == 2 * 104 * 64  # embedding and head, untied
    assert n.total == 120128


def test_parameters_agree_with_transformers_for_each_family():
    """The shape's count against the model transformers builds (meta device: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    nemotron = {"model_type": "nemotron_h", "hidden_size": 128, "vocab_size": 256, "hybrid_override_pattern": "MEM*E",
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
                "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1,
                "moe_shared_expert_intermediate_size": 96, "moe_latent_size": 32, "mamba_num_heads": 8,
                "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16}
    qwen3_moe = {"model_type": "qwen3_moe", "hidden_size": 64, "vocab_size": 104, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "tie_word_embeddings": False}
    for hf in (TINY_LLAMA, qwen3_moe, nemotron):
        config = AutoConfig.for_model(**hf)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        have = sum(p.numel() for p in model.parameters())
        # Qwen3's q/k norms (2 x head_dim per attention layer) are the one thing the shape leaves out
        extra = 2 * 32 * 2 if hf is qwen3_moe else 0
        assert params(from_hf(hf)).total + extra == have, hf["model_type"]


def test_fsdp2_trainer_figures_by_hand():
    s, t = from_hf(TINY_LLAMA), 128
    # per token and layer (fp32, 4 B): each mixer's norm keeps its input, the normalised input and
    # its output (3 x 4 x 64); attention: q and the output (2 x 2 heads x 32) and k, v (2 x 2 x 32),
    # plus the log-sum-exp (2 heads x 4 B); MLP: gate, silu, up, their product (4 x 192)
    attention = 3 * 4 * 64 + 4 * 32 * (2 * 2 + 2 * 2) + 4 * 2
    mlp = 3 * 4 * 64 + 4 * 4 * 192
    head_in = 3 * 4 * 64  # the final norm
    assert mm.activations(s, _fsdp2(t), recompute=False) == t * (2 * (attention + mlp) + head_in)
    # checkpointed: each block's input (4 x 64), plus one block's whole set while it is recomputed
    assert mm.activations(s, _fsdp2(t), recompute=True, recomputing=False) == t * (2 * 4 * 64 + head_in)
    assert mm.activations(s, _fsdp2(t), recompute=True) == t * (2 * 4 * 64 + attention + mlp + head_in)
    # the head: 2^26 logits per chunk is far more than 128 tokens, so one chunk of [128, 104] fp32
    assert mm.logits_bytes(s, _fsdp2(t), t, backward=False) == t * 104 * 4
    assert mm.logits_bytes(s, _fsdp2(t), t, backward=True) == t * 104 * 4 + 4 * t * 64  # + d(hidden)
    m, n = mm.trainer(s, _fsdp2(t)), params(s).total
    assert m.parts["params"] == 4 * n and m.parts["optimizer"] == 8 * n  # fp32 master weights, Adam's two moments
    # the optimizer step: weights, gradients, moments, and the single-tensor CPU Adam's two
    # temporaries of the largest tensor (an MLP weight, 192 x 64, larger than the 104 x 64 head)
    assert m.phases["optimizer step"] == 16 * n + 2 * 4 * 192 * 64
    # the backward's start: all saved activations, the head's chunk and d(hidden), its fp32 weight gradient
    early = mm.activations(s, _fsdp2(t), recompute=False) + t * 104 * 4 + 4 * t * 64 + 4 * 104 * 64
    # ... or its end: every gradient and one block's backward (its set and d(hidden) in and out)
    assert m.phases["backward"] == 12 * n + max(early, 4 * n + t * (attention + mlp + 2 * 4 * 64))
    assert m.peak == max(m.phases.values())


def test_megatron_figures_of_the_flagship_trainer_follow_the_distributed_optimizer():
    cfg = load_config(ULTRA)
    item = role_inputs(cfg)[0]
    s, p = item.shape, params(item.shape)
    assert item.role == "trainer" and item.source.startswith("model.shape")
    assert abs(p.total / 550e9 - 1) < 0.01  # the estimates give model.params_b
    m = mm.trainer(s, item.setup)
    # tp 8, cp 32, dp 1 on 256 GPUs; ep 64, so 4 expert data-parallel ranks
    dense, experts = (p.dense + p.embedding) / 8, p.experts / 64
    assert m.parts["params"] == int(2 * (dense + experts))  # bf16 weights
    assert m.parts["grads"] == int(4 * (dense + experts))  # fp32 main gradients (ddp_kwargs grad_reduce_in_fp32)
    assert m.parts["optimizer"] == int(12 * (dense / 32 + experts / 4))  # fp32 master + 2 moments, sharded


def test_the_constants_are_the_codes_own():
    from hpc_rl.config.memory_inputs import DEFAULT_LOGPROB_BATCH_TOKENS
    from hpc_rl.models import chunked_logprobs, fsdp2
    from hpc_rl.models.megatron import config_map
    from hpc_rl.refit.vllm_engine import engine_kwargs

    assert mm.CHUNK_LOGIT_ELEMENTS == chunked_logprobs.CHUNK_LOGIT_ELEMENTS
    assert DEFAULT_LOGPROB_BATCH_TOKENS == fsdp2.DEFAULT_LOGPROB_BATCH_TOKENS
    assert config_map.ddp_kwargs()["grad_reduce_in_fp32"] is True  # the model's 4 B megatron gradients
    from types import SimpleNamespace

    from hpc_rl.refit.vllm_engine import engine_options

    g = SimpleNamespace(enforce_eager=None, kv_cache_dtype="auto", engine_args={})
    for seqs, length in ((256, 196608), (1, 64), (4, 256)):
        for device in ("gpu", "cpu"):  # the engine's budget on each kind of cluster (engine_options)
            setup = mm.Setup(kind="generator", backend="vllm", precision="bf16", parallel={}, max_num_seqs=seqs,
                             max_model_len=length, device=device)
            kw = engine_kwargs("/nowhere", max_model_len=length, max_num_seqs=seqs,
                               options=engine_options(g, device == "gpu"))
            assert mm.batched_tokens(setup) == kw["max_num_batched_tokens"]


def test_the_generators_kv_cache_is_what_its_share_leaves():
    s = Shape(hidden=64, vocab=100, blocks=("*-",) * 2, heads=2, kv_heads=2, head_dim=32, ffn=128)
    setup = mm.Setup(kind="generator", backend="vllm", precision="bf16", parallel={"tp": 1}, gpu_memory_utilization=0.5,
                     max_model_len=1000, max_num_seqs=4, gpu_bytes=mm.GiB)
    m = mm.generator(s, setup)
    assert m.peak == mm.GiB // 2  # vLLM takes its share whole
    per_token = 2 * 2 * 2 * 32 * 2  # 2 attention layers x (K and V) x 2 heads x 32 x bf16
    assert mm.kv_bytes_per_token(s, setup) == per_token
    assert m.kv_tokens == m.parts["kv_cache"] // per_token and m.kv_minimum == 1000 * per_token


# -- the config side ------------------------------------------------------------------------------


def test_the_checkpoints_config_json_replaces_the_estimates(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    cfg = load_config(["+recipe=tiny_grpo", f"model.path={tmp_path}", "model.shape.hidden_size=4096",
                       "model.shape.vocab_size=8", "model.shape.num_hidden_layers=1", "model.shape.num_attention_heads=1",
                       "model.shape.intermediate_size=8"])
    item = role_inputs(cfg)[0]
    assert item.shape == from_hf(TINY_LLAMA) and item.source == f"{tmp_path}/config.json"
    unreadable = load_config(["+recipe=tiny_grpo"])  # tiny:student is built later: no shape at plan time
    assert role_inputs(unreadable)[0].shape is None and "no shape" in role_inputs(unreadable)[0].source


def test_recompute_and_offload_are_read_per_backend_in_one_place():
    cfg = load_config(["+recipe=tiny_grpo", "trainer.activation_checkpointing=true"])
    assert recompute_offload(cfg.trainer) == (True, False)
    cfg = load_config(ULTRA)
    assert recompute_offload(cfg.trainer) == (False, False)  # megatron's own keys are not in this schema yet
    # MERGE: the trainer.megatron.* keys being added in parallel are read as they will be named
    cfg.trainer.megatron = SimpleNamespace(recompute_granularity="full", optimizer_cpu_offload=True)
    assert recompute_offload(cfg.trainer) == (True, True)


@pytest.mark.parametrize("override,key", [
    ("cluster.gpu_memory_headroom=1.0", "cluster.gpu_memory_headroom"),
    ("model.shape.hidden_size=0", "model.shape.hidden_size"),
    ("model.shape.hybrid_override_pattern=MXE", "model.shape.hybrid_override_pattern"),
    ("model.params_b=100", "model.shape"),  # 549.3B from the shape: one of the two is wrong
    ("cluster.gpu_memory_gib=-1", "cluster.gpu_memory_gib"),
])
def test_memory_keys_are_validated(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(ULTRA + [override])
    assert key in {v.key for v in info.value.violations}, info.value.render()


def test_a_cpu_cluster_has_no_gpu_memory_to_plan_against():
    with pytest.raises(ConfigError) as info:
        load_config(["+recipe=tiny_grpo", "cluster.gpu_memory_gib=80"])
    assert info.value.violations[0].key == "cluster.gpu_memory_gib"
    assert memory_misfits(load_config(["+recipe=tiny_grpo"])) == []  # CPU: figures only, no check


# -- the dry run and the refusal -------------------------------------------------------------------


@pytest.mark.parametrize("cluster,gib", [("gb200_nvl72", "184"), ("h100", "79.6")])
def test_the_dry_run_prints_every_roles_memory_per_gpu(tmp_path, capsys, cluster, gib):
    from hpc_rl.launch import main

    plan = tmp_path / "plan.json"
    assert main(ULTRA + [f"cluster={cluster}", f"run.dir={tmp_path / 'run'}", f"launcher.plan_out={plan}"]) == 0
    out = capsys.readouterr().out
    assert f"memory per GPU in GiB ({cluster}: {gib} GiB" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("role") and "params" in line)
    assert lines[at].split()[:9] == ["role", "params", "grads", "optim", "activ", "logits", "kv", "other", "peak"]
    doc = json.loads(plan.read_text())["memory"]
    for role in ("trainer", "generator", "teacher/general", "teacher/swe"):
        r = doc["roles"][role]
        row = next(line for line in lines[at:] if line.startswith(role + " "))
        assert f"{r['peak'] / mm.GiB:.1f}" in row and r["phase"] in row
    assert "trainer activations:" in out and "without activation checkpointing" in out
    trainer = doc["roles"]["trainer"]
    assert trainer["activations_full"] > 10 * trainer["activations_recompute"]
    if cluster == "gb200_nvl72":
        assert trainer["fits"] and all(doc["roles"][f"teacher/{t}"]["fits"] for t in ("general", "swe"))
    else:  # the flagship's layout does not fit 80 GB GPUs: the dry run shows it and lists why
        assert not trainer["fits"] and "roles that do not fit their GPUs' memory" in out


def test_a_plan_without_activation_checkpointing_at_the_longest_context_is_refused_naming_the_fix():
    """fsdp2 (the student's activation checkpointing is trainer.activation_checkpointing): the
    flagship's 196,608-token context on 32 context-parallel ranks without it does not fit a GB200."""
    planted = ULTRA + ["trainer.backend=fsdp2", "trainer.parallel.tp=1", "trainer.parallel.ep=1",
                       "trainer.sequence_parallel=false"]
    found = memory_misfits(load_config(planted), roles=("trainer",))
    assert [v.key for v in found] == ["trainer"]
    assert "trainer.activation_checkpointing=true" in found[0].fix and "165.6 GiB" in found[0].problem
    assert memory_misfits(load_config(planted + ["trainer.activation_checkpointing=true"]), roles=("trainer",)) == []


def test_megatron_at_a_quarter_of_the_context_parallel_ranks_is_refused_naming_the_fix(tmp_path):
    """megatron without recompute: cp=8 puts 24,576 tokens on each rank at 196,608."""
    from hpc_rl.launchers.runnable import check_runnable

    cfg = load_config(ULTRA + ["trainer.parallel.cp=8", "launcher=slurm", f"run.dir={tmp_path / 'run'}"])
    found = memory_misfits(cfg, roles=("trainer",))
    assert found and "trainer.parallel.cp=16" in found[0].fix and "activations" in found[0].problem
    with pytest.raises(ConfigError) as info:  # a launch refuses it (with everything else it would refuse)
        check_runnable(cfg)
    assert any(v.key == "trainer" and "trainer.parallel.cp=16" in v.fix for v in info.value.violations)
    # megatron's full recompute (trainer.activation_checkpointing) is not offered for the hybrid:
    # megatron-core 0.16's MambaStack has none; a dense model is offered it first
    keys = [k for change in candidates(cfg, role_inputs(cfg)[0]) for k, _ in change]
    assert "trainer.activation_checkpointing" not in keys
    item = role_inputs(cfg)[0]
    dense = SimpleNamespace(**{**vars(item), "shape": SimpleNamespace(count=lambda mixer: 0)})
    assert [k for k, _ in candidates(cfg, dense)[0]] == ["trainer.activation_checkpointing"]


def test_the_flagship_fits_a_gb200_and_its_generator_budget_is_the_gpu_one():
    """The memory model found that refit/vllm_engine.py gave GPU engines the CPU workaround's
    max_num_batched_tokens (max_num_seqs x max_model_len: 50,331,648 tokens for the flagship, a
    start-up profile forward no GPU holds); GPU engines now take GPU_BATCHED_TOKENS."""
    from hpc_rl.plan import build_plan

    assert memory_misfits(load_config(ULTRA)) == []
    plan = build_plan(load_config(ULTRA))
    assert "16,384 tokens" in " ".join(plan.memory["roles"]["generator"].get("notes", []))


def test_plan_json_carries_the_figures_and_reads_back():
    from hpc_rl.plan import JobPlan, build_plan

    plan = build_plan(load_config(ULTRA))
    again = JobPlan.from_dict(json.loads(plan.to_json()))
    assert again.memory == plan.memory and again.memory["roles"]["trainer"]["budget"] == int(184 * mm.GiB * 0.9)


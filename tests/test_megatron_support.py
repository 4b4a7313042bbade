"""trainer.backend=megatron selection (issue #16): accepted on GPU clusters with the
flagship's parallel layout, refused on CPU clusters with the reason and the fix, never a
silent fallback to FSDP2; the architectures the rules name are the ones the mapping has."""

from __future__ import annotations

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.support import MEGATRON_ARCHITECTURES, unsupported
from hpc_rl.config.validate import validate
from hpc_rl.models.megatron.hf_mapping import ARCHITECTURES
from hpc_rl.models.registry import available

ULTRA = ["+recipe=ultra_mopd"]


def _errors(overrides):
    """load_config validates: the violations it raises (empty: the config is valid)."""
    try:
        validate(load_config(overrides))
    except ConfigError as e:
        return e.violations
    return []


@pytest.mark.parametrize("cluster", ["gb200_nvl72", "h100"])
def test_megatron_is_accepted_on_gpu_clusters_with_the_flagship_layout(cluster):
    extra = ["trainer.nodes=32"] if cluster == "h100" else []
    assert _errors(ULTRA + [f"cluster={cluster}"] + extra) == []
    cfg = load_config(ULTRA + [f"cluster={cluster}"] + extra)
    assert cfg.trainer.backend == "megatron"
    keys = {v.key for v in unsupported(cfg)}
    assert not {k for k in keys if k.startswith(("trainer.", "teachers."))}, keys
    # a llama checkpoint would leave nothing about the model or the trainer refused
    cfg = load_config(ULTRA + [f"cluster={cluster}", "model.architecture=qwen3_moe"] + extra)
    assert "model.architecture" not in {v.key for v in unsupported(cfg)}


@pytest.mark.parametrize("cluster", ["local", "local_slurm"])
def test_megatron_is_refused_on_cpu_clusters_naming_why_and_the_fix(cluster):
    errors = _errors(ULTRA + [f"cluster={cluster}"])
    found = [v for v in errors if v.key == "trainer.backend"]
    assert found, [v.render() for v in errors]
    assert "needs CUDA" in found[0].problem and "trainer.backend=fsdp2" in found[0].fix and "gb200_nvl72" in found[0].fix


def test_the_dry_run_renders_the_flagship_with_megatron(tmp_path):
    from hpc_rl.launch import main

    rc = main(ULTRA + [f"run.dir={tmp_path / 'run'}", f"launcher.plan_out={tmp_path / 'plan.json'}"])
    assert rc == 0 and (tmp_path / "plan.json").exists()


def test_the_local_launch_refuses_megatron_before_anything_starts(tmp_path):
    from hpc_rl.launch import main

    rc = main(["+recipe=tiny_mopd", "launcher=local", "trainer.backend=megatron", f"run.dir={tmp_path / 'run'}"])
    assert rc == 2 and not (tmp_path / "run").exists()


def test_fsdp2_refusals_come_back_when_the_backend_is_fsdp2():
    keys = {v.key for v in unsupported(load_config(ULTRA + ["trainer.backend=fsdp2"]))}
    # fsdp2 has tp (with sequence parallel) and cp, each alone; ultra asks for both, and for ep
    assert {"trainer.parallel.cp", "trainer.parallel.ep", "teachers.swe.parallel.ep"} <= keys
    assert "trainer.parallel.tp" not in keys and "trainer.sequence_parallel" not in keys


@pytest.mark.parametrize("cluster", ["gb200_nvl72", "h100"])
def test_the_flagship_leaves_nothing_refused_on_megatron_gpu_clusters(cluster):
    """Issue #25: Nemotron-H (model.architecture=nemotron_h) is a megatron architecture now."""
    extra = ["trainer.nodes=32"] if cluster == "h100" else []
    cfg = load_config(ULTRA + [f"cluster={cluster}"] + extra)
    assert cfg.model.architecture == "nemotron_h" and unsupported(cfg) == []
    v = [v for v in unsupported(load_config(ULTRA + ["model.architecture=gpt2"])) if v.key == "model.architecture"]
    assert v and "nemotron_h" in v[0].fix


def test_the_rules_and_the_registry_agree_with_the_mapping():
    assert set(MEGATRON_ARCHITECTURES) == set(ARCHITECTURES) | {"nemotron_h"}  # + models/families/nemotron_h/megatron_mapping.py
    assert "megatron" in available()


def test_the_gpu_check_says_it_did_not_run_without_cuda(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "megatron_gpu.json"
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.models.megatron.gpu_check", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    doc = json.loads(out.read_text())
    assert proc.returncode == 3 and doc["ran"] is False and "CUDA" in doc["why"]


class _KeyedBackend:
    """A backend whose shards are plain local tensors keyed by its own names (what the
    megatron backend hands hpc_rl/ckpt through dcp_state / load_dcp_state), on CPU."""

    def __init__(self, seed: int):
        import torch

        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = None
        self.step_count = 0
        self.loaded = None

    def dcp_state(self, with_optimizer):
        return {f"model/tp0.pp0/{k}": v for k, v in self.model.state_dict().items()}, {}

    def load_dcp_state(self, model, optim):
        self.loaded = sorted(model)
        self.model.load_state_dict({k.split("/", 2)[2]: v for k, v in model.items()})


def test_checkpoints_use_a_backends_own_keys_atomically_and_resume(tmp_path):
    import torch

    from hpc_rl.ckpt import load_checkpoint, save_checkpoint

    a = _KeyedBackend(0)
    a.step_count = 3
    path = save_checkpoint(tmp_path / "ck", 3, a, {"data_pos": 7}, "recipe: tiny_mopd\n")
    assert path.name == "step_00000003" and not list((tmp_path / "ck").glob(".tmp_*"))
    b = _KeyedBackend(1)
    assert not torch.equal(a.model.weight, b.model.weight)
    extra = load_checkpoint(path, b)
    assert extra["data_pos"] == 7 and b.step_count == 3 and b.loaded == ["model/tp0.pp0/bias", "model/tp0.pp0/weight"]
    assert torch.equal(a.model.weight, b.model.weight) and torch.equal(a.model.bias, b.model.bias)

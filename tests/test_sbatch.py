"""Rendered het sbatch scripts: golden files in sbatch/, structure, containers, topology."""

from __future__ import annotations

import subprocess

import pytest

import golden
from hpc_rl.config import ConfigError, load_config
from hpc_rl.plan import build_plan
from hpc_rl.slurm.sbatch import RenderOptions, render


@pytest.mark.parametrize("recipe,cluster,container", golden.SBATCH_CASES,
                         ids=[golden.sbatch_path(*c).name for c in golden.SBATCH_CASES])
def test_shipped_script_matches_golden(recipe, cluster, container):
    path = golden.sbatch_path(recipe, cluster, container)
    assert path.exists(), f"missing {path}: run `make golden`"
    text = golden.render_sbatch(recipe, cluster, container)
    assert text == path.read_text(), f"{path} is stale: review the diff, then `make golden`"
    subprocess.run(["bash", "-n", str(path)], check=True)  # the script parses


def _render(*overrides, **opts):
    cfg = load_config(["+recipe=ultra_mopd", *overrides])
    plan = build_plan(cfg)
    return plan, render(cfg, plan, RenderOptions(**opts))


def _directives(text):
    """#SBATCH directives per het component."""
    comps, cur = [], []
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            comps.append(cur)
            cur = []
        elif line.startswith("#SBATCH "):
            cur.append(line[len("#SBATCH "):])
    comps.append(cur)
    return comps


def test_one_component_per_role_with_its_resources():
    plan, text = _render("cluster=gb200_nvl72", run_dir="/runs/x")
    comps = _directives(text)
    assert len(comps) == len(plan.roles) == 8
    for role, opts in zip(plan.roles, comps):
        assert f"--nodes={role.nodes}" in opts and f"--ntasks-per-node={role.tasks_per_node}" in opts
        assert f"--segment={role.segment_size}" in opts or role.segment_size == 1
    assert "--gpus-per-node=4" in comps[0] and not any(o.startswith("--gpus") for o in comps[-1])
    header = comps[0]
    for opt in ("--requeue", "--open-mode=append", "--signal=B:USR1@300", "--output=/runs/x/logs/batch.out"):
        assert opt in header
    # shared options in the header only; placement and partition in every component
    assert not any(o.startswith("--job-name") for c in comps[1:] for o in c)
    assert all("--partition=batch" in c and "--time=04:00:00" in c for c in comps)
    for k, role in enumerate(plan.roles):
        assert f"start_role {k} {role.name}" in text


def test_tree_topology_uses_switches_and_old_slurm_gets_no_segment():
    _, text = _render("cluster=h100")
    assert "--switches=2@00:10:00" in _directives(text)[0]  # 64 nodes under 32-node leaf switches
    assert "--segment" not in text
    _, old = _render("cluster=gb200_nvl72", "cluster.slurm_version=23.11")
    assert "#SBATCH --segment" not in old and "# --segment=16 needs Slurm 24.05" in old


def test_container_flags_on_every_srun():
    _, text = _render("container.image=/img/hpc_rl.sqsh", "container.mounts=[/lustre:/lustre]", run_dir="/runs/x")
    line = next(ln for ln in text.splitlines() if "--container-image" in ln)
    for flag in ("--container-image=/img/hpc_rl.sqsh", '--container-mounts="$RUN_DIR:$RUN_DIR,/lustre:/lustre"',
                 "--no-container-mount-home", "--container-env=HPC_RL_ROLE,", "HPC_RL_MASTER_ADDR", "HPC_RL_MASTER_PORT"):
        assert flag in line
    _, bare = _render(run_dir="/runs/x")
    assert "--container" not in bare


@pytest.mark.parametrize("image", ["images/hpc_rl.sqsh", "hpc_rl.sqsh"])
def test_relative_sqsh_path_is_rejected(image):
    with pytest.raises(ConfigError) as info:
        load_config(["+recipe=ultra_mopd", f"container.image={image}"])
    (v,) = [v for v in info.value.violations if v.key == "container.image"]
    assert "must start with '/' or './'" in v.problem and f"./{image}" in v.fix


def test_registry_images_and_dot_slash_paths_are_accepted():
    for image in ("nvcr.io#nvidia/pytorch:25.01-py3", "./hpc_rl.sqsh", "/lustre/hpc_rl.sqsh"):
        assert load_config(["+recipe=ultra_mopd", f"container.image='{image}'"]).container.image == image

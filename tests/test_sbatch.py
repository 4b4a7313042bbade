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


def _fake_slurm_bin(tmp_path):
    """Stand-ins for srun, scontrol and squeue that only record that they were called: no
    Slurm runs here, and these tests ask only whether the script reached them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    for tool in ("srun", "scontrol", "squeue"):
        (bin_dir / tool).write_text(f'#!/bin/bash\necho "{tool} $HPC_RL_ROLE $*" >> {calls}\n')
        (bin_dir / tool).chmod(0o755)
    return bin_dir, calls


def _run_hand_submitted(tmp_path, *overrides):
    """Render a script as the shipped ones are (no run directory) and run it with bash, with
    the variables Slurm would set for a batch script."""
    import os
    import sys

    rendered = ["+recipe=" + overrides[0].split("=", 1)[1], *overrides[1:]]
    cfg = load_config(rendered)
    script = tmp_path / "job.sbatch"
    script.write_text(render(cfg, build_plan(cfg), RenderOptions(python=sys.executable, overrides=tuple(rendered))))
    bin_dir, calls = _fake_slurm_bin(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_RL_", "SLURM_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="4242")
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    run_dir = tmp_path / "runs" / f"{cfg.recipe}-4242"
    return proc, run_dir, calls.read_text().splitlines() if calls.exists() else []


def test_hand_submitted_script_refuses_a_config_it_cannot_run_before_any_srun(tmp_path):
    # ultra_mopd plans (the dry run shows it) but this run cannot start: no student checkpoint
    # (an input check), and a precision for env ranks, which load no model (a support rule).
    # launcher=slurm refuses that before it submits; a script submitted by hand must refuse it
    # too, not start 224 nodes of ranks that fail.
    proc, run_dir, calls = _run_hand_submitted(tmp_path, "recipe=ultra_mopd", "env.precision=fp32")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "nothing was submitted" in out
    assert "env.precision = 'fp32'" in out and "model.path = None" in out  # support rules and input checks
    assert calls == [], calls  # neither srun nor any other Slurm command was reached
    assert not (run_dir / "plan.json").exists()


def test_hand_submitted_script_plans_an_accepted_config_then_starts_each_role(tmp_path):
    proc, run_dir, calls = _run_hand_submitted(tmp_path, "recipe=comm_check", "cluster=local_slurm")
    out = proc.stdout + proc.stderr
    assert (run_dir / "plan.json").exists() and (run_dir / "config.yaml").exists(), out
    assert "name: slurm" in (run_dir / "config.yaml").read_text()  # the run records how it was launched
    assert "comm_check on local_slurm" in out  # the plan table, in the job's output
    started = [c.split()[1] for c in calls if c.startswith("srun ")]  # in the background: any order
    assert sorted(started) == sorted(["trainer", "generator", "teacher/math", "env"]), calls
    # the fake srun ran no rank, so the shell reports that and does not requeue (ft.max_restarts=0)
    assert proc.returncode == 1 and "exited without finishing" in out

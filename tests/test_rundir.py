"""RunDir owns every path of a run directory; the batch shell takes its names from it."""

from __future__ import annotations

import subprocess

from hpc_rl.config import load_config
from hpc_rl.plan import build_plan
from hpc_rl.rundir import RunDir, role_file_name, shell_role_file_name
from hpc_rl.slurm.sbatch import RESTART_WORD, SH, RenderOptions, _role_reports, render


def test_paths_per_role_and_restart():
    rd = RunDir("/runs/x")
    assert rd.log("teacher/math", 2, "err") == rd.path / "logs" / "teacher-math.2.err"
    assert rd.error_report("teacher/math", 3, 1) == rd.path / "errors" / "teacher-math.3.1.txt"
    assert rd.dead_rank(1).parent == rd.fatal(1).parent == rd.errors
    assert rd.stopped(0) != rd.stopped(1) and rd.save_request(1).name.startswith(".")


def test_the_shell_variables_name_the_same_files_as_python(tmp_path):
    """bash evaluates RunDir's shell lines; each must be the path Python uses for restart 3."""
    lines = RunDir("$RUN_DIR").shell_lines("$HPC_RL_RESTART")
    names = [ln.split("=", 1)[0] for ln in lines]
    script = "\n".join(lines) + "\n" + "\n".join(f'echo "{n}=${n}"' for n in names) + "\n"
    script += f'role="teacher/math"; echo "role={shell_role_file_name("role")}"\n'
    out = subprocess.run(["bash", "-c", script], env={"RUN_DIR": str(tmp_path), "HPC_RL_RESTART": "3"},
                         capture_output=True, text=True, check=True).stdout
    got = dict(line.split("=", 1) for line in out.splitlines())
    rd = RunDir(tmp_path)
    expected = {name: str(path) for name, path in rd.shell_vars(3)}
    assert {k: got[k] for k in expected} == expected
    assert got["role"] == role_file_name("teacher/math")


def test_the_rendered_script_has_no_second_literal_of_a_file_name():
    cfg = load_config(["+recipe=ultra_mopd"])
    text = render(cfg, build_plan(cfg), RenderOptions())
    # every string of the script that RunDir rendered
    from_rundir = [*SH.shell_lines(RESTART_WORD), str(SH.log("$log", RESTART_WORD, "out")),
                   str(SH.log("$log", RESTART_WORD, "err")), _role_reports("name"), _role_reports("failed_name")]
    for piece in from_rundir:
        assert piece in text
    names = (RunDir.PLAN, RunDir.FINISHED, RunDir.JOB_EXIT, "stopped.", "save_request", "dead_rank", "fatal.",
             "topology.", "errors/", "logs/")
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not line.startswith("#SBATCH"):
            continue  # comments may talk about files
        for var, _ in SH.shell_vars(RESTART_WORD):  # the variables' own names are no file names
            line = line.replace(f"${var}", "$") if not line.startswith(f"{var}=") else line
        for name in names:
            if name in line:
                assert any(piece in line for piece in from_rundir), f"{name!r} written outside RunDir: {line}"


def test_the_rl_records_and_preemption_files_are_where_rundir_says(tmp_path):
    """Writers that still spell their own file names (hpc_rl/rl/, ft/preemption.py) must agree
    with RunDir, which the batch shell, launchers and drills read by."""
    from hpc_rl.ft.preemption import save_requested, write_stopped
    from hpc_rl.rl.inputs import TRAIN_FILE
    from hpc_rl.rl.records import MetricsLog, Progress, RolloutStore

    rd = RunDir(tmp_path)
    assert MetricsLog(tmp_path).path == rd.metrics and RolloutStore(tmp_path).path == rd.rollouts
    assert Progress(tmp_path, 3).path == rd.progress and rd.summary == tmp_path / "summary.json"
    assert tmp_path / TRAIN_FILE == rd.train_data
    rd.save_request(2).write_text("time limit near (USR1)\n")
    assert save_requested(tmp_path, 2) == "time limit near (USR1)" and save_requested(tmp_path, 1) is None
    write_stopped(tmp_path, 2, step=5, saved=True, requested_at=0.0)
    assert rd.stopped(2).exists()

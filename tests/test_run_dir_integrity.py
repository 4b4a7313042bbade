"""A run directory others cannot write into, writes that survive a crash, and resumes that
neither stop at a damaged record file nor mix two runs (issue 43). Fast: no Slurm, no vLLM."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.validate_rundir import parse_dir_mode
from hpc_rl.plan import build_plan
from hpc_rl.rl.records import MetricsLog, RolloutStore
from hpc_rl.durable import publish_dir, write_atomic
from hpc_rl.rundir import RunDir
from hpc_rl.slurm.sbatch import RenderOptions, render

DRY = ["+recipe=tiny_mopd", "launcher=dry_run"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def permissive_umask():
    old = os.umask(0o002)  # a common site default: the group may write whatever is made
    try:
        yield
    finally:
        os.umask(old)


# -- modes --------------------------------------------------------------------------------


def test_run_dir_create_makes_private_directories_whatever_the_umask(tmp_path, permissive_umask):
    cfg = load_config([*DRY, f"run.dir={tmp_path / 'a' / 'b'}"])
    rd = RunDir.create(cfg, build_plan(cfg))  # pipelines and tests call it outside launch.py's umask
    assert _mode(tmp_path / "a") == _mode(rd.path) == _mode(rd.logs) == 0o700
    os.umask(0o077)  # a stricter umask does not narrow what run.dir_mode asks for
    cfg = load_config([*DRY, f"run.dir={tmp_path / 'c'}", "run.dir_mode=0750"])
    assert _mode(RunDir.create(cfg, build_plan(cfg)).logs) == 0o750


def test_a_launch_makes_the_run_dir_its_subdirs_and_files_private_whatever_the_umask(tmp_path, permissive_umask):
    from hpc_rl.launch import main

    run = tmp_path / "runs" / "r"
    assert main([*DRY, f"run.dir={run}"]) == 0
    for d in (run.parent, run, run / "logs", run / "config_reads"):
        assert _mode(d) == 0o700, d
    for f in (run / "config.yaml", run / "plan.json"):
        assert _mode(f) == 0o600, f
    assert os.umask(0o002) == 0o002  # the launch restored the process's umask


def test_run_dir_mode_is_honoured_and_an_existing_dir_is_tightened(tmp_path, permissive_umask):
    from hpc_rl.launch import main

    run = tmp_path / "r"
    run.mkdir(mode=0o777)
    os.chmod(run, 0o777)
    assert main([*DRY, f"run.dir={run}", "run.dir_mode=0750"]) == 0
    assert _mode(run) == _mode(run / "logs") == 0o750
    assert _mode(run / "config.yaml") == 0o640  # the group reads, never writes


@pytest.mark.parametrize("mode", ["0777", "0770", "0702", "448", "0600", "rwx", "01700"])
def test_a_dir_mode_others_could_write_through_or_that_is_no_mode_is_refused(mode):
    with pytest.raises(ConfigError) as err:
        load_config([*DRY, f"run.dir_mode={mode}"])
    text = err.value.render()
    assert "run.dir_mode" in text and 'run.dir_mode="0700"' in text
    if mode in ("0777", "0770", "0702"):
        assert "plant pickles" in text


def test_dir_mode_parsing():
    assert parse_dir_mode("0700") == parse_dir_mode("700") == parse_dir_mode("0o700") == parse_dir_mode(0o700) == 0o700
    assert parse_dir_mode("0750") == 0o750 and parse_dir_mode("755") == 0o755
    assert load_config([*DRY, "run.dir_mode=750"]).run.dir_mode == "750"  # Hydra reads it as a number


def test_the_batch_shell_makes_its_files_and_its_tasks_private(tmp_path):
    cfg = load_config(["+recipe=ultra_mopd"])
    text = render(cfg, build_plan(cfg), RenderOptions())
    (line,) = [ln for ln in text.splitlines() if ln.startswith("umask ")]
    assert "export SLURM_UMASK=0077" in line  # srun hands sbatch's SLURM_UMASK to the tasks otherwise
    assert 'chmod 0700 "$RUN_DIR" "$LOG_DIR"' in text
    script = f'umask 0002; {line}; mkdir -p d/logs; touch d/x; echo "$SLURM_UMASK"'
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0077"
    assert _mode(tmp_path / "d") == _mode(tmp_path / "d" / "logs") == 0o700 and _mode(tmp_path / "d" / "x") == 0o600
    cfg = load_config(["+recipe=ultra_mopd", "run.dir_mode=0750"])
    assert "umask 0027; export SLURM_UMASK=0027" in render(cfg, build_plan(cfg), RenderOptions())


# -- durable writes --------------------------------------------------------------------------


@pytest.fixture
def fsyncs(monkeypatch):
    calls = []
    real = os.fsync

    def counting(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, fsyncs):
    write_atomic(tmp_path / "job.json", "{}\n")
    assert len(fsyncs) == 2
    assert Path(fsyncs[0]).name.startswith(".job.json.tmp") and fsyncs[1] == str(tmp_path)
    fsyncs.clear()
    write_atomic(tmp_path / "now.json", "{}\n", durable=False)  # a rank's current phase: stale once it dies
    assert fsyncs == [] and (tmp_path / "now.json").read_text() == "{}\n"


def test_publish_dir_replaces_an_older_directory_whole_or_leaves_it(tmp_path, fsyncs):
    """The exports' publish (ckpt/export.py, ckpt/export_lora.py): filled beside its name, on disk,
    then renamed over the older one; an error leaves the older one and no temporary directory."""
    out = tmp_path / "final_hf"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with publish_dir(out, "export") as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("the write failed")
    assert [p.name for p in tmp_path.iterdir()] == ["final_hf"] and (out / "old.txt").exists()
    with publish_dir(out, "export") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp_export_final_hf_")
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"] and [p.name for p in tmp_path.iterdir()] == ["final_hf"]
    synced = [Path(p) for p in fsyncs]
    assert synced[-1] == tmp_path and any(p.name == "new.txt" for p in synced)

def test_a_checkpoint_save_fsyncs_the_directories_of_its_shards(tmp_path, fsyncs):
    from hpc_rl.ckpt import save_checkpoint

    backend = SimpleNamespace(model=torch.nn.Linear(2, 2), optimizer=None, step_count=0)
    final = save_checkpoint(tmp_path / "ckpt", 1, backend, {"step": 1}, "recipe: r\n", recipe="r")
    synced = [Path(p) for p in fsyncs]
    assert any(p.name == "dcp" and p.parent.name.startswith(".tmp_step_1_") for p in synced)
    assert tmp_path / "ckpt" in synced and (final / "manifest.json").is_file()


# -- damaged records on resume ---------------------------------------------------------------


def test_a_torn_last_line_of_metrics_is_dropped_and_named(tmp_path, caplog):
    log = MetricsLog(tmp_path)
    for s in (1, 2, 3):
        log.append({"kind": "step", "step": s, "reward_mean": 0.5})
    with log.path.open("a") as f:
        f.write('{"kind": "step", "step": 4, "rew')  # the writer was killed mid-line
    with caplog.at_level(logging.WARNING):
        assert log.truncate_after(3) == 0  # no whole step to drop: the file is rewritten all the same
    assert str(log.path) in caplog.text and "line 4" in caplog.text and '"step": 4' in caplog.text
    log.append({"kind": "step", "step": 4, "reward_mean": 0.7})  # the resumed run's next record
    assert [json.loads(ln)["step"] for ln in log.path.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_rollouts_file_is_moved_aside_named_and_does_not_block_the_resume(tmp_path, caplog, damage):
    store = RolloutStore(tmp_path)
    for step in (1, 2, 3):
        store.write(step, {"rewards": np.arange(5000, dtype=np.float32)}, {"agents": ["a"]})
    data = store.path.read_bytes()
    store.path.write_bytes(os.urandom(4096) if damage == "garbage" else data[: len(data) // 2])
    with caplog.at_level(logging.WARNING):
        assert store.truncate_after(2) == 0
    (aside,) = tmp_path.glob("rollouts.h5.damaged.*")
    assert str(store.path) in caplog.text and aside.name in caplog.text and "dropped" in caplog.text
    store.write(3, {"rewards": np.zeros(2, dtype=np.float32)}, {"agents": ["a"]})  # the run goes on
    with h5py.File(store.path, "r") as f:
        assert "step_000003" in f


def test_a_damaged_rollouts_file_keeps_its_readable_steps(tmp_path, caplog, monkeypatch):
    """A file that opens for reading but not for editing (HDF5's consistency flags after a
    killed writer): its steps up to the resumed one are copied, nothing is lost."""
    store = RolloutStore(tmp_path)
    for step in (1, 2, 3):
        store.write(step, {"rewards": np.full(3, step, dtype=np.float32)}, {"agents": ["a"]})
    real = h5py.File

    def no_edit(path, mode="r", *a, **kw):
        if mode == "a":
            raise OSError("Unable to open file (file is already open for write)")
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(h5py, "File", no_edit)
    with caplog.at_level(logging.WARNING):
        store.truncate_after(2)
    monkeypatch.undo()
    with h5py.File(store.path, "r") as f:
        assert sorted(f) == ["step_000001", "step_000002"] and f["step_000002"]["rewards"][:].tolist() == [2, 2, 2]
    assert "kept 2 step groups up to step 2" in caplog.text


# -- checkpoint.resume=false over existing checkpoints ----------------------------------------


def _checkpoint(root: Path, step: int) -> None:
    from hpc_rl.ckpt import capture_rng_state, save_checkpoint

    backend = SimpleNamespace(model=torch.nn.Linear(2, 2), optimizer=None, step_count=step)
    save_checkpoint(root, step, backend, {"step": step, "iterator": {"pos": step}, "rng": capture_rng_state()},
                    "recipe: tiny_mopd\n", recipe="tiny_mopd")


def test_resume_false_over_existing_checkpoints_is_refused_before_launch(tmp_path):
    from hpc_rl.rl.inputs import _check_resumable

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    out = []
    _check_resumable(out, load_config([*DRY, f"run.dir={run}", "checkpoint.resume=false"]))
    (v,) = out
    assert v.key == "checkpoint.resume" and str(run / "checkpoints") in v.problem and "step_00000004" in v.problem
    assert "another run.dir" in v.fix and "checkpoint.resume=true" in v.fix and "delete" in v.fix
    out = []
    _check_resumable(out, load_config([*DRY, f"run.dir={tmp_path / 'new'}", "checkpoint.resume=false"]))
    assert out == []


def _checkpointer(run: Path, restart: int, resume: bool):
    from hpc_rl.rl.checkpointing import Checkpointer

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume=resume, dir=None), recipe="tiny_mopd")
    ctx = SimpleNamespace(cfg=cfg, log=logging.getLogger("test"), run_dir=run, ident=SimpleNamespace(restart=restart),
                          groups=SimpleNamespace(role=None))
    trainer = SimpleNamespace(is_driver=True, routes=SimpleNamespace(driver=0),
                              backend=SimpleNamespace(model=torch.nn.Linear(2, 2), optimizer=None, step_count=0))
    return Checkpointer(ctx, trainer)


class _Iterator:
    state = None

    def load_state_dict(self, state):
        self.state = state


def test_a_rank_refuses_a_fresh_start_over_checkpoints_and_a_requeue_resumes_its_own(tmp_path, caplog):
    from hpc_rl.ckpt import MixedRunsError

    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", 4)
    with pytest.raises(MixedRunsError, match="checkpoint.resume=false.*step_00000004"):
        _checkpointer(run, restart=0, resume=False).resume(_Iterator())
    assert MixedRunsError.no_retry
    # a requeue: the launch refused older checkpoints, so these are this run's own; its records
    # are damaged by the crash and must not stop it
    MetricsLog(run).append({"kind": "step", "step": 4})
    with MetricsLog(run).path.open("a") as f:
        f.write('{"kind": "st')
    (run / "rollouts.h5").write_bytes(b"\0" * 100)
    it = _Iterator()
    with caplog.at_level(logging.WARNING):
        assert _checkpointer(run, restart=1, resume=False).resume(it) == 4
    assert it.state == {"pos": 4} and "metrics.jsonl" in caplog.text and "rollouts.h5 is damaged" in caplog.text
    assert json.loads((run / "restarts.jsonl").read_text())["resumed_from_step"] == 4


@pytest.mark.parametrize("restart, resume", [(0, False), (1, True)])
def test_a_start_from_step_0_truncates_the_records(tmp_path, restart, resume):
    """A fresh run, or a requeue that never saved: each step appears once in the records."""
    run = tmp_path / "run"
    run.mkdir()
    MetricsLog(run).append({"kind": "step", "step": 1})
    assert _checkpointer(run, restart=restart, resume=resume).resume(_Iterator()) == 0
    assert MetricsLog(run).read() == []

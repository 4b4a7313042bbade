"""Job handles on a cluster with Slurm accounting (issue 19): the local cluster's real
slurmdbd (launchers/local_slurm.sh starts it unless ACCOUNTING=0), per-role states and the
culprit from sacct's steps, PENDING (not UNKNOWN) before sacct lists a job, and a
reattached run directory that proves its job is its own. The first tests need no Slurm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hpc_rl.config import load_config
from hpc_rl.launchers.slurm import submit
from hpc_rl.plan import build_plan
from hpc_rl.rundir import prepare_run_dir
from hpc_rl.slurm import states
from hpc_rl.slurm.executor import HetInfoWatcher, job_from_run_dir
from hpc_rl.slurm.watch import LostJudge, follow

COMM_CHECK = ["+recipe=comm_check", "cluster=local_slurm", "launcher=slurm"]

# What sacct printed here for a comm_check job whose generator rank raised (issue 19's case):
# every allocation FAILED, only the steps tell the culprit from the roles the batch shell stopped.
SACCT_ONE_ROLE_FAILED = """\
1+0|hpc_rl-comm_check|FAILED|6:0|2026-12-01T13:50:13|2026-12-01T13:50:32
1+0.batch|batch|FAILED|6:0|2026-12-01T13:50:14|2026-12-01T13:50:32
1+0.0|python|CANCELLED by 0|0:9|2026-12-01T13:50:14|2026-12-01T13:50:31
1+1|hpc_rl-comm_check|FAILED|6:0|2026-12-01T13:50:13|2026-12-01T13:50:32
1+1.3|python|FAILED|6:0|2026-12-01T13:50:14|2026-12-01T13:50:27
1+2|hpc_rl-comm_check|FAILED|6:0|2026-12-01T13:50:13|2026-12-01T13:50:32
1+2.2|python|CANCELLED by 0|0:9|2026-12-01T13:50:14|2026-12-01T13:50:31
1+3|hpc_rl-comm_check|FAILED|6:0|2026-12-01T13:50:13|2026-12-01T13:50:32
1+3.1|python|CANCELLED by 0|0:9|2026-12-01T13:50:14|2026-12-01T13:50:31
"""
ROLES = ["trainer", "generator", "teacher/math", "env"]


def test_steps_single_out_the_failed_role_where_allocations_all_read_failed():
    rec = states.parse_sacct(SACCT_ONE_ROLE_FAILED)["1"]
    assert set(rec.states().values()) == {"FAILED"}  # what `sacct -X` alone says
    roles = {role: states.role_state(rec.components[f"1+{k}"].state, rec.steps[f"1+{k}"]) for k, role in enumerate(ROLES)}
    assert roles == {"trainer": "CANCELLED", "generator": "FAILED", "teacher/math": "CANCELLED", "env": "CANCELLED"}
    assert states.culprit({role: rec.steps[f"1+{k}"] for k, role in enumerate(ROLES)}) == "generator"
    # while the job runs, a role whose step completed is still part of a RUNNING job
    done = states.Row("1+3.1", "COMPLETED")
    assert states.role_state("RUNNING", [done]) == "RUNNING" and states.role_state("RUNNING", []) == "RUNNING"


def test_a_record_of_an_older_job_with_the_same_id_is_not_this_job():
    rec = states.parse_sacct(SACCT_ONE_ROLE_FAILED)["1"]
    later = states.JobIdentity("1", "hpc_rl-comm_check", "2026-12-01T14:00:00")
    same = states.JobIdentity("1", "hpc_rl-comm_check", "2026-12-01T13:50:13")
    other_name = states.JobIdentity("1", "hpc_rl-tiny_mopd", "2026-12-01T13:50:13")
    assert states.fitting(rec, same)[0] is rec
    assert states.fitting(rec, later)[0] is None and "before this run's job" in states.fitting(rec, later)[1]
    assert states.fitting(rec, other_name)[0] is None and "'hpc_rl-tiny_mopd'" in states.fitting(rec, other_name)[1]
    # a requeue moves the submit time on: a later record of the same job still fits
    assert states.fitting(rec, states.JobIdentity("1", "hpc_rl-comm_check", "2026-12-01T13:40:00"))[0] is rec
    # recorded by an older version (no name, no submit time): accepted, not checkable
    assert states.fitting(rec, states.JobIdentity("1"))[0] is rec and not states.JobIdentity("1").checkable


# `sacct -D -j 1` here after a cluster restart (abridged): an old 3-component job 1 with a
# 4th component, then this run's 2-component job 1. Without -D sacct printed the newest row per
# component, the old `1+2` with the new `1+0`, `1+1`: one record of two jobs that fit no identity.
SACCT_ID_REUSED = """\
1+0|hpc_rl-tiny_mopd|COMPLETED|0:0|2026-12-02T02:25:16|2026-12-02T02:26:48|None
1+0.2|python|COMPLETED|0:0|2026-12-02T02:25:17|2026-12-02T02:26:44|
1+1|hpc_rl-tiny_mopd|COMPLETED|0:0|2026-12-02T02:25:16|2026-12-02T02:26:48|None
1+1.0|python|COMPLETED|0:0|2026-12-02T02:25:17|2026-12-02T02:26:47|
1+2|hpc_rl-tiny_mopd|COMPLETED|0:0|2026-12-02T02:25:16|2026-12-02T02:26:48|None
1+2.1|python|COMPLETED|0:0|2026-12-02T02:25:17|2026-12-02T02:26:44|
1+0|hpc_rl-comm_check|COMPLETED|0:0|2026-12-02T05:29:44|2026-12-02T05:29:55|None
1+0.1|python|COMPLETED|0:0|2026-12-02T05:29:45|2026-12-02T05:29:54|
1+1|hpc_rl-comm_check|FAILED|1:0|2026-12-02T05:29:44|2026-12-02T05:29:55|None
1+1.0|python|FAILED|1:0|2026-12-02T05:29:45|2026-12-02T05:29:54|
"""


def test_a_reused_id_reads_as_one_record_per_job_never_a_mix():
    old, new = states.parse_sacct_instances(SACCT_ID_REUSED)["1"]
    assert set(old.components) == {"1+0", "1+1", "1+2"} and set(new.components) == {"1+0", "1+1"}
    assert new.steps["1+1"][0].state == "FAILED" and old.steps["1+1"][0].state == "COMPLETED"  # steps stay with their job
    this = states.JobIdentity("1", "hpc_rl-comm_check", "2026-12-02T05:29:44")
    assert states.fitting_of([old, new], this)[0] is new
    assert states.parse_sacct(SACCT_ID_REUSED)["1"] is not None  # the newest, for readers without an identity
    before = states.JobIdentity("1", "hpc_rl-tiny_mopd", "2026-12-02T02:25:16")
    assert states.fitting_of([old, new], before)[0] is old  # a requeue's newer record would fit too
    later = states.JobIdentity("1", "hpc_rl-comm_check", "2026-12-02T06:00:00")
    rec, why = states.fitting_of([old, new], later)
    assert rec is None and "before this run's job" in why


class _SacctOutageOnce(HetInfoWatcher):
    """Fakes one transient sacct failure (slurmdbd briefly unreachable) and canned answers:
    stopping the shared cluster's slurmdbd inside a test is not an option here."""

    def __init__(self, sacct_answers, squeue_answers):
        super().__init__(delay_s=0)
        self.sacct_answers, self.squeue_answers = list(sacct_answers), list(squeue_answers)

    def _sacct(self, ids):
        text = self.sacct_answers.pop(0)
        return None if text is None else states.parse_sacct_instances(text)

    def _squeue(self, ids):
        return states.parse_squeue(self.squeue_answers.pop(0))


def test_fake_sacct_outage_is_not_sticky_and_a_component_sacct_misses_comes_from_squeue(tmp_path):
    sub = "2026-12-01T13:50:13"
    w = _SacctOutageOnce(
        sacct_answers=[None,  # accounting does not answer: squeue for everything
                       f"5+0|n|RUNNING|0:0|{sub}|Unknown\n",  # sacct lists component 0 only (yet)
                       "".join(f"5+{k}|n|COMPLETED|0:0|{sub}|{sub}\n" for k in range(2))],
        squeue_answers=[f"5+0|RUNNING|n|{sub}\n5+1|PENDING|n|{sub}\n", f"5+0|RUNNING|n|{sub}\n5+1|PENDING|n|{sub}\n"])
    w.register_job_of("5", tmp_path, states.JobIdentity("5", "n", sub), components=2)
    seen = []
    for _ in range(3):
        time.sleep(0.01)  # submitit ignores a forced update within 1 ms of the last
        info = w.get_info("5", mode="force")
        seen.append((info["State"], info["source"], dict(info["components"])))
    assert seen[0] == ("RUNNING", "squeue", {"5+0": "RUNNING", "5+1": "PENDING"})
    assert seen[1] == ("RUNNING", "sacct+squeue", {"5+0": "RUNNING", "5+1": "PENDING"})  # per component, never UNKNOWN
    assert seen[2] == ("COMPLETED", "sacct", {"5+0": "COMPLETED", "5+1": "COMPLETED"})  # back on sacct: nothing sticky
    assert not w.squeue_answers  # sacct listed every component the third time: squeue not asked


def test_unknown_is_lost_only_once_the_run_directory_stops_changing(tmp_path):
    judge = LostJudge(tmp_path, lost_after_s=0.3)
    (tmp_path / "progress.json").write_text("{}")
    assert not judge.lost("UNKNOWN")
    time.sleep(0.4)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.0.out").write_text("step 3\n")  # still writing: healthy
    assert not judge.lost("UNKNOWN") and "still following" in judge.note()
    old = time.time() - 10
    for p in (tmp_path / "progress.json", tmp_path / "logs" / "trainer.0.out", tmp_path / "logs", tmp_path):
        os.utime(p, (old, old))
    assert judge.lost("UNKNOWN")
    assert not judge.lost("RUNNING") and judge.since is None  # a state resets the count


# ----------------------------------------------------------------------------- real slurmdbd


@pytest.fixture(scope="module")
def accounting(local_slurm):
    """The local cluster with slurmdbd; skipped only when the cluster was asked to run without."""
    if os.environ.get("ACCOUNTING") == "0":
        pytest.skip("ACCOUNTING=0: the local cluster runs without slurmdbd")
    proc = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=30, env=local_slurm.env())
    assert proc.returncode == 0, f"sacct does not answer on the local cluster (launchers/local_slurm.sh up starts slurmdbd): {proc.stderr}"
    return local_slurm


def _submit(run_dir, *overrides):
    cfg = load_config([*COMM_CHECK, f"run.dir={run_dir}", *overrides])
    plan = build_plan(cfg)
    return submit(cfg, plan, prepare_run_dir(cfg, plan))


def _wait_for_accounting(job, deadline_s=120.0):
    """slurmdbd records a job's end after squeue shows it (a loaded CI machine saw follow() end on
    squeue's COMPLETED before sacct listed the job): wait for the record, then check it is used."""
    t0 = time.monotonic()
    while True:
        job.component_states(force=True)
        if job.source == "sacct" or time.monotonic() - t0 > deadline_s:
            break
        time.sleep(0.5)
    if job.source != "sacct":  # say what sacct itself prints now, so a failure here can be read
        proc = subprocess.run(["sacct", "-D", "-n", "-P", "-o", states.SACCT_FIELDS, "-j", job.job_id],
                              capture_output=True, text=True, timeout=60)
        raise AssertionError(f"sacct did not list job {job.job_id} ({job.identity}) within {deadline_s:.0f}s of its end; "
                             f"source {job.source!r}; sacct rc {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-500:]}")


@pytest.mark.slurm
def test_sacct_passing_het_job_and_reattach_proves_it_is_the_same_job(accounting, tmp_path):
    job = _submit(tmp_path / "run")
    assert follow(job, poll_s=0.5, timeout_s=180, echo=lambda line: None) == "COMPLETED"
    _wait_for_accounting(job)
    assert job.component_states(force=True) == dict.fromkeys(ROLES, "COMPLETED")
    meta = json.loads((tmp_path / "run" / "job.json").read_text())
    assert meta["job_name"] == "hpc_rl-comm_check" and states.slurm_epoch(meta["submit_time"]) is not None
    again = job_from_run_dir(tmp_path / "run")
    same, why = again.check_identity()
    assert same is True and "sacct" in why, why


@pytest.mark.slurm
def test_sacct_one_failing_role_reads_failed_and_the_others_cancelled(accounting, tmp_path):
    job = _submit(tmp_path / "run", "ft.inject_failure=generator:0")
    assert follow(job, poll_s=0.5, timeout_s=120, echo=lambda line: None) == "FAILED"
    _wait_for_accounting(job)
    comps = job.component_states(force=True)
    # Slurm cancels the other steps once the generator's fails, but a rank that sees its peer gone
    # first (the teacher's exchange with the dead generator) may end FAILED on its own: the culprit
    # is the step that failed first, not the only one.
    assert comps["generator"] == "FAILED" and set(comps) == set(ROLES), comps
    assert all(state in ("CANCELLED", "FAILED") for state in comps.values()), comps
    rec = json.loads((tmp_path / "run" / "job_exit.json").read_text())
    info = job.watcher.get_info(job.job_id, mode="cache")
    from_steps = states.culprit({role: info["steps"].get(cid, []) for role, cid in zip(job.roles, job.component_ids)})
    assert from_steps == rec["failed_role"] == job.failed_role() == "generator"  # the steps agree with the batch shell
    assert job.failure().startswith("generator:0: RuntimeError: injected failure")


@pytest.mark.slurm
def test_a_component_waiting_for_nodes_reads_pending_not_unknown(accounting, tmp_path):
    env = accounting.env()
    blocker = subprocess.run(["sbatch", "--parsable", "-N", str(len(accounting.nodes)), "--exclusive", "-J", "i19-blocker",
                              "-o", str(tmp_path / "blocker.out"), "--wrap", "sleep 300"],
                             capture_output=True, text=True, timeout=30, env=env).stdout.strip().split(";")[0]
    assert blocker.isdigit()
    job = None
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["squeue", "-h", "-j", blocker, "-o", "%T"], capture_output=True, text=True, env=env).stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "the blocker job did not start"
            time.sleep(0.3)
        job = _submit(tmp_path / "run")
        seen = []
        t0 = time.monotonic()
        # sacct lists a new pending job only after a second or two: follow it until sacct has it
        while time.monotonic() - t0 < 3 or (seen[-1][2] != "sacct" and time.monotonic() - t0 < 20):
            seen.append((job.component_states(force=True), job.watcher.get_state(job.job_id, mode="cache"), job.source))
            time.sleep(0.2)
        assert all(overall == "PENDING" and comps == dict.fromkeys(ROLES, "PENDING") for comps, overall, _ in seen), seen
        assert seen[-1][2] == "sacct", seen  # squeue covered whatever sacct did not list yet
        # another job that got this run's id (the controller restarts with -c) is not this run's
        fake = tmp_path / "reused"
        fake.mkdir()
        for name in ("config.yaml", "plan.json"):
            (fake / name).write_text((tmp_path / "run" / name).read_text())
        meta = json.loads((tmp_path / "run" / "job.json").read_text())
        (fake / "job.json").write_text(json.dumps({**meta, "job_id": blocker}))
        same, why = job_from_run_dir(fake).check_identity()
        assert same is False and "'i19-blocker'" in why, why
        proc = subprocess.run([sys.executable, "-m", "hpc_rl.slurm.watch", str(fake), "--cancel"], capture_output=True, text=True,
                              timeout=60, env=env)
        assert proc.returncode == 1 and "not cancelled" in proc.stderr, proc.stderr
        assert subprocess.run(["squeue", "-h", "-j", blocker, "-o", "%T"], capture_output=True, text=True, env=env).stdout.strip() == "RUNNING"
    finally:
        if job is not None:
            job.cancel()
        subprocess.run(["scancel", blocker], timeout=30, env=env)
    assert follow(job, poll_s=0.5, timeout_s=60, echo=lambda line: None) == "CANCELLED"

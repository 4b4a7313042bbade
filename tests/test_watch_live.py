"""Per-rank phase timing (hpc_rl/observe/timing.py) and the live view (observe/live.py,
`python -m hpc_rl.slurm.watch`). A live job on the local Slurm cluster, watched while it
runs, is the het job of tests/test_rl_loop.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.observe import live, timing
from hpc_rl.observe.timing import KEEP, PhaseClock
from hpc_rl.rundir import RunDir


class FakeClock:
    """Stands in for the time module inside observe/timing.py: the test moves time."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def _walk(clock: FakeClock, pc: PhaseClock, *moves) -> None:
    """moves: (phase, step, seconds spent in it)."""
    for phase, step, seconds in moves:
        pc.enter(phase, step)
        clock.t += seconds


def test_a_rank_records_each_phase_per_step_and_its_current_phase(tmp_path, clock):
    pc = PhaseClock(tmp_path, "teacher/add", 1, 0, node="n7")
    _walk(clock, pc, ("setup", None, 5.0), ("wait", KEEP, 1.0),  # outside steps: not recorded
          ("score", 1, 2.0), ("wait", KEEP, 0.5), ("score", KEEP, 1.0), ("wait", KEEP, 0.25),
          ("score", 2, 3.0))
    now = json.loads(RunDir(tmp_path).phase_now("teacher/add", 1, 0).read_text())
    assert now == {"role": "teacher/add", "rank": 1, "restart": 0, "node": "n7", "step": 2, "phase": "score",
                   "since": 1009.75, "waiting": False}
    (line,) = [json.loads(x) for x in RunDir(tmp_path).step_timing("teacher/add", 1, 0).read_text().splitlines()]
    assert line["step"] == 1 and line["phases"] == {"score": 3.0, "wait": 0.75}
    assert (line["step_s"], line["busy_s"], line["wait_s"]) == (3.75, 3.0, 0.75)
    assert (line["start"], line["end"]) == (1006.0, 1009.75) and line["node"] == "n7"
    pc.enter("score")  # the same phase again (a caller and its callee): nothing changes
    assert pc.since == 1009.75
    clock.t += 1.0
    pc.close()  # the end records the open step and says done
    lines = [json.loads(x) for x in RunDir(tmp_path).step_timing("teacher/add", 1, 0).read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["phases"] == {"score": 4.0}
    assert json.loads(RunDir(tmp_path).phase_now("teacher/add", 1, 0).read_text())["phase"] == "done"


def test_a_call_that_reports_its_blocked_time_moves_it_to_a_waiting_phase(tmp_path, clock):
    pc = PhaseClock(tmp_path, "generator", 0, 0)
    _walk(clock, pc, ("sample", 1, 1.0), ("refit", KEEP, 3.0))
    pc.carve("wait_refit", 2.5)  # the receive was blocked 2.5 s of its 3 s
    pc.carve("wait_refit", 9.0)  # never more than the phase has had
    pc.close()
    (line,) = [json.loads(x) for x in RunDir(tmp_path).step_timing("generator", 0, 0).read_text().splitlines()]
    assert line["phases"] == {"sample": 1.0, "refit": 0.0, "wait_refit": 3.0} and line["busy_s"] == 1.0


def test_status_text_is_what_the_heartbeat_publishes_and_parses_back():
    assert timing.status_text("sample", 3) == "step 3 sample"
    assert timing.status_text("eval", None) == "eval"
    assert timing.parse_status("step 3 wait_rows") == (3, "wait_rows")
    assert timing.parse_status("wait_end") == (None, "wait_end")
    assert timing.is_waiting("wait_scores") and not timing.is_waiting("train")


def _step_line(role, rank, step, busy, wait, restart=0, phases=None):
    return {"role": role, "rank": rank, "restart": restart, "node": f"node{rank}", "step": step, "start": 0.0,
            "end": 1.0, "step_s": busy + wait, "busy_s": busy, "wait_s": wait,
            "phases": phases or {"work": busy, "wait": wait}}


def _write_steps(run_dir: Path, lines) -> None:
    rd = RunDir(run_dir)
    rd.timing.mkdir(parents=True, exist_ok=True)
    for rec in lines:
        with rd.step_timing(rec["role"], rec["rank"], rec["restart"]).open("a") as f:
            f.write(json.dumps(rec) + "\n")


def test_the_slowest_rank_of_each_role_is_named_per_step_and_over_the_run(tmp_path):
    _write_steps(tmp_path, [
        _step_line("generator", 0, 1, 1.0, 0.5), _step_line("generator", 1, 1, 1.4, 0.1),
        _step_line("generator", 0, 2, 1.2, 0.3), _step_line("generator", 1, 2, 1.1, 0.4),
        _step_line("generator", 2, 1, 0.9, 0.6), _step_line("generator", 2, 2, 0.8, 0.7),
        _step_line("trainer", 0, 1, 2.0, 0.1), _step_line("trainer", 0, 2, 2.1, 0.1),
        # restart 1 recomputed step 2 of trainer:0: its line replaces restart 0's
        _step_line("trainer", 0, 2, 3.0, 0.1, restart=1)])
    s1 = timing.slowest_by_role(tmp_path, 1)
    assert s1["generator"]["rank"] == 1 and s1["generator"]["ranks"] == 3 and s1["generator"]["busy_median_s"] == 1.0
    assert timing.slowest_by_role(tmp_path, 2)["generator"]["rank"] == 0
    assert timing.slowest_by_role(tmp_path, 2)["trainer"]["busy_s"] == 3.0
    run = timing.slowest_ranks(tmp_path)
    assert run["generator"]["rank"] == "generator:1" and run["generator"]["busy_s_mean"] == 1.25
    assert run["generator"]["busy_s_mean_median"] == 1.1 and run["generator"]["node"] == "node1"
    assert run["trainer"] == {"rank": "trainer:0", "node": "node0", "steps": 2, "busy_s_mean": 2.5,
                              "step_s_mean": 2.6, "ranks": 1, "busy_s_mean_median": 2.5}


def test_tail_lines_reads_the_end_and_skips_a_line_being_written(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text("".join(f'{{"i": {i}}}\n' for i in range(5000)) + '{"i": 50')
    assert timing.tail_lines(path, 2) == ['{"i": 4998}', '{"i": 4999}']
    assert len(timing.tail_lines(path, None)) == 5000
    assert timing.tail_lines(tmp_path / "missing", 3) == []


def test_the_summary_names_the_slowest_rank_of_each_role(tmp_path):
    from hpc_rl.rl.records import MetricsLog, render_summary, summarize

    MetricsLog(tmp_path).append({"kind": "step", "step": 1, "timing": {"step_s": 2.0}, "token_mult_prob_error": 1.0})
    _write_steps(tmp_path, [_step_line("env", 0, 1, 0.2, 1.8), _step_line("env", 1, 1, 0.5, 1.5)])
    s = summarize(tmp_path)
    assert s["steps"] == 1 and s["seconds_per_step_mean"] == 2.0  # the keys it had stay
    assert s["slowest_ranks"]["env"]["rank"] == "env:1"
    assert json.loads(RunDir(tmp_path).summary.read_text())["slowest_ranks"]["env"]["rank"] == "env:1"
    text = render_summary(s)
    assert "slowest rank per role" in text and "env:1" in text


# ------------------------------------------------------------------------------ the view
def _fake_run(run_dir: Path, now: float) -> None:
    """What a two-step tiny_mopd run leaves while in step 3."""
    rd = RunDir(run_dir)
    rd.logs.mkdir(parents=True)
    rd.config.write_text("recipe: tiny_mopd\n")
    rd.plan.write_text(json.dumps({"roles": [{"name": "trainer"}, {"name": "generator"}]}))  # the role order
    rd.progress.write_text(json.dumps({"step": 3, "total_steps": 4, "phase": "train", "time": now - 0.5,
                                       "elapsed_s": 10.0, "s_per_step": 2.0, "eta_s": 4.0}))
    with rd.metrics.open("w") as f:
        f.write(json.dumps({"kind": "eval", "tag": "start", "step": 0, "accuracy": {"add_agent": 0.5},
                            "reverse_kl": {"add": 0.9, "mean": 0.95}}) + "\n")
        for step, kl in ((1, 0.9), (2, 0.8)):
            f.write(json.dumps({"kind": "step", "step": step, "reverse_kl": {"mean": kl}, "reward_mean": 0.5,
                                "token_mult_prob_error": 1.00001, "loss": 0.01, "timing": {"step_s": 2.0}}) + "\n")
    lines = []
    for step in (1, 2):
        lines += [_step_line("trainer", 0, step, 1.5, 0.5, phases={"wait_rows": 0.5, "train": 1.5}),
                  _step_line("generator", 0, step, 0.5, 1.5, phases={"wait": 1.5, "sample": 0.5}),
                  _step_line("generator", 1, step, 0.9, 1.1, phases={"wait": 1.1, "sample": 0.9})]
    lines.append(_step_line("trainer", 0, 3, 0.1, 0.0))  # not every rank has left step 3: not shown
    _write_steps(run_dir, lines)
    for role, rank, phase, since in (("trainer", 0, "train", now - 1.0), ("generator", 0, "refit", now - 1.0),
                                     ("generator", 1, "refit", now - 3.5)):
        rd.phase_now(role, rank, 0).write_text(json.dumps({"role": role, "rank": rank, "restart": 0, "node": "n",
                                                           "step": 3, "phase": phase, "since": since}))


def test_the_view_shows_progress_phases_metrics_and_the_slowest_ranks(tmp_path):
    now = time.time()
    _fake_run(tmp_path, now)
    view = live.render(tmp_path, "RUNNING", steps=2, now=now)
    assert "step 3/4 train" in view and "(updated 0.5s ago)" in view
    assert "generator           2  refit@3 x2" in view and "generator:1 refit for 3.5s" in view
    assert "trainer:0 train for 1.0s" in view
    assert "     2    2.00   0.8000   0.500   1.00001   0.0100" in view
    assert "validation start (step 0): accuracy add_agent 0.500; reverse KL mean 0.9500" in view
    assert "slowest rank per role" in view and "step 3 " not in view
    assert "step 2   trainer       trainer:0           1.50 (1.50) of 2.00  wait_rows* 0.50 train 1.50" in view
    assert "         generator     generator:1         0.90 (0.70) of 2.00  wait* 1.10 sample 0.90" in view


# the `agentic` figures of one step of an agentic run (a row of its metrics.jsonl, as
# agentic/figures.py finishes them), in which the environment failed 6 of 16 episodes
AGENTIC_ROW = {"kind": "step", "step": 2, "reward_mean": 0.25, "loss": 0.02, "timing": {"step_s": 9.5},
               "agentic": {"episodes": 16.0, "turns": 20.0, "errors": 4.0, "truncated": 2.0, "failed": 6.0,
                           "failed_share": 0.375, "max_error_share": 0.25, "timeouts": 2.0,
                           "errors_by_kind": {"ValueError": 4.0}, "timeouts_by_kind": {"episode_timeout": 2.0},
                           "max_inflight_episodes": 8.0, "inflight_limit": 8, "max_inflight_env_rank": 8.0,
                           "max_queue_depth": 8.0, "queue_wait_s_mean": 1.234, "tool_latency_s_n": 12,
                           "tool_latency_s_mean": 0.0123, "tool_latency_s_p95": 0.0456, "engine_max_batch": 8.0}}


def test_the_view_shows_the_episodes_backpressure_and_faults_of_an_agentic_run(tmp_path):
    now = time.time()
    _fake_run(tmp_path, now)
    with RunDir(tmp_path).metrics.open("a") as f:
        f.write(json.dumps(dict(AGENTIC_ROW, step=3, agentic=dict(AGENTIC_ROW["agentic"], failed=0.0, failed_share=0.0,
                                                                   errors=0.0, errors_by_kind={}, timeouts=0.0,
                                                                   timeouts_by_kind={}))) + "\n")
        f.write(json.dumps(dict(AGENTIC_ROW, step=4)) + "\n")
    view = live.render(tmp_path, "RUNNING", steps=2, now=now)
    head = "  step episodes  failed errors timeouts inflight/limit env rank queued wait_s  tool_s    p95  (agentic)"
    assert head in view
    # failed share over env.agentic.max_error_share is flagged (!); the peak against its limit
    assert "     3       16      0%      0        0            8/8        8      8   1.23   0.012  0.046" in view
    assert "     4       16    38%!      4        2            8/8        8      8   1.23   0.012  0.046" in view
    assert ("step 4: errors ValueError 4; timeouts episode_timeout 2; the run ends above 25% failed "
            "(env.agentic.max_error_share)") in view
    assert "sandboxed tool calls" not in view  # only an environment that sandboxes (python_tool) has them
    # python_tool's sandboxed calls: counts, kills and seconds per call of the last step
    with RunDir(tmp_path).metrics.open("a") as f:
        f.write(json.dumps(dict(AGENTIC_ROW, step=5, agentic=dict(AGENTIC_ROW["agentic"], sandbox_calls=250.0,
                                                                   sandbox_timeouts=3.0, sandbox_failures=2.0,
                                                                   sandbox_s_mean=0.2638))) + "\n")
    view = live.render(tmp_path, "RUNNING", steps=2, now=now)
    assert "step 5: sandboxed tool calls 250, timed out (killed) 3, failed 2, 0.264 s per call" in view, view
    # a single-turn run has no agentic figures: no such section
    plain = tmp_path / "plain"
    _fake_run(plain, now)
    assert "(agentic)" not in live.render(plain, "RUNNING", steps=2, now=now)


def test_a_run_without_a_slurm_job_takes_its_state_from_its_files(tmp_path):
    rd = RunDir(tmp_path)
    rd.logs.mkdir(parents=True)
    assert live.file_state(tmp_path)[0] == live.STARTING
    rd.timing.mkdir()
    assert live.file_state(tmp_path) == (live.RUNNING, "")
    rd.stopped(0).write_text("{}")
    assert live.file_state(tmp_path)[0] == live.STOPPED
    rd.errors.mkdir()
    rd.error_report("env", 0, 0).write_text("env:0: RuntimeError: connection closed\ntraceback\n")
    rd.dead_rank(0).write_text("generator:0 missed heartbeats for 4.0s\n")
    assert live.file_state(tmp_path) == (live.FAILED, "generator:0 missed heartbeats for 4.0s")
    rd.finished.write_text("1\n")
    assert live.file_state(tmp_path) == (live.COMPLETED, "")


def test_watch_once_prints_a_snapshot_of_a_local_run(tmp_path):
    _fake_run(tmp_path, time.time())
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.slurm.watch", str(tmp_path), "--once", "--steps", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "RUNNING (no Slurm job: state from the run directory)" in proc.stdout
    assert "step 2   trainer" in proc.stdout and "step 1 " not in proc.stdout
    cancel = subprocess.run([sys.executable, "-m", "hpc_rl.slurm.watch", str(tmp_path), "--cancel"],
                            capture_output=True, text=True, timeout=60)
    assert cancel.returncode == 2 and "no Slurm job" in cancel.stderr


def test_follow_ends_with_the_run(tmp_path):
    from hpc_rl.slurm.watch import watch

    _fake_run(tmp_path, time.time())
    RunDir(tmp_path).finished.write_text("1\n")
    out = []
    assert watch(tmp_path, poll_s=0.01, echo=out.append) == live.COMPLETED
    assert len(out) == 1 and out[0].startswith(f"{tmp_path}: COMPLETED")


# ------------------------------------------------------------------ the progress watchdog
def status_store(statuses):
    """The job's signed store (in memory) holding each rank's heartbeat status."""
    import torch.distributed as dist

    from hpc_rl.runtime.signed_store import SignedStore, new_job_key

    store = SignedStore(dist.HashStore(), new_job_key().encode())
    for r, s in statuses.items():
        store.set(f"hb/0/{r}/status", s)
    return store


def _verdict(statuses, waited=10.0):
    from hpc_rl.runtime.heartbeat import Heartbeat

    names = ["trainer:0", "generator:0", "env:0"]
    hb = Heartbeat("127.0.0.1", 0, 0, len(statuses), 0, lambda r: names[r], Path("."), 1.0, 30.0,
                   progress_timeout_s=5.0)
    hb.status = statuses[0]
    store, memo = status_store(statuses), {}
    assert hb._progress_check(store, 0.0, memo) is None
    return hb._progress_check(store, waited, memo)


def test_the_watchdog_names_the_rank_at_work_not_those_waiting_for_it():
    v = _verdict({0: "step 2 wait_rows", 1: "step 2 sample", 2: "step 1 wait"})
    assert v.startswith("generator:0 made no progress for 10.0s") and "stuck in 'step 2 sample'" in v
    assert "while the others wait in ['step 1 wait', 'step 2 wait_rows']" in v
    # everyone waits (a message lost): the earliest is named
    assert _verdict({0: "step 2 wait_rows", 1: "step 1 wait", 2: "wait"}).startswith("env:0 made no progress")
    # an evaluation or start-up is not watched
    assert _verdict({0: "eval", 1: "step 2 sample", 2: "wait"}) is None
    assert _verdict({0: "setup", 1: "wait", 2: "wait"}) is None


# The live view of a running job on local Slurm is checked on the het job that
# tests/test_rl_loop.py launches anyway (issue #30: one launch, both checks).

"""Environment faults (issue #27): an environment that raises scores 0 and is counted by
kind, its traceback's last line logged once per kind; a hung one times out at the episode's
deadline and is counted; a step whose share of failed episodes exceeds
`env.agentic.max_error_share` ends the run before it is trained, naming the environment, the
share, the key and the fix; the figures that reach the metrics merge over engines exactly.
The faulty environments are tests/agentic_envs.py's, the policy a random tiny model.

The drill at the end runs them in a real job on the local Slurm cluster: the env rank is
killed with SIGKILL, the job is requeued and resumed, and no episode is trained twice or lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from agentic_envs import FaultyCalculator, fault_of, nan_of
from test_agentic_common import run

from hpc_rl.agentic.contract import Limits
from hpc_rl.agentic.faults import EpisodeFaultsError, ErrorLog, check_error_share, failed_count
from hpc_rl.agentic.figures import finish_stats, latency_figures, merge_stats
from hpc_rl.agentic.runner import run_episodes
from hpc_rl.data.tasks import calculator


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A random tiny Llama with the assets' tokenizer: the faults are the environment's, the
    policy only has to answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.models.assets import ModelSpec, save_untrained

    path = save_untrained(tmp_path_factory.mktemp("student"), ModelSpec(), seed=0)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _tasks_with_each_fault(n_each: int = 2):
    """Calculator tasks: n_each that raise, n_each that hang, n_each healthy (in that order)."""
    by = {"raise": [], "hang": [], None: []}
    for t in calculator(200, seed=5):
        if len(by[fault_of(t["prompt"])]) < n_each:
            by[fault_of(t["prompt"])].append(t)
    return by["raise"] + by["hang"] + by[None]


def test_a_raising_and_a_hung_environment_score_and_are_counted_by_kind(student):
    from hpc_rl.agentic.local import HFPolicy

    model, tok = student
    tasks = _tasks_with_each_fault()
    deadline = 1.5
    limits = Limits(max_turns=2, max_tokens=64, turn_timeout_s=30, episode_timeout_s=deadline, truncated_reward=-0.5)
    t0 = time.perf_counter()
    faulty = run(run_episodes(tasks[:4], FaultyCalculator(), HFPolicy(model, tok), limits, tok, max_inflight=4))
    took = time.perf_counter() - t0
    (_, r1), (_, r2), (_, h1), (_, h2) = list(faulty)
    for r in (r1, r2):  # raised: scored 0, the error named with the line that raised it
        assert (r.reward, r.truncated, r.info["error_kind"]) == (0.0, False, "ValueError")
        assert "agentic_envs.py" in r.info["error_line"] and "in run: ValueError: the calculator refused" in r.info["error_line"]
    for h in (h1, h2):  # hung: truncated at the episode's deadline, scored as truncated
        assert (h.reward, h.truncated, h.info["truncated_by"]) == (-0.5, True, "episode_timeout")
    assert deadline <= took < deadline + 5  # the two hangs ran concurrently, each cut at its deadline
    # the healthy ones beside them (the deadline is theirs too: a slow machine may truncate them, never fail them)
    batch = run(run_episodes(tasks, FaultyCalculator(), HFPolicy(model, tok), Limits(max_turns=2, max_tokens=64,
                             turn_timeout_s=30, episode_timeout_s=30), tok, max_inflight=6))
    healthy = [r for _, r in list(batch)[4:]]
    assert all("error" not in r.info and r.info.get("truncated_by") != "episode_timeout" for r in healthy)
    m = batch.metrics()
    assert m["errors"] == 2 and m["errors_by_kind"] == {"ValueError": 2}
    assert m["timeouts_by_kind"]["episode_timeout"] == 2 and m["failed"] == 4 == failed_count(m)
    assert m["max_inflight"] == 6 and m["inflight_limit"] == 6 and m["max_queue_depth"] == 0
    # tool latency: one sample per policy turn of the healthy episodes (the hung and raising ones took none)
    assert m["tool_latency_s_n"] == sum(r.info["turns"] for r in healthy) > 0
    assert set(batch.error_lines()) == {"ValueError"}


def test_episodes_past_the_limit_queue_and_the_queue_is_measured(student):
    from hpc_rl.agentic.local import HFPolicy

    model, tok = student
    tasks = [t for t in calculator(60, seed=9) if fault_of(t["prompt"]) is None][:5]
    batch = run(run_episodes(tasks, FaultyCalculator(), HFPolicy(model, tok), Limits(max_turns=2, max_tokens=96), tok,
                             max_inflight=2))
    m = batch.metrics()
    # five episodes, two slots: the other three wait at the start, and waited some time
    assert (m["max_inflight"], m["max_queue_depth"]) == (2, 3) and m["queue_wait_s_mean"] > 0


def test_each_error_kind_is_logged_once_with_its_traceback_line(caplog):
    log = logging.getLogger("test_agentic_faults")
    errors = ErrorLog(log, "agentic_envs:faulty_calculator")
    with caplog.at_level(logging.WARNING, logger="test_agentic_faults"):
        assert errors.note({"ValueError": 'File "env.py", line 3, in run: ValueError: x'}, {"ValueError": 5}, 1) == 1
        assert errors.note({"ValueError": "again", "KeyError": "File ...: KeyError: 'k'"}, {"ValueError": 9, "KeyError": 1}, 2) == 1
        assert errors.note({"ValueError": "again"}, {"ValueError": 1}, 3) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "raised ValueError (5 of this round, step 1" in lines[0] and lines[0].endswith("ValueError: x")
    assert "agentic_envs:faulty_calculator" in lines[0] and "agentic.errors_by_kind" in lines[0]
    assert "raised KeyError (1 of this round, step 2" in lines[1]


def test_figures_merge_over_engines_exactly():
    a = {"episodes": 4.0, "errors": 1.0, "failed": 2.0, "max_inflight_episodes": 3.0, "max_queue_depth": 1.0,
         "queue_wait_s": 2.0, "errors_by_kind": {"ValueError": 1.0}, "timeouts_by_kind": {"episode_timeout": 1.0},
         "tool_latency_s": [0.1, 0.2, 0.3]}
    b = {"episodes": 4.0, "errors": 2.0, "failed": 2.0, "max_inflight_episodes": 4.0, "max_queue_depth": 0.0,
         "queue_wait_s": 0.0, "errors_by_kind": {"ValueError": 1.0, "KeyError": 1.0}, "timeouts_by_kind": {},
         "tool_latency_s": [0.4] + [1.0] * 16}
    m = finish_stats(merge_stats(merge_stats({}, a), b), inflight_limit=4, max_error_share=0.25)
    assert (m["episodes"], m["errors"], m["failed"], m["max_inflight_episodes"], m["max_queue_depth"]) == (8, 3, 4, 4, 1)
    assert m["errors_by_kind"] == {"ValueError": 2, "KeyError": 1} and m["timeouts_by_kind"] == {"episode_timeout": 1}
    assert m["queue_wait_s_mean"] == 0.25 and m["failed_share"] == 0.5
    assert (m["inflight_limit"], m["max_error_share"]) == (4, 0.25) and "tool_latency_s" not in m
    # 20 samples: the mean of all of them; the 95th percentile is the 19th smallest (nearest rank)
    assert m["tool_latency_s_n"] == 20 and m["tool_latency_s_mean"] == pytest.approx((0.6 + 0.4 + 16) / 20)
    assert m["tool_latency_s_p95"] == 1.0
    assert latency_figures([0.5, 0.1, 0.3])["tool_latency_s_p95"] == 0.5 and latency_figures([]) == {"tool_latency_s_n": 0}
    assert finish_stats({}, 4, 0.25) == {}  # a single-turn collection has no episodes' figures


def test_a_step_over_the_error_share_ends_the_run_naming_environment_share_key_and_fix():
    stats = {"episodes": 32, "errors": 6, "errors_by_kind": {"ValueError": 6},
             "timeouts_by_kind": {"episode_timeout": 3, "turn_timeout": 5}}
    assert failed_count(stats) == 9  # a policy turn's timeout is the engine's, not the environment's
    check_error_share(stats, 0.3, "agentic_envs:faulty_calculator", 4)  # 9/32 = 28%: trained on
    check_error_share(dict(stats, errors=0, errors_by_kind={}, timeouts_by_kind={}), 0.0, "x", 1)  # none failed
    with pytest.raises(EpisodeFaultsError) as info:
        check_error_share(stats, 0.25, "agentic_envs:faulty_calculator", 4)
    msg = str(info.value)
    for part in ("step 4", "9 of 32 episodes (28%)", "'agentic_envs:faulty_calculator'", "ValueError 6",
                 "episode_timeout 3", "env.agentic.max_error_share=0.25", "was not trained", "Fix the environment",
                 "raise env.agentic.max_error_share"):
        assert part in msg, (part, msg)
    assert "turn_timeout" not in msg
    assert info.value.no_retry  # the batch shell does not requeue a run that would replay the same episodes


def test_an_episode_that_failed_before_its_first_turn_is_not_an_old_sample(student):
    """Its placeholder row (no policy token) takes the version the engine serves: in step 3
    of a lock-step run it used to read as a sample of version 0, two steps old, and end the
    run over the age bound."""
    from types import SimpleNamespace

    from hpc_rl.roles.episode_runner import trained_rows
    from hpc_rl.roles.episodes import stamp_unsampled
    from hpc_rl.rl.loop import check_age_bound

    _, tok = student
    (placeholder,) = trained_rows([], tok)
    with pytest.raises(RuntimeError, match="2 steps old"):
        check_age_bound(SimpleNamespace(rows=[placeholder]), 3, 1)
    stamp_unsampled([[placeholder]], 2)
    assert (placeholder.version_first, placeholder.version_last) == (2, 2)
    check_age_bound(SimpleNamespace(rows=[placeholder]), 3, 1)


def test_max_error_share_is_validated_between_0_and_1():
    from hpc_rl.config import ConfigError, load_config

    base = ["+recipe=tiny_agentic_grpo", "launcher=dry_run"]
    assert load_config(base).env.agentic.max_error_share == 0.25  # the documented default
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ConfigError) as info:
            load_config(base + [f"env.agentic.max_error_share={bad}"])
        (v,) = [v for v in info.value.violations if v.key == "env.agentic.max_error_share"]
        assert "between 0 and 1" in v.problem and "[0, 1]" in v.fix


def test_a_policy_call_that_never_returns_is_a_turn_timeout_not_a_failure(student):
    _, tok = student

    async def never(prompt_ids, max_tokens):
        await asyncio.Event().wait()

    tasks = [t for t in calculator(40, seed=1) if fault_of(t["prompt"]) is None][:2]
    batch = run(run_episodes(tasks, FaultyCalculator(), never, Limits(turn_timeout_s=0.2, episode_timeout_s=5.0), tok, 2))
    m = batch.metrics()
    assert m["timeouts_by_kind"]["turn_timeout"] == 2 and m["timeouts"] == 2 and m["failed"] == 0


# ------------------------------------------- a job on the local Slurm cluster: kill, requeue, faults
def _drill_overrides(ckpt, inflight: int):
    return ["+recipe=tiny_agentic_grpo", "cluster=local_slurm", f"model.path={ckpt}", "run.max_steps=3",
            "algo.prompts_per_step=8", "algo.generations_per_prompt=2", "trainer.global_batch_size=16",
            "data.samples_per_task=64", "data.eval_prompts_per_task=0", "checkpoint.every_steps=1",
            "checkpoint.keep_last=2", "checkpoint.export_final=false", "ft.heartbeat_timeout_s=10",
            "env.agentic.environment=agentic_envs:nan_rewards_calculator_down_after_16",
            "env.agentic.episode_timeout_s=20", "env.agentic.turn_timeout_s=20", "env.agentic.max_error_share=0.7",
            f"env.agentic.max_inflight_episodes={inflight}", "ft.inject_failure=env:0:kill@2"]


def _expected_items(run, steps: int):
    """The prompt records an uninterrupted run trains on at each step: the run's own
    dataset and seed through the same iterator (the items are drawn by the driver alone)."""
    from hpc_rl.data.dataset import PromptIterator
    from hpc_rl.rl.inputs import load_dataset
    from hpc_rl.runtime.worker import load_run

    cfg, _ = load_run(run)
    it = PromptIterator(load_dataset(cfg, run), cfg.algo.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    return [[r for r in next(it) for _ in range(cfg.algo.generations_per_prompt)] for _ in range(steps)]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_killed_env_rank_is_requeued_and_resumed_and_a_failing_environment_ends_the_run(local_slurm, tmp_path):
    """tiny_agentic_grpo as a het job, 3 steps of 16 episodes, a checkpoint every step, with
    the faulty calculator whose rewards are NaN for some prompts (issue 43): some prompts
    raise, some hang (a 20 s deadline, which the healthy episodes of a loaded machine stay well
    inside), some return NaN. The env rank is SIGKILLed as step 2 reaches it: the job is
    requeued and resumes from step 1's checkpoint. In the resumed job every reward is NaN
    after step 2's 16 episodes: step 3 fails entirely, over env.agentic.max_error_share=0.7,
    and the run ends there, untrained and not requeued, naming the NaN rewards; the
    checkpoints left hold finite weights and no optimizer step saw a non-finite loss. Every
    step trained holds exactly the items an uninterrupted run draws, none twice."""
    import collections
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import h5py

    from hpc_rl.models.assets import ModelSpec, save_untrained
    from hpc_rl.slurm import chaos

    ckpt = save_untrained(tmp_path / "student", ModelSpec(), seed=0)
    run, inflight = tmp_path / "run", 8
    env = local_slurm.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), env.get("PYTHONPATH")) if p)
    t0 = chaos.time.monotonic()
    job = chaos.launch(run, _drill_overrides(ckpt, inflight), env=env)
    res = chaos.result(run, job, chaos.follow(run, job, timeout_s=900), t0)
    print(f"drill: {res.seconds:.0f} s, state {res.state}, restarts {res.restarts}")
    # the kill: requeued once, resumed from step 1's checkpoint, nothing recorded twice
    assert [(r["restart"], r["resumed_from_step"], r["steps_recomputed"]) for r in res.restarts] == [(1, 1, 0)], res
    # the environment that went down: the run ends failed, not requeued, saying what and why
    assert res.state == "FAILED" and res.job_exit.get("requeued") is False and res.job_exit["restart"] == 1, res.job_exit
    detail = res.job_exit["detail"]
    for part in ("not requeued", "EpisodeFaultsError", "step 3: 16 of 16 episodes (100%)",
                 "'agentic_envs:nan_rewards_calculator_down_after_16'", "NonFiniteReward 16",
                 "env.agentic.max_error_share=0.7"):
        assert part in detail, (part, detail)

    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2]  # step 3 was not trained
    expected = _expected_items(run, 2)
    with h5py.File(run / "rollouts.h5") as f:
        trained = [[x.decode() for x in f[f"step_{k:06d}"]["item_ids"][:]] for k in (1, 2)]
    seen = collections.Counter(i for ids in trained for i in ids)
    for k, (s, ids, want) in enumerate(zip(steps, trained, expected), start=1):
        # the items an uninterrupted run trains on at this step, each prompt's 2 generations once
        assert collections.Counter(ids) == collections.Counter(r.id for r in want), k
        a = s["agentic"]
        raised = sum(fault_of(r.prompt) == "raise" for r in want)
        hung = sum(fault_of(r.prompt) == "hang" for r in want)
        nanned = sum(nan_of(r.prompt) for r in want)  # a NaN reward is the episode's error, counted by kind
        kinds = {k: n for k, n in (("ValueError", raised), ("NonFiniteReward", nanned)) if n}
        assert a["episodes"] == 16 and a["errors_by_kind"] == kinds, (k, a)
        assert a["timeouts_by_kind"].get("episode_timeout", 0) == hung and a["failed"] == raised + hung + nanned, (k, a)
        assert a["failed_share"] == (raised + hung + nanned) / 16 and a["max_error_share"] == 0.7
        assert not s.get("nonfinite_skipped"), (k, s)  # no NaN reached the trainer's loss
        # backpressure: the limit reached, the rest queued, the tool's time measured
        assert a["max_inflight_episodes"] == a["inflight_limit"] == inflight == a["max_inflight_env_rank"]
        assert a["max_queue_depth"] == 16 - inflight and a["tool_latency_s_n"] > 0
    assert max(seen.values()) == 2  # across the requeue: no prompt trained in two steps

    # each kind of error logged once per env rank process (restart), with its traceback's line
    logs = {k: (run / "logs" / f"env.{k}.out").read_text(errors="replace") for k in (0, 1)}
    for k, text in logs.items():
        for kind in ("ValueError", "NonFiniteReward"):
            assert len(re.findall(rf"an episode raised {kind} ", text)) <= 1, (k, kind)
    assert re.search(r"an episode raised NonFiniteReward .*nan", logs[1], re.I), logs[1][-3000:]
    # the checkpoints retention left hold finite weights (the manifest's check over every rank's shard)
    manifests = [json.loads(m.read_text()) for m in sorted(run.glob("checkpoints/*/manifest.json"))]
    assert manifests and all(m["weights_finite"] is True for m in manifests), manifests

    # the watch shows the episodes' figures of the run
    view = subprocess.run([sys.executable, "-m", "hpc_rl.slurm.watch", str(run), "--once"], capture_output=True,
                          text=True, timeout=120, env=env).stdout
    assert "(agentic)" in view and re.search(rf"^\s+2\s+16\s+\d+%\s+\d+\s+\d+\s+{inflight}/{inflight}\s", view, re.M), view

"""`+recipe=tiny_agentic` end to end, locally, for 2 steps: multi-turn calculator episodes
run by the env rank against the generator's endpoint, distilled from the tool-using teacher.
The environment is a user's own, loaded by `module:factory` from tests/agentic_envs.py: the
calculator, plus a follow-up on a compacted history in about half of the episodes, so the
run holds plain multi-turn trajectories and sibling samples (rl/siblings.py).

The student here is the tool-using teacher itself (tiny_agentic:teacher_calc), so the
episodes really take several turns from the first step: the test is about the mechanics
(token exactness, loss masks, the endpoint's key), not about learning, which
bench/rl_results.py measures over 120 steps. While the run is up, the test knocks on the
endpoint without the key and with a wrong one, as a stranger on the cluster would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ENDPOINT_LINE = re.compile(r"serves its endpoint at (http://\S+/v1)")


def _knock(url: str, key: str = None) -> int:
    req = urllib.request.Request(f"{url}/tokens", data=json.dumps({"prompt_token_ids": [1, 2, 3]}).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_for_endpoint(run: Path, proc: subprocess.Popen, deadline_s: float = 600.0) -> str:
    """The generator logs its endpoint's address once its engine is up (an event, not a delay)."""
    t0 = time.time()
    while time.time() - t0 < deadline_s and proc.poll() is None:
        for log in (run / "logs").glob("generator*"):
            m = ENDPOINT_LINE.search(log.read_text(errors="replace"))
            if m:
                return m.group(1)
        time.sleep(0.5)
    raise AssertionError(f"no endpoint line in {run}/logs within {deadline_s} s (launch rc {proc.poll()})")


def _job_key_of(run: Path) -> str:
    """The job's secret, read where only the job (and root) can: a rank's environment."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text(errors="replace").split("\0")
                           if "=" in kv)
        except OSError:
            continue
        if environ.get("HPC_RL_RUN_DIR") == str(run) and environ.get("HPC_RL_JOB_KEY"):
            return environ["HPC_RL_JOB_KEY"]
    raise AssertionError(f"no rank of {run} found in /proc")


@pytest.fixture(scope="module")
def agentic_run(tmp_path_factory):
    from hpc_rl.serving import endpoint_key

    run = tmp_path_factory.mktemp("agentic") / "run"
    tests = str(Path(__file__).resolve().parent)  # agentic_envs, for the launcher's validation and the env rank
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_agentic", "run.max_steps=2", f"run.dir={run}",
                             "model.path=tiny_agentic:teacher_calc", "algo.prompts_per_step=16", "trainer.global_batch_size=32",
                             "data.samples_per_task=64", "data.eval_prompts_per_task=8", "checkpoint.every_steps=2",
                             "env.agentic.environment=agentic_envs:compacting_calculator"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    knocks = {}
    try:
        url = _wait_for_endpoint(run, proc)
        job_key = _job_key_of(run)
        knocks = {"none": _knock(url), "wrong": _knock(url, "0" * 64)}
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    return run, proc.returncode, out, knocks, {"job": job_key, "endpoint": endpoint_key({"HPC_RL_JOB_KEY": job_key})}


def test_a_request_without_the_jobs_key_gets_401_and_is_counted(agentic_run):
    run, rc, out, knocks, _ = agentic_run
    assert rc == 0, out[-3000:]
    assert knocks == {"none": 401, "wrong": 401}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["auth_rejected_by_kind"].get("endpoint", 0) >= 2, summary.get("auth_rejected_by_kind")


def test_no_key_reaches_a_file_of_the_run_directory(agentic_run):
    run, rc, out, _, keys = agentic_run
    assert rc == 0, out[-3000:]
    files = [p for p in run.rglob("*") if p.is_file()]
    assert len(files) > 20
    for p in files:
        data = p.read_bytes()
        for name, key in keys.items():
            assert key.encode() not in data, f"the {name} key is in {p}"


def test_multi_turn_trajectories_are_token_exact_and_only_the_policys_tokens_train(agentic_run):
    import h5py
    import numpy as np

    run, rc, out, _, _ = agentic_run
    assert rc == 0, out[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        a = s["agentic"]
        assert a["episodes"] == 32 and a["errors"] == 0
        assert a["changed_policy_tokens"] == 0  # no policy token changed between turns
        assert a["turns"] > 1.5 * a["episodes"], a  # the tool-using policy takes two turns
        # compacted histories: their earlier samples are rows of their own, trained and scored
        assert 0 < a["siblings"] < a["episodes"] and s["samples"] == a["episodes"] + a["siblings"], (a, s["samples"])
        assert 1.0 <= s["token_mult_prob_error"] <= 1.001, s  # fp32: trainer vs vLLM on the stored ids
        # the student is the teacher: the teacher rank, scoring the same stored ids in their full
        # multi-turn context, must give the student's own log-probs (same model, fp32)
        assert s["reverse_kl"]["calc"] < 1e-4, s["reverse_kl"]
    with h5py.File(run / "rollouts.h5") as f:
        g = f["step_000002"]
        assert g["input_ids"].shape[0] == steps[1]["samples"]  # the siblings' rows are stored too
        mask, attn, turn = g["response_mask"][:], g["attention_mask"][:], g["turn_index"][:]
        # environment tokens inside the response: in the context (attended), not trained (mask 0)
        inside = (turn >= 0) & (attn == 1)
        assert ((mask == 0) & inside).any() and (turn.max() >= 1)
        assert (g["token_versions"][:][mask == 1] == 1).all()  # step 2 samples with step 1's weights
        assert np.all(g["advantages"][:][mask == 0] == 0)


def test_multi_turn_episodes_with_asynchronous_rollouts_and_in_flight_weight_updates(tmp_path):
    """The same recipe with the generator sampling step k+1 while the trainer trains step k,
    and step k's weights sent while step k+1's episodes run (they land in the serving loop
    between scheduler steps, or after the episodes: on this machine the tiny episodes
    usually end first): every policy token keeps the version it was sampled under, within
    the age bound, and stays token-exact."""
    import h5py

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_agentic", "run.max_steps=3", f"run.dir={run}",
                           "algo.prompts_per_step=16", "trainer.global_batch_size=32", "data.samples_per_task=64",
                           "data.eval_prompts_per_task=0", "algo.async_rollout.enabled=true",
                           "algo.async_rollout.in_flight_weight_updates=true"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["agentic"]["changed_policy_tokens"] == 0 and s["agentic"]["errors"] == 0
        assert max(int(a) for a in s["versions"]["age"]) <= 1  # algo.async_rollout.max_trajectory_age_steps
        if "token_mult_prob_error" in s:  # samples of the trainer's own weights: the engine must agree
            assert s["token_mult_prob_error"] <= 1.001, s
    with h5py.File(run / "rollouts.h5") as f:
        for k, s in enumerate(steps, start=1):
            g = f[f"step_{k:06d}"]
            versions = set(g["token_versions"][:][g["response_mask"][:] == 1].tolist())
            # step k samples started on the weights of step k-2 at the oldest (k-1 with lock-step)
            assert versions and versions <= {max(k - 2, 0), k - 1}, (k, versions)

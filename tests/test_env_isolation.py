"""Attack tests at the environment libraries' boundary (issue 43, docs/security.md): a hostile
verifiers taskset and a hostile NeMo Gym resources server (tests/attack_envs, TEST-ONLY), run
through hpc_rl's own bridges against a real tiny model, try every way attack_probe.py knows
to read the job's secret (their own environment, every /proc/PID/environ and cmdline they
can see, their parent's, /proc/PID/root), the user's home, the run directory and the data,
to write into the repository and the run directory, and to connect to the job's store (a
listening TCP port standing in for it). Each episode scores 1.0 only when every attempt was
stopped. Seen failing before the jail (hpc_rl/envs/jail.py): the verifiers worker read the
secret from its parent's environ, the home and run-directory files, wrote into both
directories and reached the store; Gym did all of that but the store (its network namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from adapted_envs import JOB_KEY, Recorder, job_key_set, run_batch

ROOT = Path(__file__).resolve().parents[1]
ATTACK = ROOT / "tests" / "attack_envs"


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """What a hostile environment aims at: a secret in the user's home, a run directory in the
    repository (where runs/ lives) with its config and data, and the store's port."""
    home = Path(os.path.expanduser("~"))
    secret = home / f".hpc_rl_attack_secret_{uuid.uuid4().hex[:8]}"
    secret.write_text(JOB_KEY)
    secret.chmod(0o600)
    run = ROOT / "runs" / f"attack_{uuid.uuid4().hex[:8]}"
    (run / "data").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    (run / "data" / "train.jsonl").write_text('{"prompt": "What is 2 plus 2?", "answer": "4"}\n')
    # a process that holds the secret in the environment it started with, as every rank, its
    # supervisor and the batch shell do (a variable set later is not in /proc/PID/environ)
    decoy = subprocess.Popen(["sleep", "3600"], env=dict(os.environ, HPC_RL_JOB_KEY=JOB_KEY))
    store = socket.socket()
    store.bind(("127.0.0.1", 0))
    store.listen(16)
    t = {"read": [str(secret), str(run / "config.yaml"), str(run / "data" / "train.jsonl")],
         "write": [str(ROOT), str(run)], "store": ["127.0.0.1", store.getsockname()[1]], "home": str(home)}
    try:
        yield t
    finally:
        store.close()
        decoy.kill()
        decoy.wait()
        secret.unlink()
        shutil.rmtree(run)


def _no_plants(t):
    planted = [str(p) for d in t["write"] for p in Path(d).glob("planted_by_environment_*")]
    assert not planted, f"an environment wrote into {planted}"


def _policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.agentic.local import HFPolicy
    from hpc_rl.rl.inputs import resolve_model_ref

    path = resolve_model_ref("tiny:student")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    return path, tok, lambda: Recorder(HFPolicy(model, tok, greedy=False))


def _stopped(batch):
    m = batch.metrics()
    assert m["episodes"] == 2 and m["errors"] == 0, (m, batch.error_lines())
    rewards = [result.reward for _, result in batch]
    # 1.0: the probe ran and every attempt was stopped; -N: N attacks worked (the env rank's log has which)
    assert rewards == [1.0, 1.0], rewards


def test_a_hostile_verifiers_environment_reaches_no_secret_file_or_store(env_interpreters_ready, targets):
    from hpc_rl.agentic.verifiers_bridge import VerifiersEpisode

    path, tok, policy = _policy()
    episode = VerifiersEpisode("hpc_rl_attack", str(path), {"targets": json.dumps(targets), "num_tasks": 2})
    with job_key_set():
        try:
            episode.start()
            batch = run_batch(episode, tok, [policy(), policy()])
            pid = episode.worker.proc.pid
            assert JOB_KEY.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        finally:
            episode.close()
    _stopped(batch)
    _no_plants(targets)


def test_a_hostile_gym_resources_server_reaches_no_secret_file_or_store(env_interpreters_ready, targets, tmp_path):
    from hpc_rl.agentic.gym_bridge import GymEpisode

    envs = tmp_path / "attack_envs"  # a user's own directory of Gym servers, outside the repository
    shutil.copytree(ATTACK, envs, ignore=shutil.ignore_patterns("__pycache__", "hpc_rl_attack"))
    (envs / "resources_servers" / "attack" / "targets.json").write_text(json.dumps(targets))
    path, tok, policy = _policy()
    episode = GymEpisode("attack", str(envs / "resources_servers" / "attack" / "data" / "train.jsonl"),
                         agent="attack_simple_agent", search_dirs=[str(envs)])
    with job_key_set():
        try:
            episode.start()
            batch = run_batch(episode, tok, [policy(), policy()])
        finally:
            episode.close()
    _stopped(batch)
    _no_plants(targets)

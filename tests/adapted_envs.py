"""Shared by tests/test_gym_bridge.py and tests/test_verifiers_bridge.py: the checks an adapted
library's environment (NeMo Gym, verifiers) must pass the same way, run against the real
library and a real tiny model by each module's `bridge` fixture."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

JOB_KEY = "f" * 64  # the job's secret as a rank holds it (HPC_RL_JOB_KEY): it must not reach the library


@contextlib.contextmanager
def job_key_set():
    """HPC_RL_JOB_KEY set as in an env rank, so a leak of it into the library's processes shows."""
    old = os.environ.get("HPC_RL_JOB_KEY")
    os.environ["HPC_RL_JOB_KEY"] = JOB_KEY
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HPC_RL_JOB_KEY", None)
        else:
            os.environ["HPC_RL_JOB_KEY"] = old


class Recorder:
    """The policy as the episode's chat calls it, recording each call's prompt and answer;
    `fail`: raise this instead (a dead endpoint)."""

    def __init__(self, inner, fail: Exception = None):
        self.inner, self.fail, self.calls = inner, fail, []

    async def __call__(self, prompt_ids, max_tokens):
        if self.fail is not None:
            raise self.fail
        out = await self.inner(prompt_ids, max_tokens)
        self.calls.append((list(prompt_ids), out))
        return out


def run_batch(episode, tok, policies, limits=None):
    """One episode per policy, items item-0..N-1 (the library's own task plays: the prompt is ignored)."""
    from hpc_rl.agentic.contract import Limits
    from hpc_rl.agentic.runner import run_episodes

    tasks = [{"prompt": "ignored: the library's task plays", "id": f"item-{i}"} for i in range(len(policies))]
    return asyncio.run(run_episodes(tasks, episode, policies, limits or Limits(max_turns=2, max_tokens=64), tok,
                                    max_inflight=len(policies)))


def check_a_failing_policy_call_is_the_episodes_error(episode, tok, model):
    from hpc_rl.agentic.local import HFPolicy

    policies = [Recorder(HFPolicy(model, tok, greedy=False), fail=ConnectionError("endpoint down") if i % 2 else None)
                for i in range(6)]
    m = run_batch(episode, tok, policies).metrics()
    assert m["episodes"] == 6 and m["errors"] == 3 and m["errors_by_kind"] == {"ConnectionError": 3}, m


def check_a_limit_reached_inside_the_library_truncates(episode, tok, model):
    from hpc_rl.agentic.contract import Limits
    from hpc_rl.agentic.local import HFPolicy

    batch = run_batch(episode, tok, [Recorder(HFPolicy(model, tok))], Limits(max_turns=2, max_tokens=10))  # prompt > 10
    rows, result = batch[0]
    assert result.truncated and result.info["truncated_by"] == "max_tokens" and batch.metrics()["errors"] == 0


def post(url: str, body: dict, key: str = None) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def check_the_proxy_needs_its_key(proxy, url: str, body: dict, library_pid: int) -> None:
    """No key, a wrong one and the job's own are refused (401, counted under the proxy's
    label); the proxy's key with no live episode is a 404; the library's process holds
    neither the job's key nor, on its command line, the proxy's."""
    from hpc_rl.runtime.auth_stats import process_counts

    assert proxy.host == "127.0.0.1"
    before = proxy.rejected
    assert post(url, body) == 401 and post(url, body, "0" * 64) == 401 and post(url, body, JOB_KEY) == 401
    assert proxy.rejected == before + 3
    assert process_counts()["rejected"].get(proxy.LABEL, 0) >= 3  # summary.json auth_rejected_by_kind in a run
    assert post(url, body, proxy.key) == 404  # the key, but no live episode of that token
    environ = Path(f"/proc/{library_pid}/environ").read_bytes()
    assert b"HPC_RL_JOB_KEY" not in environ and JOB_KEY.encode() not in environ
    assert proxy.key.encode() not in Path(f"/proc/{library_pid}/cmdline").read_bytes()

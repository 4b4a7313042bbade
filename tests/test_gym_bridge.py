"""The NeMo Gym bridge (hpc_rl/agentic/gym_bridge.py) with the real thing: nemo-gym 0.7.0
under its own interpreter (tests/gym_python.sh) running environments/gym's tiny_arith
resources server with Gym's own simple_agent and vllm_model, its model calls through the
loopback proxy into a real tiny model (tiny:student, Hugging Face, sampled). The 10-step
GRPO runs are bench/gym.py's.

A missing interpreter is built with tests/gym_python.sh (about 4.5 minutes and 1.7 GB;
debootstrap needs root once), by `make env-interpreters` (tests/env_interpreters.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from adapted_envs import (
    Recorder,
    check_a_failing_policy_call_is_the_episodes_error,
    check_a_limit_reached_inside_the_library_truncates,
    check_the_proxy_needs_its_key,
    job_key_set,
    run_batch,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bridge(env_interpreters_ready):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.agentic.environments import build_environment
    from hpc_rl.agentic.gym_bridge import GymEpisode
    from hpc_rl.config import load_config
    from hpc_rl.rl.inputs import resolve_model_ref
    from hpc_rl.roles.episode_runner import environment_kwargs

    path = resolve_model_ref("tiny:student")
    cfg = load_config(["+recipe=tiny_gym_grpo", f"model.path={path}"])
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    # built as an env rank builds it, from the recipe's env.agentic.gym section (these reads
    # are the evidence tests/test_config_keys.py needs that the section is honoured)
    episode = build_environment(cfg.env.agentic.environment, **environment_kwargs(cfg))
    assert isinstance(episode, GymEpisode) and episode.resources_server == "tiny_arith"
    with job_key_set():
        try:
            episode.start()
            yield episode, tok, model
        finally:
            episode.close()


def test_trajectories_are_the_tokens_the_policy_sampled_and_rewards_are_gyms_verify(bridge):
    from hpc_rl.agentic.local import HFPolicy

    episode, tok, model = bridge
    policies = [Recorder(HFPolicy(model, tok, greedy=False)) for _ in range(8)]
    batch = run_batch(episode, tok, policies)
    m = batch.metrics()
    assert m["episodes"] == 8 and m["errors"] == 0 and m["failed"] == 0, (m, batch.error_lines())
    assert m["changed_policy_tokens"] == 0
    for pol, (rows, result) in zip(policies, batch):
        assert len(pol.calls) == 1 and len(rows) == 1  # simple_agent, no tools: one turn
        (prompt, (ids, lps, *_)), row = pol.calls[0], rows[0]
        assert row.prompt_ids == prompt and row.response_ids == list(ids) and row.loss_mask == [1] * len(ids)
        assert row.logprobs == pytest.approx(list(lps), abs=0)
        # ... and Gym's agent carried the same ids and log-probs in its output (as NeMo RL reads them)
        (call,) = result.info["gym_token_calls"]
        assert call["prompt_token_ids"] == prompt and call["generation_token_ids"] == list(ids)
        assert call["generation_log_probs"] == pytest.approx(list(lps), abs=0)
        # the prompt is the model's own chat template over the Gym row's question
        question = re.fullmatch(r".*<\|user\|>(What is (\d) plus (\d)\?)<\|end\|><\|assistant\|>", tok.decode(prompt))
        assert question, tok.decode(prompt)
        assert prompt == list(tok.apply_chat_template([{"role": "user", "content": question.group(1)}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False))
        # Gym's /verify scored the text of those very tokens (tiny_arith: 1.0 exact, 0.1 one wrong integer)
        reply = tok.decode(ids, skip_special_tokens=True)
        ints = re.findall(r"-?\d+", reply)
        want = str(int(question.group(2)) + int(question.group(3)))
        expected = 1.0 if ints and ints[-1] == want else (0.1 if len(ints) == 1 and reply.strip() == ints[0] else 0.0)
        assert result.reward == pytest.approx(expected), (reply, result)
        assert result.correct == (expected == 1.0)
    # one group (one item id) plays one row: the same prompt
    same = [Recorder(HFPolicy(model, tok, greedy=False)) for _ in range(2)]
    from hpc_rl.agentic.contract import Limits
    from hpc_rl.agentic.runner import run_episodes

    asyncio.run(run_episodes([{"id": "item-3"}] * 2, episode, same, Limits(max_turns=2, max_tokens=64), tok, 2))
    assert same[0].calls[0][0] == same[1].calls[0][0] == policies[3].calls[0][0]


def test_a_rows_max_output_tokens_caps_the_turn(bridge):
    """A Gym row's max_output_tokens reaches the proxy as max_tokens: the turn's cap."""
    from hpc_rl.agentic.local import HFPolicy

    episode, tok, model = bridge
    rows = episode.rows
    episode.rows = [json.loads(json.dumps(r)) for r in rows]
    for r in episode.rows:
        r["responses_create_params"]["max_output_tokens"] = 2
    try:
        policies = [Recorder(HFPolicy(model, tok, greedy=False)) for _ in range(4)]
        batch = run_batch(episode, tok, policies)
    finally:
        episode.rows = rows
    assert batch.metrics()["errors"] == 0, batch.error_lines()
    assert all(len(p.calls) == 1 and len(p.calls[0][1][0]) <= 2 for p in policies)
    assert any(len(p.calls[0][1][0]) == 2 for p in policies)


def test_a_failing_policy_call_is_the_episodes_error_counted_by_kind(bridge):
    check_a_failing_policy_call_is_the_episodes_error(*bridge)


def test_a_limit_reached_inside_gym_truncates_the_episode(bridge):
    check_a_limit_reached_inside_the_library_truncates(*bridge)


def test_the_proxy_needs_its_key_gym_is_out_of_reach_and_never_holds_the_jobs_key(bridge):
    episode, _, _ = bridge
    body = {"model": "hpc_rl", "messages": [{"role": "user", "content": "hi"}], "metadata": {"hpc_rl_episode": "nobody"}}
    check_the_proxy_needs_its_key(episode.proxy, f"{episode.proxy.url}/chat/completions", body, episode.servers.proc.pid)
    # Gym's servers live in a network namespace of their own: none of their ports answers here,
    # only the unix socket in the rank's 0700 directory leads in
    for url in (episode.servers.agent_url, episode.servers.head):
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=10)
    assert json.loads(episode.servers.get(episode.servers.agent_url + "/")) == {"status": "ok"}
    cfg_dir = Path(episode.servers.dir)
    assert cfg_dir.stat().st_mode & 0o777 == 0o700 and (cfg_dir / "hpc_rl.yaml").stat().st_mode & 0o777 == 0o600


def test_the_launch_preflight_names_the_key_of_an_environment_gym_cannot_resolve(env_interpreters_ready):
    """Before anything is submitted (launchers/runnable.py, config/validate_agentic.py): the
    interpreter, the resources server and the dataset, each refused naming its key."""
    from hpc_rl.agentic.gym_bridge import preflight
    from hpc_rl.config import load_config
    from hpc_rl.config.errors import Violation
    from hpc_rl.config.validate_agentic import check_gym

    cfg = load_config(["+recipe=tiny_gym_grpo"])
    g = cfg.env.agentic.gym
    assert preflight(g) == []
    g.resources_server = "no_such_server"
    (v,) = preflight(g)
    assert v[0] == "env.agentic.gym.resources_server" and "tiny_arith" in v[2]  # it lists what Gym has
    g.resources_server, g.python, g.dataset = None, "/nonexistent/gym-python", "nope.jsonl"
    out: list = []
    check_gym(out, cfg)
    assert {x.key for x in out if isinstance(x, Violation)} == {"env.agentic.gym.resources_server",
                                                                 "env.agentic.gym.python", "env.agentic.gym.dataset"}


RANK = """
import sys
from hpc_rl.agentic.gym_bridge import Proxy
from hpc_rl.agentic.gym_servers import GymServers, search_dirs
g = GymServers(".gym-python/bin/gym-python", "tiny_arith", None, search_dirs(["environments/gym"]), [], Proxy("hpc_rl"), 300)
print(g.proc.pid, g.agent_url, g.dir, flush=True)
sys.stdin.read()
"""


def _descendants(pid: int) -> set:
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def test_gyms_processes_die_with_the_env_rank(env_interpreters_ready):
    """A process standing in for the env rank starts Gym (its only agent: env.agentic.gym.agent
    unset) and is SIGKILLed: every Gym process (bubblewrap, Gym's CLI, its servers, its Ray
    cluster) exits, by the parent-death signal and the pid namespace, with nobody's cleanup."""
    import select
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                            env=env, text=True)
    try:
        line = rank.stdout.readline().split()
        assert len(line) == 3 and line[1].startswith("http://127.0.0.1:"), line
        gym = _descendants(rank.pid)
        assert int(line[0]) in gym and len(gym) >= 5, gym  # bwrap, Gym's CLI, its servers, Ray
        fds = {p: os.pidfd_open(p) for p in gym if Path(f"/proc/{p}").exists()}
    finally:
        rank.kill()
        rank.wait()
    try:
        for p, fd in fds.items():  # a pidfd turns readable when its process exits: an event, not a poll
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready, f"Gym process {p} outlived its env rank: {Path(f'/proc/{p}/cmdline').read_bytes()[:200]!r}"
    finally:
        for fd in fds.values():
            os.close(fd)
    # the killed rank's directory (its proxy key died with it) is litter: the next rank on the
    # node removes it, and leaves a live rank's alone
    from hpc_rl.agentic.gym_servers import DIR_PREFIX
    from hpc_rl.envs.jail import JailDir, reap, start_time

    assert Path(line[2]).exists()
    live = Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir=JailDir.ROOT))  # as a rank alive now (this process) writes it
    (live / "owner").write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
    try:
        assert line[2] in reap(DIR_PREFIX) and not Path(line[2]).exists() and live.exists()
    finally:
        shutil.rmtree(live)

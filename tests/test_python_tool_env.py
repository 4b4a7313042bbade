"""The python_tool environment (hpc_rl/agentic/python_tool.py, issue #27): tool calls of
multi-turn episodes run in real bubblewrap sandboxes (hpc_rl/envs/sandbox.py) on the env
rank, bounded by the episode's deadline plus a scoring buffer, counted in the metrics, and a
rank reaps what an earlier incarnation left at its start.

Policies: the real tiny calculator student (tiny_agentic:student_calc_200, greedy), and a
scripted policy (named so: `ScriptedPolicy`) where a test needs one exact tool call. The
environment is built as an env rank builds it: from the recipe through
roles/episode_runner.environment_kwargs (the reads tests/test_config_keys.py counts).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from test_sandbox import _plant, _sleeping_tool, _until

from hpc_rl.agentic.contract import Limits
from hpc_rl.agentic.environments import build_environment
from hpc_rl.agentic.figures import finish_stats
from hpc_rl.agentic.python_tool import PythonToolEpisode, sandbox_tag
from hpc_rl.agentic.runner import run_episodes
from hpc_rl.data.tasks import calculator
from hpc_rl.envs.sandbox import find_sandbox_processes, reap_leftovers


def _tag() -> str:
    return f"test-pt-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def student():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.rl.inputs import resolve_model_ref

    path = resolve_model_ref("tiny_agentic:student_calc_200")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def recipe_episode():
    from hpc_rl.config import load_config
    from hpc_rl.roles.episode_runner import environment_kwargs

    cfg = load_config(["+recipe=tiny_python_tool_grpo"])
    tag = _tag()
    episode = build_environment(cfg.env.agentic.environment, **environment_kwargs(cfg, tag))
    assert isinstance(episode, PythonToolEpisode) and episode.tag == tag
    assert episode.sandbox.limits.wall_s == cfg.env.agentic.sandbox.wall_s
    yield episode, cfg
    episode.shutdown()
    reap_leftovers(tag)


class ScriptedPolicy:
    """Not a model: turn 1 writes `call` (a tool call), turn 2 answers with the last tool
    message it was shown (the text between the prompt's last <|tool|> and <|end|>), so the
    answer is right only if the tool's output came back into the policy's context."""

    def __init__(self, tok, call: str):
        self.tok, self.call, self.turn, self.seen = tok, call, 0, None

    async def __call__(self, prompt_ids, max_tokens):
        self.turn += 1
        if self.turn == 1:
            text = self.call
        else:
            prompt = self.tok.decode(prompt_ids)
            self.seen = prompt.rsplit("<|tool|>", 1)[-1].split("<|end|>", 1)[0]
            text = self.seen
        ids = self.tok(text, add_special_tokens=False)["input_ids"][:max_tokens - 1] + [self.tok.eos_token_id]
        return ids, [0.0] * len(ids), 0, 0, "stop"


def _episodes(tasks, episode, policy, tok, limits=None):
    limits = limits or Limits(max_turns=3, max_tokens=200, turn_timeout_s=30, episode_timeout_s=60)
    return asyncio.run(run_episodes(tasks, episode, policy, limits, tok, max_inflight=4))


def test_a_tool_call_runs_in_the_sandbox_and_its_output_returns_to_the_model(recipe_episode, student):
    from hpc_rl.agentic.local import HFPolicy

    episode, cfg = recipe_episode
    model, tok = student
    episode.take_stats()
    # a scripted call whose output only a sandbox of this rank's tag can print (its marker)
    task = {"prompt": "What is 6 times 7?", "answer": "42", "task": "calculator", "id": "x", "agent": None}
    code = "import os; print(os.environ['HPC_RL_SANDBOX'].split(':')[0], len(os.listdir('/tmp')), os.getuid())"
    pol = ScriptedPolicy(tok, f'[python(code="{code}")]')
    batch = _episodes([task], episode, pol, tok)
    assert pol.seen is not None and pol.seen.split()[0] == episode.tag, pol.seen  # the tool ran in our sandbox
    assert pol.seen.split()[1] == "0"  # a private, empty /tmp
    (rows, result), = list(batch)
    assert tok.decode(rows[-1].response_ids).count(episode.tag) == 2  # tool output, then the policy's copy
    # the real student: it calls the calculator, the sandbox evaluates it, the student copies it
    tasks = calculator(8, seed=3)
    batch = _episodes(tasks, episode, [HFPolicy(model, tok) for _ in tasks], tok)
    m = batch.metrics()
    stats = episode.take_stats()
    assert m["errors"] == 0 and m["episodes"] == 8, (m, batch.error_lines())
    assert stats["sandbox_calls"] >= 6 and stats["sandbox_timeouts"] == 0, stats
    assert m["accuracy"] >= 0.5, m  # the student scores 80% greedy with the in-process calculator
    for (rows, _), t in zip(batch, tasks):
        text = tok.decode(rows[-1].response_ids)
        if "[calculator(" in text:
            assert f"<|tool|>{t['answer']}<|end|>" in text, text  # the sandbox's answer, in the trajectory
    out = finish_stats(dict(episodes=8, **stats), 4, 0.25)
    assert out["sandbox_s_mean"] > 0 and "sandbox_s" not in out, out


def test_network_and_writes_outside_scratch_fail_inside_the_sandbox(recipe_episode, student):
    episode, _ = recipe_episode
    _, tok = student
    episode.take_stats()
    probes = {
        "net": "import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)",
        "etc": "open('/etc/hpc_rl_probe', 'w')",
        "home": "import os; open(os.path.expanduser('~root') + '/hpc_rl_probe', 'w')",
        "tmp": "open('/tmp/ok', 'w').write('x'); print(open('/tmp/ok').read())",
    }
    seen = {}
    for name, code in probes.items():
        pol = ScriptedPolicy(tok, f'[python(code="{code}")]')
        task = {"prompt": "What is 1 plus 1?", "answer": "2", "task": "calculator", "id": name, "agent": None}
        # room for a traceback: the home is not in the sandbox's view at all (FileNotFoundError)
        _episodes([task], episode, pol, tok, Limits(max_turns=3, max_tokens=400, turn_timeout_s=30, episode_timeout_s=60))
        seen[name] = pol.seen
    assert seen["net"].startswith("error: exit 1") and "unreachable" in seen["net"].lower(), seen
    assert "Read-only file system" in seen["etc"], seen
    assert "error: exit 1" in seen["home"], seen
    assert seen["tmp"] == "x", seen
    stats = episode.take_stats()
    assert stats["sandbox_calls"] == 4 and stats["sandbox_failures"] == 3 and stats["sandbox_timeouts"] == 0, stats


def test_a_tool_past_the_episode_deadline_plus_buffer_is_killed_and_counted(student):
    _, tok = student
    tag = _tag()
    deadline, buffer = 1.0, 0.5
    # wall_s far past the deadline: only the episode's deadline plus the buffer can end the call
    episode = PythonToolEpisode(tag=tag, episode_timeout_s=deadline, scoring_buffer_s=buffer, wall_s=20.0, cpu_s=20)
    try:
        pol = ScriptedPolicy(tok, '[python(code="import time; time.sleep(1000)")]')
        task = {"prompt": "What is 1 plus 1?", "answer": "2", "task": "calculator", "id": "s", "agent": None}
        limits = Limits(max_turns=3, max_tokens=200, turn_timeout_s=deadline, episode_timeout_s=deadline)
        t0 = time.monotonic()
        batch = _episodes([task], episode, pol, tok, limits)
        m = batch.metrics()
        assert m["timeouts"] == 1 and m["errors"] == 0, m  # the episode itself is cut at its deadline
        assert episode.settle() <= 1  # the round waits for the call, which ends at deadline + buffer
        took = time.monotonic() - t0
        stats = episode.take_stats()
        assert stats["sandbox_calls"] == 1 and stats["sandbox_timeouts"] == 1, stats
        assert deadline + buffer - 0.1 <= stats["sandbox_s"] <= deadline + buffer + 2.0, stats
        assert took <= deadline + buffer + 3.0, took
        assert find_sandbox_processes(tag) == []
        # a call past wall_s (within the deadline) is answered with a timeout the policy reads
        short = PythonToolEpisode(tag=_tag(), episode_timeout_s=30, scoring_buffer_s=1, wall_s=0.5, cpu_s=5)
        try:
            pol = ScriptedPolicy(tok, '[python(code="while True: pass")]')
            _episodes([task], short, pol, tok)
            assert pol.seen.startswith("error: timed out after"), pol.seen
            assert short.take_stats()["sandbox_timeouts"] == 1
        finally:
            short.shutdown()
    finally:
        episode.shutdown()
        reap_leftovers(tag)


def test_a_rank_reaps_what_its_previous_incarnation_left_at_its_start(tmp_path):
    """The env rank's EpisodeRunner, built as roles/env.py builds it (a real RankContext; the
    plan, store and process groups it does not touch at its start left None), tags its
    sandboxes with its job and rank and kills what an earlier incarnation left under them."""
    import logging

    from adapted_envs import job_key_set

    from hpc_rl.config import load_config
    from hpc_rl.envs.sandbox import Sandbox
    from hpc_rl.rl.inputs import resolve_model_ref
    from hpc_rl.roles.episode_runner import EpisodeRunner
    from hpc_rl.runtime.identity import RankIdentity
    from hpc_rl.runtime.worker import RankContext

    job = f"4242{uuid.uuid4().int % 10000}+0"
    tag = sandbox_tag(job, 1)
    assert tag == f"{job}.env1"
    old = Sandbox(tag)
    old.check()
    left = _plant(old, "999999999.0", ["sleep", "1000"])  # a previous incarnation's sandbox
    try:
        _until(lambda: _sleeping_tool(tag), 15, "the leftover running")
        cfg = load_config(["+recipe=tiny_python_tool_grpo", f"model.path={resolve_model_ref('tiny_agentic:student_calc_200')}"])
        ident = RankIdentity("env", 1, 2, 3, 4, 0, "local0", 1, job)
        ctx = RankContext(tmp_path, cfg, None, ident, None, None, "cpu", logging.getLogger("test"), {}, None)
        with job_key_set():
            runner = EpisodeRunner(ctx)  # the env rank's start
        try:
            assert runner.episode.tag == tag and left.pid in runner.episode.reaped, runner.episode.reaped
            assert left.wait(timeout=10) < 0
            _until(lambda: find_sandbox_processes(tag) == [], 10, "the leftover's namespace gone")
        finally:
            runner.shutdown()
    finally:
        left.kill()
        left.wait(timeout=10)
        reap_leftovers(tag)


def test_container_kinds_are_rendered_and_refused_here_naming_the_key_and_the_fix():
    from hpc_rl.config import ConfigError, load_config
    from hpc_rl.envs.container_sandbox import render

    for kind in ("apptainer", "enroot"):
        with pytest.raises(ConfigError) as err:
            load_config(["+recipe=tiny_python_tool_grpo", f"env.agentic.sandbox.kind={kind}"])
        text = str(err.value)
        assert f"env.agentic.sandbox.kind = '{kind}'" in text and "kind=bwrap" in text, text
        line = render(kind, "/images/tool.sif", ["python3", "-c", "print(1)"], "t:1.0")
        assert line[-3:] == ["python3", "-c", "print(1)"] and "HPC_RL_SANDBOX=t:1.0" in line, line
    assert {"--network", "none", "--containall", "--cleanenv"} <= set(render("apptainer", "x.sif", ["true"]))
    assert render("enroot", "c", ["true"])[:4] == ["unshare", "--user", "--map-current-user", "--net"]
    # a sandbox section on another environment is read by nobody: refused
    with pytest.raises(ConfigError, match="env.agentic.sandbox.wall_s"):
        load_config(["+recipe=tiny_agentic_grpo", "env.agentic.sandbox.wall_s=3"])

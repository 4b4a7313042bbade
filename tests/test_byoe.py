"""Bring your own environment (issue 48, docs/byoe.md): a user's tool-using verifiers taskset,
written outside the repository with verifiers' public API only (tests/byoe_envs.py), installed
into .venv-verifiers as the docs say, runs by configuration alone: the preflight (before
submission) loads it, builds its renderer, starts its tool server and calls its tool; a planted
broken tool fails the launch before anything is submitted, naming the tool; 2 GRPO steps run
with the tool calls parsed and executed (counted per step), 0 environment errors, 0 changed
policy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-verifiers"
# the tiny tool-using model writes `[calculator(expression="37*58")]`; lengths that hold a tool episode
RUN = ["+recipe=tiny_verifiers_grpo", "model.path=tiny_agentic:teacher_calc", "env.agentic.verifiers.taskset=vf-calc",
       "env.agentic.verifiers.taskset_args={num_tasks: '64'}", "env.agentic.max_turns=3", "env.agentic.max_tokens=256",
       "generator.sampling.max_tokens=48", "generator.max_model_len=256", "trainer.max_seq_len=256",
       "algo.prompts_per_step=4", "algo.generations_per_prompt=4", "trainer.global_batch_size=16",
       "trainer.micro_batch_size=16", "data.samples_per_task=64", "data.eval_prompts_per_task=4",
       "checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def user_taskset(env_interpreters_ready, tmp_path_factory):
    from byoe_envs import write_verifiers_taskset

    pkg = write_verifiers_taskset(tmp_path_factory.mktemp("user_env"))
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e",
           str(pkg)]
    subprocess.run(pip, check=True, capture_output=True, text=True, timeout=300)
    try:
        yield pkg
    finally:
        subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "-y", "vf-calc"],
                       capture_output=True, timeout=300)


def launch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "hpc_rl.launch", *RUN, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ))


def test_a_planted_broken_tool_fails_before_submission_naming_it(user_taskset, tmp_path):
    run = tmp_path / "run"
    proc = launch(f"run.dir={run}", "env.agentic.verifiers.taskset_args={num_tasks: '64', broken_tool: 'true'}",
                  timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "tool server CalcTools, tool 'calculator': raised RuntimeError: planted: this tool is broken" in out, out[-3000:]
    assert "env.agentic.verifiers.taskset" in out
    assert not (run / "metrics.jsonl").exists()  # nothing ran


def test_a_renderer_without_tool_calls_is_refused_naming_the_fix(user_taskset, tmp_path):
    proc = launch(f"run.dir={tmp_path / 'run'}", "env.agentic.verifiers.renderer=default", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "env.agentic.verifiers.renderer" in out, out[-3000:]
    assert "DefaultRenderer reads no tool calls" in out and "`pythonic`" in out, out[-3000:]


def test_two_grpo_steps_with_the_users_tool_taskset(user_taskset, tmp_path):
    run = tmp_path / "run"
    proc = launch(f"run.dir={run}", "run.max_steps=2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        a = s["agentic"]
        assert a["episodes"] == 16 and a["errors"] == 0 and a["failed"] == 0, a
        assert a["tool_calls"] > 0 and a["tool_errors"] == 0, a  # parsed by the renderer, run by the tool server
        assert a["changed_policy_tokens"] == 0, a
        assert a["env_tokens"] > 0, a  # the tool's answers sit inside the trajectories

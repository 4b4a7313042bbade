"""The verifiers bridge (hpc_rl/agentic/verifiers_bridge.py) with the real thing: verifiers
0.4.0 in .venv-verifiers running environments/tiny_arith (SingleAgentEnv, null harness,
subprocess runtime), its model calls through the loopback proxy into a real tiny model
(tiny:student, Hugging Face, sampled). Seconds, not minutes: the 10-step GRPO runs, locally
and as a het job, are bench/verifiers.py's.

A missing virtualenv is built with `make env-interpreters` (tests/env_interpreters.py).
"""

from __future__ import annotations

import asyncio
import re
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
    from hpc_rl.agentic.verifiers_bridge import VerifiersEpisode
    from hpc_rl.config import load_config
    from hpc_rl.rl.inputs import resolve_model_ref
    from hpc_rl.roles.episode_runner import environment_kwargs

    path = resolve_model_ref("tiny:student")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    # built as an env rank builds it, from the recipe's env.agentic.verifiers section (these
    # reads are the evidence tests/test_config_keys.py needs that the section is honoured)
    cfg = load_config(["+recipe=tiny_verifiers_grpo", f"model.path={path}",
                       "env.agentic.verifiers.taskset_args={num_tasks: '64', operation: plus, high: '9'}"])
    episode = build_environment(cfg.env.agentic.environment, **environment_kwargs(cfg))
    assert isinstance(episode, VerifiersEpisode) and episode.taskset == "tiny-arith"
    with job_key_set():
        try:
            episode.start()
            yield episode, tok, model
        finally:
            episode.close()


def test_trajectories_are_the_tokens_the_policy_sampled_and_rewards_are_the_rubrics(bridge):
    from hpc_rl.agentic.local import HFPolicy

    episode, tok, model = bridge
    policies = [Recorder(HFPolicy(model, tok, greedy=False)) for _ in range(8)]
    batch = run_batch(episode, tok, policies)
    m = batch.metrics()
    assert m["episodes"] == 8 and m["errors"] == 0 and m["failed"] == 0, m
    assert m["changed_policy_tokens"] == 0
    for pol, (rows, result) in zip(policies, batch):
        assert len(pol.calls) == 1 and len(rows) == 1  # null harness, no tools: one turn
        (prompt, (ids, lps, *_)), row = pol.calls[0], rows[0]
        # the prompt verifiers rendered is the row's prompt; the response is the engine's ids verbatim
        assert row.prompt_ids == prompt and row.response_ids == list(ids) and row.loss_mask == [1] * len(ids)
        assert row.logprobs == pytest.approx(list(lps), abs=0)
        # ... and exactly what the model's own chat template renders for tiny-arith's question
        question = re.fullmatch(r".*<\|user\|>(What is \d+ plus \d+\?)<\|end\|><\|assistant\|>", tok.decode(prompt))
        assert question, tok.decode(prompt)
        assert prompt == list(tok.apply_chat_template([{"role": "user", "content": question.group(1)}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False))
        # tiny-arith's rubric: correct (1.0) + one integer (0.1), computed by verifiers from the same tokens
        reply = tok.decode(ids, skip_special_tokens=True).strip()
        rewards = result.info["verifiers_rewards"]
        assert rewards["one_integer"] == float(reply.lstrip("+-").isdigit()), (reply, rewards)
        assert result.reward == pytest.approx(rewards["correct"] + 0.1 * rewards["one_integer"])
        assert result.correct == (rewards["correct"] == 1.0 and rewards["one_integer"] == 1.0)
    # one group (one item id) plays one task: the same prompt
    same = [Recorder(HFPolicy(model, tok, greedy=False)) for _ in range(2)]
    from hpc_rl.agentic.contract import Limits
    from hpc_rl.agentic.runner import run_episodes

    asyncio.run(run_episodes([{"id": "item-3"}] * 2, episode, same, Limits(max_turns=2, max_tokens=64), tok, 2))
    assert same[0].calls[0][0] == same[1].calls[0][0] == policies[3].calls[0][0]


def test_a_failing_policy_call_is_the_episodes_error_counted_by_kind(bridge):
    check_a_failing_policy_call_is_the_episodes_error(*bridge)


def test_a_limit_reached_inside_verifiers_truncates_the_episode(bridge):
    check_a_limit_reached_inside_the_library_truncates(*bridge)


def test_the_proxy_needs_its_key_listens_on_loopback_and_the_worker_never_holds_the_jobs_key(bridge):
    episode, _, _ = bridge
    body = {"model": "hpc_rl", "token_ids": [1, 2, 3], "sampling_params": {"hpc_rl_episode": "nobody"}}
    check_the_proxy_needs_its_key(episode.proxy, f"{episode.proxy.url}/inference/v1/generate", body,
                                  episode.worker.proc.pid)

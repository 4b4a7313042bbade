"""Bad rewards and bad rows at the trust boundary (issue #43).

- A reward that is not a finite number within +-REWARD_BOUND (NaN, inf, "abc", None, a list,
  1e9), from any environment, is its episode's error: scored 0, counted by kind
  (NonFiniteReward / NonNumericReward / RewardOutOfBounds) and logged once per kind; never a
  crash, never a NaN for the trainer. Before the fix NaN passed straight through and "abc"
  raised out of float() in StepwiseEpisode (a ValueError nobody could tell from a bug).
- On the single-turn path (roles/env.py `verify`) a row whose scoring fails scores 0 and is
  counted; the rank goes on.
- Rows whose task has no verifier, or whose answer the verifier cannot read, are refused at
  load, naming the file, the rows and the fix, before anything is submitted.
"""

from __future__ import annotations

import asyncio
import logging
import math
from decimal import Decimal
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hpc_rl.agentic.contract import EpisodeResult, Limits, SingleTurnEpisode, StepwiseEpisode
from hpc_rl.agentic.faults import ErrorLog
from hpc_rl.agentic.runner import run_episodes
from hpc_rl.data.dataset import PromptRecord
from hpc_rl.envs.math_verifier import VerifierResult
from hpc_rl.envs.registry import VERIFIERS
from hpc_rl.envs.reward_check import REWARD_BOUND, NonFiniteReward, NonNumericReward, RewardOutOfBounds, checked_reward
from hpc_rl.envs.rows import row_problems
from hpc_rl.roles.env import ScoringErrors, verify

NAN, INF = float("nan"), float("inf")
BAD = [(NAN, "NonFiniteReward"), (INF, "NonFiniteReward"), (-INF, "NonFiniteReward"), ("abc", "NonNumericReward"),
       (None, "NonNumericReward"), ([1.0], "NonNumericReward"), ("1.0", "NonNumericReward"),
       (np.array([1.0, 2.0]), "NonNumericReward"), (Decimal("NaN"), "NonFiniteReward"), (1e9, "RewardOutOfBounds"),
       (10 ** 400, "RewardOutOfBounds"), (complex(1, 0), "NonNumericReward"), (object(), "NonNumericReward")]
GOOD = [(1, 1.0), (0.5, 0.5), (True, 1.0), (False, 0.0), (np.float32(0.25), 0.25), (np.bool_(True), 1.0),
        (torch.tensor(-1.0), -1.0), (-REWARD_BOUND, -REWARD_BOUND)]


@pytest.mark.parametrize("value,kind", BAD, ids=[repr(v)[:20] for v, _ in BAD])
def test_a_bad_reward_is_refused_by_kind(value, kind):
    with pytest.raises((NonFiniteReward, NonNumericReward, RewardOutOfBounds)) as err:
        checked_reward(value, "the test env")
    assert type(err.value).__name__ == kind and "the test env returned reward" in str(err.value)
    assert len(str(err.value)) < 200  # a bounded repr: a huge value never floods the log


@pytest.mark.parametrize("value,expected", GOOD, ids=[repr(v)[:20] for v, _ in GOOD])
def test_a_good_reward_is_a_plain_float(value, expected):
    out = checked_reward(value)
    assert type(out) is float and out == expected


class _ReturnsReward:
    """An Episode (no policy call) that returns the task's reward as its result."""

    async def run(self, task, chat):
        return EpisodeResult(task["reward"], True)


class _StepsToReward:
    """A step-wise env whose first step ends the episode with the task's reward, untouched."""

    def __init__(self):
        self.reward = None

    def reset(self, task):
        self.reward = task["reward"]
        return []

    def step(self, message):
        return [], True, self.reward, True


class _NoChat:
    """StepwiseEpisode asks the chat once: a stand-in that answers without a model."""

    turn_timeout_s = 5.0


async def _no_policy(prompt_ids, max_tokens):
    raise AssertionError("these episodes never call the policy")


def _batch(episode, rewards):
    tasks = [{"reward": r, "prompt": "p", "answer": "1", "task": "t", "id": str(i)} for i, r in enumerate(rewards)]
    return asyncio.run(run_episodes(tasks, episode, _no_policy, Limits(), None, max_inflight=4))


def test_bad_rewards_from_an_episode_are_errors_counted_by_kind_and_never_reach_the_trainer(caplog):
    rewards = [v for v, _ in BAD] + [1.0, 0.0]
    batch = _batch(_ReturnsReward(), rewards)
    results = [r for _, r in batch]
    for r, (_, kind) in zip(results, BAD):
        assert r.reward == 0.0 and r.info["error_kind"] == kind and r.correct is False
        assert "_ReturnsReward.run returned reward" in r.info["error"]
    assert [r.reward for r in results[-2:]] == [1.0, 0.0] and all("error" not in r.info for r in results[-2:])
    assert all(isinstance(r.reward, float) and math.isfinite(r.reward) for r in results)
    m = batch.metrics()
    expected = {}
    for _, kind in BAD:
        expected[kind] = expected.get(kind, 0) + 1
    assert m["errors"] == len(BAD) and m["errors_by_kind"] == expected and m["failed"] == len(BAD)
    assert math.isfinite(m["mean_reward"])
    # the env rank's log names each kind once (roles/episode_runner.py runs this per round)
    log = logging.getLogger("test_reward_errors")
    with caplog.at_level(logging.WARNING, logger="test_reward_errors"):
        assert ErrorLog(log, "nan_env").note(batch.error_lines(), m["errors_by_kind"], 7) == 3
    text = caplog.text
    for kind in expected:
        assert f"environment nan_env: an episode raised {kind} ({expected[kind]} of this round, step 7" in text
    assert "returned reward float nan: not finite" in text


def test_a_stepwise_environments_bad_reward_is_named_by_kind_not_a_valueerror():
    class Chat(_NoChat):
        async def __call__(self, messages, tools=None):
            return {"role": "assistant", "content": "1", "tool_calls": []}

    for value, kind in BAD:
        with pytest.raises((NonFiniteReward, NonNumericReward, RewardOutOfBounds)) as err:
            asyncio.run(StepwiseEpisode(_StepsToReward).run({"reward": value}, Chat()))
        assert type(err.value).__name__ == kind and "_StepsToReward.step returned reward" in str(err.value)


def test_a_verifier_that_fails_is_the_single_turn_episodes_error_under_its_own_kind(monkeypatch):
    def nan_verifier(response, answer):
        return VerifierResult(True, NAN, response)

    def deep_verifier(response, answer):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(VERIFIERS, "nan_task", nan_verifier)
    monkeypatch.setitem(VERIFIERS, "deep_task", deep_verifier)

    class Chat(_NoChat):
        async def __call__(self, messages, tools=None):
            return {"role": "assistant", "content": "42", "tool_calls": []}

    class OneTurn(SingleTurnEpisode):
        async def run(self, task, chat):
            return await super().run(task, Chat())

    tasks = [{"prompt": "p", "answer": "42", "task": t, "id": t} for t in ("nan_task", "deep_task", "math")]
    batch = asyncio.run(run_episodes(tasks, OneTurn(), _no_policy, Limits(), None, max_inflight=2))
    (_, nan), (_, deep), (_, ok) = list(batch)
    assert (nan.reward, nan.info["error_kind"]) == (0.0, "NonFiniteReward")
    assert (deep.reward, deep.info["error_kind"]) == (0.0, "RecursionError")
    assert "test_reward_errors.py" in deep.info["error"]  # the reason carries the verifier's own line
    assert (ok.reward, ok.correct, "error" in ok.info) == (1.0, True, False)


def test_single_turn_verify_scores_a_failing_row_zero_counts_it_and_goes_on(monkeypatch, caplog):
    monkeypatch.setitem(VERIFIERS, "nan_task", lambda response, answer: VerifierResult(True, NAN, response))
    monkeypatch.setitem(VERIFIERS, "text_task", lambda response, answer: VerifierResult(True, "1.0", response))

    def raising(response, answer):
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    monkeypatch.setitem(VERIFIERS, "raising_task", raising)
    rows = [("nan_task", "1"), ("raising_task", "9" * 5000), ("no_such_task", "x"), ("math", "The answer is 42"),
            ("nan_task", "2"), ("calculator", "9" * 100_000), ("text_task", "1")]
    items = [(i, PromptRecord("p", "a", "42", task, f"row{i}"), SimpleNamespace(text=text)) for i, (task, text) in enumerate(rows)]
    errors = ScoringErrors(logging.getLogger("test_reward_errors.env"))
    with caplog.at_level(logging.WARNING, logger="test_reward_errors.env"):
        out = verify(items, errors, step=3)
    assert out == [(0, 0.0, False), (1, 0.0, False), (2, 0.0, False), (3, 1.0, True), (4, 0.0, False), (5, 0.0, False),
                   (6, 0.0, False)]
    assert all(type(r) is float for _, r, _ in out)
    assert errors.by_kind == {"NonFiniteReward": 2, "ValueError": 1, "UnknownTaskError": 1, "NonNumericReward": 1}
    assert errors.total == 5
    assert caplog.text.count("failed with NonFiniteReward") == 1  # once per kind, with the first row
    assert "scoring row row0 (task 'nan_task', step 3) failed with NonFiniteReward" in caplog.text
    assert "row2 (task 'no_such_task'" in caplog.text and "row1 (task 'raising_task'" in caplog.text


def _rec(i, task, answer):
    return PromptRecord(f"prompt {i}", "agent", answer, task, f"id-{i}")


def test_rows_without_a_verifier_or_with_an_unreadable_answer_are_named_with_the_fix():
    records = [_rec(0, "addition", "3"), _rec(1, "poetry", "red"), _rec(2, "calculator", "forty-two"),
               _rec(3, "reverse", "'.'"), _rec(4, "math", None), _rec(5, None, None), _rec(6, "math", "\\frac{3}{4}"),
               _rec(7, "math", "{" * 20 + "1" + "}" * 20), _rec(8, "calculator", "-0042"), _rec(9, "math", "  ")]
    records += [_rec(10 + i, "poetry", "x") for i in range(6)]
    problems = row_problems(records, "data/train.jsonl")
    text = "\n".join(f"{p} | fix: {f}" for p, f in problems)
    assert len(problems) == 6, text
    unknown = next(p for p, _ in problems if "poetry" in p)
    assert unknown.startswith("data/train.jsonl: row 2 (id 'id-1'), row 11 (id 'id-10')") and "and 2 more" in unknown
    assert "which has no verifier (known tasks: addition, calculator, math, multiplication, reverse)" in unknown
    assert "row 3 (id 'id-2'), task 'calculator': the answer is not one integer" in text
    assert "row 4 (id 'id-3'), task 'reverse': the answer is empty" in text
    assert "row 5 (id 'id-4'), task 'math': the answer is missing: the verifier has nothing to compare with" in text
    assert "row 8 (id 'id-7'), task 'math': the answer nests brackets deeper than 12" in text
    assert "row 10 (id 'id-9'), task 'math': the answer is empty" in text
    assert "id-0'" not in text and "id-5'" not in text and "id-6'" not in text and "id-8'" not in text
    assert "register a verifier for it (hpc_rl.envs.registry.register)" in text and "fix those rows' answers" in text
    assert row_problems([_rec(0, "addition", "3"), _rec(1, None, None)], None) == []


def test_a_launch_with_such_rows_is_refused_before_anything_starts(tmp_path, capsys):
    """Through the launcher: ConfigError (exit 2), the file and the rows named, no run directory."""
    from test_rl_inputs import _launch, _overrides

    from hpc_rl.data.tasks import mixed, write_jsonl
    from hpc_rl.models.assets import ModelSpec, save_untrained

    model = save_untrained(tmp_path / "m", ModelSpec(hidden=32, intermediate=64, layers=1, heads=1, max_positions=64))
    rows = mixed(2, tasks=("addition_1digit",)) + [{"prompt": "Write a poem", "agent": "add_agent", "task": "poetry",
                                                     "answer": "roses", "id": "poem-1"}]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    code, text = _launch(capsys, _overrides(model, tmp_path, f"data.path={data}"))
    assert code == 2, text
    assert f"{data}: row 3 (id 'poem-1') name task 'poetry', which has no verifier" in text
    assert "hpc_rl.envs.registry.register" in text
    assert not (tmp_path / "run").exists()

"""Shared pieces of the agentic tests (tests/test_agentic_*.py; no tests of its own, named so
to stay with them): small environments, a policy recorder, and the independent checks of a
token-exact trajectory."""

from __future__ import annotations

import asyncio
from typing import List

import torch

from hpc_rl.agentic.contract import EpisodeResult


class ChatterEnv:
    """Goes on for `turns` policy turns whatever the policy says (a user message after each),
    then ends with reward 1: a multi-turn conversation any model can hold."""

    def __init__(self, turns: int = 3):
        self.turns, self.k = turns, 0

    async def reset(self, task):
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, msg):
        self.k += 1
        if self.k >= self.turns:
            return [], True, 1.0, True
        return [{"role": "user", "content": f"And then {self.k}?"}], False, 0.0, None


class CompactingEpisode:
    """Rewrites its history after the first turn (keeps a summary of it instead of the
    exchange), as a context-compacting agent does: the second turn's rendering is not an
    extension of the first's."""

    async def run(self, task, chat):
        first = [{"role": "user", "content": task["prompt"]}]
        await chat(first)
        compacted = [{"role": "user", "content": "Summary: asked once. " + task["prompt"]}]
        reply = await chat(compacted)
        await chat(compacted + [reply, {"role": "user", "content": "Again?"}])
        return EpisodeResult(1.0, True)


class Recorder:
    """Wraps a policy and keeps every call's prompt ids and answer, as the policy saw them."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    async def __call__(self, prompt_ids, max_tokens):
        out = await self.policy(prompt_ids, max_tokens)
        self.calls.append((list(prompt_ids), list(out[0]), list(out[1])))
        return out


def check_token_exact(row, calls) -> None:
    """The calls that made `row` (in order): each call's prompt is a prefix of the row's full
    ids, its generated ids follow the prompt verbatim, the row ends with the last call's ids,
    and the loss mask is 1 on exactly those ids."""
    full = row.prompt_ids + row.response_ids
    p = len(row.prompt_ids)
    assert full[:p] == calls[0][0][:p] and len(calls[0][0]) == p
    policy_positions = set()
    for prompt, ids, _ in calls:
        assert full[:len(prompt)] == prompt, "a turn's prompt is not a prefix of the final sample"
        assert full[len(prompt):len(prompt) + len(ids)] == ids, "a turn's generated ids changed"
        policy_positions.update(range(len(prompt) - p, len(prompt) - p + len(ids)))
    last_prompt, last_ids, _ = calls[-1]
    assert full == last_prompt + last_ids
    assert {i for i, m in enumerate(row.loss_mask) if m} == policy_positions
    assert all(v == -1 for v, m in zip(row.token_versions, row.loss_mask) if not m)
    assert all(lp == 0.0 for lp, m in zip(row.logprobs, row.loss_mask) if not m)
    assert row.turns == len(calls)


@torch.no_grad()
def hf_logprobs(model, row) -> List[float]:
    """A Hugging Face forward of the row's stored ids: each response token's logprob."""
    full = torch.tensor([row.prompt_ids + row.response_ids])
    logits = model(full).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, full[0, 1:, None])[:, 0]
    return lp[len(row.prompt_ids) - 1:].tolist()


def run(coro):
    return asyncio.run(coro)

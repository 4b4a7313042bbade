"""Environments the tests load by `env.agentic.environment=agentic_envs:<factory>` (the
tests directory on the env ranks' PYTHONPATH): what a user's own environment looks like.

`compacting_calculator`: the calculator task, then, for about half of the episodes (by the
parity of the prompt's characters: deterministic), a follow-up question on a compacted history, as an agent
that summarises its context would. The compacted history is not a prefix of what the policy
saw, so the trajectory so far (prompt, tool call, tool answer, answer: a multi-turn sample)
closes as a sibling and the follow-up is a sample of its own (rl/siblings.py).
"""

from hpc_rl.agentic.calculator import CalculatorEnv
from hpc_rl.agentic.contract import EpisodeResult


async def _calculator_episode(task, chat, env):
    """The calculator's turns until it is done: (last policy message, reward, correct)."""
    messages = await env.reset(task)
    while True:
        msg = await chat(messages, tools=env.tools)
        messages.append(msg)
        new, done, reward, correct = await env.step(msg)
        if done:
            return msg, reward, correct
        messages.extend(new)


class CompactingCalculator:
    async def run(self, task, chat):
        env = CalculatorEnv()
        msg, reward, correct = await _calculator_episode(task, chat, env)
        if sum(map(ord, task["prompt"])) % 2 == 0:
            summary = f"{task['prompt']} The answer was {msg.get('content', '')}. Say it again."
            await chat([{"role": "user", "content": summary}], tools=env.tools)
        return EpisodeResult(float(reward), correct)


def compacting_calculator(**cfg):
    return CompactingCalculator()


# --- faulty environments (tests/test_agentic_faults.py) ---------------------------------------
def fault_of(prompt: str):
    """Which fault an episode of `prompt` meets, by the parity of its characters mod 8
    (deterministic, about a quarter of the prompts): 'raise', 'hang' or None."""
    return {6: "raise", 5: "hang"}.get(sum(map(ord, prompt)) % 8)


class FaultyCalculator:
    """The calculator, with the faults of a real environment: for some prompts (fault_of) its
    reset raises (a bug, a refused request) or never returns (a hung tool service), before
    the policy's first turn so that no policy latency changes which. With
    `healthy_episodes`, every episode after that many in this process raises
    ConnectionError: the service behind the tool went down for good."""

    def __init__(self, healthy_episodes=None):
        self.healthy_episodes, self.started = healthy_episodes, 0

    async def run(self, task, chat):
        import asyncio

        self.started += 1
        if self.healthy_episodes is not None and self.started > self.healthy_episodes:
            raise ConnectionError("the calculator service is down")
        fault = fault_of(task["prompt"])
        if fault == "raise":
            raise ValueError(f"the calculator refused {task['prompt']!r}")
        if fault == "hang":
            await asyncio.Event().wait()  # nobody sets it: only the episode's deadline ends this
        _, reward, correct = await _calculator_episode(task, chat, CalculatorEnv())
        return EpisodeResult(float(reward), correct)


def faulty_calculator(**cfg):
    return FaultyCalculator()


def faulty_calculator_down_after_16(**cfg):
    """Healthy for 16 episodes per process (one step of the requeue drill), then down."""
    return FaultyCalculator(healthy_episodes=16)


# --- rewards that are not numbers (issue 43): tests/test_agentic_faults.py's requeue drill ----
def nan_of(prompt: str) -> bool:
    """Whether an episode of `prompt` returns a NaN reward: the parity of its characters mod 8
    is 4 (deterministic, about an eighth of the prompts, none of fault_of's)."""
    return sum(map(ord, prompt)) % 8 == 4


class NaNRewardCalculator(FaultyCalculator):
    """FaultyCalculator whose reward service is broken too: for nan_of prompts the episode plays
    out and returns NaN; with `healthy_episodes`, every episode after that many returns NaN
    (the service broke for good) instead of raising. A NaN that reached the trainer would make
    every weight NaN (the loss, the gradient clip, AdamW)."""

    async def run(self, task, chat):
        if self.healthy_episodes is not None and self.started >= self.healthy_episodes:
            self.started += 1
            return EpisodeResult(float("nan"), False)
        result = await super().run(task, chat)
        return EpisodeResult(float("nan"), False) if nan_of(task["prompt"]) else result


def nan_rewards_calculator_down_after_16(**cfg):
    """Healthy for 16 episodes per process (one step of the requeue drill), NaN after."""
    return NaNRewardCalculator(healthy_episodes=16)

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


class CompactingCalculator:
    async def run(self, task, chat):
        env = CalculatorEnv()
        messages = await env.reset(task)
        while True:
            msg = await chat(messages, tools=env.tools)
            messages.append(msg)
            new, done, reward, correct = await env.step(msg)
            if done:
                break
            messages.extend(new)
        if sum(map(ord, task["prompt"])) % 2 == 0:
            summary = f"{task['prompt']} The answer was {msg.get('content', '')}. Say it again."
            await chat([{"role": "user", "content": summary}], tools=env.tools)
        return EpisodeResult(float(reward), correct)


def compacting_calculator(**cfg):
    return CompactingCalculator()

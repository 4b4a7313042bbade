"""The chat an episode talks through: OpenAI-shaped messages in, the policy's assistant
message out, every token recorded in a TokenHistory on the way.

The episode keeps its own message list and passes all of it each call, as with an OpenAI
client. The assistant messages this chat returned are recognised in that list and rendered
as what the policy actually wrote (content = the decoded generation), so the rendering of
the conversation so far matches the ids the history holds; anything the episode changed
(or a message the chat never returned) is rendered as given, and a history that no longer
matches becomes a sibling sample (history.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import List, Optional

from .contract import Limits, Policy, Truncated
from .history import TokenHistory
from .tools import parse_tool_calls, tool_parser


class RecordingChat:
    def __init__(self, policy: Policy, tokenizer, limits: Limits = Limits(), tool_parser_name: str = "pythonic",
                 template_kwargs: Optional[dict] = None):
        self.policy = policy
        self.tok = tokenizer
        self.limits = limits
        self.turn_timeout_s = limits.turn_timeout_s
        self.tool_parser_name = tool_parser_name
        self.history = TokenHistory(tokenizer, template_kwargs)
        self.turns = 0
        self.tool_parse_errors = 0  # turns that opened a tool call the parser could not read
        self.tool_calls = 0  # tool calls parsed from the policy's turns
        self.hit_token_cap = False  # a turn was cut off by the trajectory's max_tokens
        self._returned: List[tuple] = []  # (the message as returned, the message as generated)
        self._turn_end: Optional[float] = None  # when the policy's last turn came back
        self._env_s: List[float] = []  # the environment's seconds after each policy turn

    def _mark_env(self, now: float) -> None:
        if self._turn_end is not None:
            self._env_s.append(now - self._turn_end)
            self._turn_end = None

    def env_seconds(self, end: float) -> List[float]:
        """The environment's time after each policy turn (its tool calls, its step), up to the
        next policy request or `end` (the episode's end): the episode's tool latencies."""
        self._mark_env(end)
        return list(self._env_s)

    def _as_generated(self, m: dict) -> dict:
        for returned, generated in self._returned:
            if m == returned:
                return generated
        return m

    async def __call__(self, messages: List[dict], tools: Optional[list] = None, max_tokens: Optional[int] = None) -> dict:
        """The policy's next assistant message. `max_tokens`: a client's cap on this turn (an
        adapted library's request), within the trajectory's budget."""
        turn = self.turns
        gen_ids = (await self._turn(lambda: self.history.prompt([self._as_generated(m) for m in messages], tools),
                                    max_tokens))[0]
        text = self.tok.decode(list(gen_ids), skip_special_tokens=True)
        generated = {"role": "assistant", "content": text}
        content, calls = text, []
        if tools:  # as vLLM's server: calls are parsed only when the request offered tools
            content, calls, malformed = parse_tool_calls(tool_parser(self.tool_parser_name, self.tok), text, turn,
                                                         self.tool_parser_name)
            self.tool_parse_errors += malformed
            self.tool_calls += len(calls)
        msg = {"role": "assistant", "content": content, "tool_calls": calls}
        # compared by value with a copy: an episode that edits the message afterwards gets it
        # rendered as edited (and, as it no longer matches the ids, a sibling sample)
        self._returned.append((copy.deepcopy(msg), generated))
        self._turn_end = time.perf_counter()
        return msg

    async def tokens(self, prompt_ids: List[int], max_tokens: Optional[int] = None) -> tuple:
        """A policy call for a client that renders its own prompts (verifiers' renderer):
        the prompt as token ids, recorded by `TokenHistory.prompt_ids` (a prefix of what the
        history holds extends it; anything else is a sibling), under the same limits as a
        chat turn. `max_tokens`: the client's cap, within the trajectory's budget. Returns
        what the policy returned: (ids, logprobs, version_first, version_last, finish)."""
        out = await self._turn(lambda: self.history.prompt_ids(prompt_ids), max_tokens)
        self._turn_end = time.perf_counter()
        return tuple(out[:5])

    async def _turn(self, record_prompt, max_tokens: Optional[int]) -> tuple:
        """One policy call under the limits, for both routes: `record_prompt()` records the
        turn's prompt in the history and returns its ids; the generated ids go into the
        history verbatim. Returns what the policy returned."""
        lim = self.limits
        self._mark_env(time.perf_counter())
        if self.turns >= lim.max_turns:
            raise Truncated("max_turns")
        ids = record_prompt()
        budget = lim.max_tokens - len(ids)
        if budget <= 0:
            raise Truncated("max_tokens")
        n = min(budget, lim.max_tokens_per_turn or budget, max_tokens or budget)
        try:
            # a copy: the policy (a client, an engine) must not be able to alias the record
            out = await asyncio.wait_for(self.policy(list(ids), n), lim.turn_timeout_s)
        except asyncio.TimeoutError:
            raise Truncated("turn_timeout") from None
        gen_ids, logprobs, v_first, v_last, finish = out[:5]
        self.history.add_policy(gen_ids, logprobs, v_first, v_last, finish, out[5] if len(out) > 5 else None)
        self.turns += 1
        if finish == "length" and n == budget:
            self.hit_token_cap = True
        return out

    async def chat(self, messages: List[dict], tools: Optional[list] = None) -> dict:
        """The same call as `await chat(messages)`, spelled as a client method."""
        return await self(messages, tools)

"""Token-exact multi-turn history: the ids the policy sees on turn k+1 are, verbatim, the ids
it saw and generated on turn k, followed by the ids of what the environment added.

Re-rendering the whole conversation through the chat template and tokenizing it again each
turn is what the anchors warn against: a tokenizer does not round-trip (the policy's ids for
"2146" need not be the ids `tokenize("2146")` gives, nor does a truncated turn end like the
template's rendering of it), and a trainer that scores re-tokenized text scores tokens the
policy never sampled (verl saw PPO stop converging; slime masks drifted tokens out). So:

* the first prompt is the template's rendering of the first messages, tokenized;
* the policy's generated ids are appended as they came back, never decoded and re-encoded;
* for the environment's new messages only the template's *delta* is tokenized: the new
  rendering (with the generation prompt) minus the text our ids already stand for.

"The text our ids stand for" is the first rendering plus the decoded policy turns (special
tokens kept) plus the deltas. When the policy ended its turn with eos, that equals the
template's rendering of the conversation so far (its assistant message's content is the
decoded generation); when it was cut off by max_tokens the template closes the turn itself
and that closing text (e.g. `<|end|>`) is part of the delta: environment tokens, mask 0.

An environment may rewrite or compact history; then the text our ids stand for is not a
prefix of the new rendering. Nothing is asserted and nothing stalls: the current sample is
closed and a *sibling* sample starts whose prompt is the whole new rendering (all of it
prompt, so no loss on it), counted in `siblings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from hpc_rl.engines.rows import SampleRow

ENV_VERSION = -1  # token_versions of environment / tool / template tokens: no weights made them


@dataclass(frozen=True)
class PolicyTurn:
    """One policy call as it came back: kept to check later that its ids were stored verbatim."""

    sample: int  # which sample (0, or a sibling) the turn belongs to
    offset: int  # where its ids start in that sample's response_ids
    ids: tuple  # the generated ids, copied when they arrived
    finish_reason: str = "stop"


@dataclass
class _Sample:
    prompt_ids: List[int]
    response_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    loss_mask: List[int] = field(default_factory=list)
    token_versions: List[int] = field(default_factory=list)
    turns: int = 0

    def full_ids(self) -> List[int]:
        return self.prompt_ids + self.response_ids


class TokenHistory:
    """The token record of one episode: one sample, plus one sibling per history rewrite.

    `prompt(messages, tools)` gives the ids of the next policy call (and records the
    environment's delta); `add_policy(...)` records what the policy generated. `rows()` turns
    the record into SampleRows."""

    def __init__(self, tokenizer, template_kwargs: Optional[dict] = None):
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.samples: List[_Sample] = []
        self.policy_turns: List[PolicyTurn] = []
        self.siblings = 0
        self._held = ""  # the text the current sample's ids stand for

    # -- rendering ---------------------------------------------------------------------------
    def render(self, messages: Sequence[dict], tools: Optional[list] = None, add_generation_prompt: bool = True) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:  # only when given: a template that does not take tools must not see the key
            kwargs["tools"] = tools
        return self.tok.apply_chat_template(list(messages), tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **kwargs)

    def _encode(self, text: str) -> List[int]:
        # the rendering already holds the template's special tokens (bos included, if any)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    # -- recording ---------------------------------------------------------------------------
    @property
    def current(self) -> _Sample:
        return self.samples[-1]

    def prompt(self, messages: Sequence[dict], tools: Optional[list] = None) -> List[int]:
        """The ids of the policy call for `messages` (the whole conversation, assistant turns
        as this history's chat returned them): the current sample's ids plus the tokenized
        delta, or a sibling's fresh prompt when the history was rewritten."""
        text = self.render(messages, tools, add_generation_prompt=True)
        if self.samples and text.startswith(self._held):
            self._extend_or_branch(self._encode(text[len(self._held):]), None)
        else:
            self._extend_or_branch(None, self._encode(text))
        self._held = text
        return self.current.full_ids()

    def prompt_ids(self, ids: Sequence[int]) -> List[int]:
        """The token-in twin of `prompt`, for a client that renders its own prompts (an
        adapted library's renderer): when the current sample's ids are a prefix of `ids`,
        the rest is the environment's delta (mask 0); otherwise a sibling sample starts
        with `ids` as its prompt. The ids are taken as given: nothing is re-tokenized."""
        ids = [int(i) for i in ids]
        held = self.current.full_ids() if self.samples else None
        if held is not None and ids[:len(held)] == held:
            self._extend_or_branch(ids[len(held):], None)
        else:
            self._extend_or_branch(None, ids)
        self._held = self.tok.decode(ids, skip_special_tokens=False)
        return self.current.full_ids()

    def _extend_or_branch(self, delta: Optional[List[int]], fresh_prompt: Optional[List[int]]) -> None:
        """`delta`: the environment's tokens appended to the current sample (mask 0, no
        log-prob, the environment's version); else a sibling sample starts at `fresh_prompt`."""
        if delta is not None:
            s = self.current
            s.response_ids += delta
            s.logprobs += [0.0] * len(delta)
            s.loss_mask += [0] * len(delta)
            s.token_versions += [ENV_VERSION] * len(delta)
            return
        if self.samples:
            self.siblings += 1
        self.samples.append(_Sample(prompt_ids=fresh_prompt))

    def add_policy(self, ids: Sequence[int], logprobs: Sequence[float], version_first: int, version_last: int,
                   finish_reason: str = "stop", versions: Optional[Sequence[int]] = None) -> str:
        """Append the policy's generated ids verbatim; returns their text (special tokens kept).
        `versions`: per-token weight versions when the policy knows them; otherwise every
        token but the last is labelled `version_first` (the older: an age bound computed from
        it errs on the safe side) and the last `version_last`."""
        ids = [int(i) for i in ids]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} generated ids but {len(logprobs)} logprobs")
        if versions is None:
            versions = [version_first] * len(ids)
            if ids:
                versions[-1] = version_last
        elif len(versions) != len(ids):
            raise ValueError(f"{len(ids)} generated ids but {len(versions)} versions")
        s = self.current
        self.policy_turns.append(PolicyTurn(len(self.samples) - 1, len(s.response_ids), tuple(ids), finish_reason))
        s.response_ids += ids
        s.logprobs += [float(x) for x in logprobs]
        s.loss_mask += [1] * len(ids)
        s.token_versions += [int(v) for v in versions]
        s.turns += 1
        text = self.tok.decode(ids, skip_special_tokens=False)
        self._held += text
        return text

    def row_turns(self) -> List[PolicyTurn]:
        """The policy turns with `sample` counted in `rows()` (which leaves out samples
        without policy tokens)."""
        row_of, n = {}, 0
        for i, s in enumerate(self.samples):
            if any(s.loss_mask):
                row_of[i], n = n, n + 1
        return [PolicyTurn(row_of[t.sample], t.offset, t.ids, t.finish_reason) for t in self.policy_turns]

    def length(self) -> int:
        """Tokens of the current sample, prompt included (what the next call's context holds)."""
        return len(self.current.full_ids()) if self.samples else 0

    # -- output ------------------------------------------------------------------------------
    def rows(self, truncated: bool = False) -> List[SampleRow]:
        """One SampleRow per sample that holds policy tokens. A sample's trailing environment
        tokens (a delta no policy call followed: the episode ended or hit a limit) are dropped:
        they would be context for nothing."""
        out = []
        for s in self.samples:
            pol = [i for i, m in enumerate(s.loss_mask) if m]
            if not pol:
                continue
            end = pol[-1] + 1
            resp = s.response_ids[:end]
            out.append(SampleRow(
                prompt_ids=list(s.prompt_ids), response_ids=list(resp), logprobs=list(s.logprobs[:end]),
                truncated=truncated, text=self.tok.decode(resp, skip_special_tokens=False),
                version_first=s.token_versions[pol[0]], version_last=s.token_versions[pol[-1]],
                loss_mask=list(s.loss_mask[:end]), token_versions=list(s.token_versions[:end]), turns=s.turns))
        return out


def changed_policy_tokens(rows: Sequence[SampleRow], turns: Sequence[PolicyTurn]) -> int:
    """How many policy tokens are not, verbatim and with loss mask 1, where their turn put
    them: each turn's ids as they came back (`turns`, indexed by row: `history.row_turns()`)
    against the stored rows' ids. 0 by construction; measured, not asserted, so that tests
    and metrics can report it."""
    changed = 0
    for t in turns:
        if t.sample >= len(rows):
            changed += len(t.ids)
            continue
        r = rows[t.sample]
        mask = r.loss_mask if r.loss_mask is not None else [1] * len(r.response_ids)
        for k, tok_id in enumerate(t.ids):
            j = t.offset + k
            if j >= len(r.response_ids) or r.response_ids[j] != tok_id or mask[j] != 1:
                changed += 1
    return changed

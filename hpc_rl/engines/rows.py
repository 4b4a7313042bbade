"""The rows an engine returns and the padded batch the trainer and teachers compute on.

A row is one sample: the prompt's ids, then every later token. For a single-turn sample
every later token is the policy's. For a multi-turn trajectory (hpc_rl/agentic/) the later
tokens interleave the policy's turns with the environment's (tool results, the chat
template's turn markers): `loss_mask` says which are the policy's, and only those are
trained on, scored against teachers and compared with the trainer's log-probs. The
environment's tokens stay in the row as context, so every policy token is computed in its
full multi-turn context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


@dataclass
class Rollouts:
    """Right-padded prompt+response token ids and what the engine said about them."""

    input_ids: torch.Tensor  # [B, T] long, prompt then response, right-padded
    attention_mask: torch.Tensor  # [B, T]
    # [B, T] bool: the policy's generated tokens (the ones trained on); a multi-turn row's
    # environment tokens are False
    response_mask: torch.Tensor
    generation_logprobs: torch.Tensor  # [B, T]: sampled token's logprob at its position, 0 elsewhere
    prompt_lengths: List[int]
    generation_lengths: List[int]  # tokens after the prompt (a multi-turn row's environment tokens included)
    truncated: List[bool]
    texts: List[str]


@dataclass
class SampleRow:
    """One generated sample as plain lists (cheap to pickle between ranks)."""

    prompt_ids: List[int]
    response_ids: List[int]  # every token after the prompt
    logprobs: List[float]  # per response token: its logprob under the generating engine (0.0 on environment tokens)
    truncated: bool  # stopped by max_tokens (or, multi-turn, by a limit of the episode) rather than ending
    text: str
    # The weight versions (trainer steps) the engine served when the sample's first and last
    # policy tokens were generated; they differ when a refit landed mid-sequence. Set by the generator.
    version_first: int = 0
    version_last: int = 0
    # Multi-turn trajectories (hpc_rl/agentic/): 1 on the policy's tokens, 0 on the
    # environment's; None: every response token is the policy's (a single turn).
    loss_mask: Optional[List[int]] = None
    token_versions: Optional[List[int]] = None  # per response token: its weight version (-1 on environment tokens)
    turns: int = 1  # the policy's turns in this sample

    def policy_mask(self) -> List[int]:
        return [1] * len(self.response_ids) if self.loss_mask is None else list(self.loss_mask)


def pad_rows(rows: Sequence[SampleRow], pad_id: int) -> Rollouts:
    """Right-pad prompt+response rows into one batch; logprob of token i sits at position i.
    The response mask is each row's policy mask: environment tokens are context only."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    resp = torch.zeros((b, width), dtype=torch.bool)
    glp = torch.zeros((b, width), dtype=torch.float32)
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.prompt_ids) + len(r.response_ids)
        if r.loss_mask is not None and len(r.loss_mask) != len(r.response_ids):
            raise ValueError(f"row {i}: a loss mask of {len(r.loss_mask)} for {len(r.response_ids)} response tokens")
        ids[i, :n] = torch.tensor(r.prompt_ids + r.response_ids)
        attn[i, :n] = 1
        resp[i, p:n] = torch.tensor(r.policy_mask(), dtype=torch.bool)
        glp[i, p:n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return Rollouts(ids, attn, resp, glp, [len(r.prompt_ids) for r in rows], [len(r.response_ids) for r in rows],
                    [r.truncated for r in rows], [r.text for r in rows])

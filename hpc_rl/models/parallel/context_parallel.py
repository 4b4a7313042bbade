"""Context parallel over the sequence, with an all-gather of K/V in each attention.

torch's `context_parallel` has no CPU path (its SDPA has no sharding strategy there,
NOTES.md), so this is a portable one: each rank of a cp group takes a contiguous 1/cp of
every sequence (its tokens, their global positions), computes q/k/v for them, all-gathers
the keys and values of the group, and attends its queries over the whole sequence with a
causal mask shifted by its offset. The gather keeps autograd (its backward sums the
ranks' key/value gradients into each owner's slice). Then each rank scores its own tokens
and the group all-gathers the log-probs, so the loss sees whole rows on every rank.

Memory: activations of 1/cp of the tokens per rank, plus the gathered K/V of one layer at a
time (no ring overlap: a CPU twin, correct first). Chunks are contiguous, not the 2*cp
load-balanced halves of ring attention, so the last rank does the most attention work.

Gradient scale: every cp rank computes the same whole-row loss, so each one's gradient is
cp x its share; FSDP2 over the dp x cp ranks (the backend shards over the whole group when
tp = 1) averages them, which gives the true gradient.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
import torch.distributed as dist

NAME = "hpc_rl_cp_allgather"
_state = threading.local()  # the forward's cp group, offset and key padding (None: plain SDPA)


class _GatherCat(torch.autograd.Function):
    """All-gather along `dim`; the backward sums every rank's gradient of the whole and keeps
    this rank's slice. (With torch.distributed.nn's all_gather, whose gloo backward is an
    all_to_all of the gradient's slices, the cp=2 step's gradient norm came out 1.5% off the
    dp-only one here; not traced further, this all_reduce form matches to 1e-5.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.dim, ctx.n = group, dim, x.shape[dim]
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.n, ctx.n).contiguous(), None, None


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _GatherCat.apply(x, group, dim)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """HF attention interface: query [B, H, Tl, D], key/value [B, Hkv, Tl, D] of this rank's tokens."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    cp = getattr(_state, "cp", None)
    if cp is None:  # outside a cp forward (greedy generation): the model is whole on every rank
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    group, offset, key_valid = cp
    key, value = _gather(key, group, 2), _gather(value, group, 2)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    tq, tk = query.shape[2], key.shape[2]
    q_pos = torch.arange(offset, offset + tq, device=query.device)[:, None]
    k_pos = torch.arange(tk, device=query.device)[None, :]
    mask = (k_pos <= q_pos)[None, None] & key_valid[:, None, None, :].bool()  # [B, 1, Tl, T]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def enable(model: torch.nn.Module) -> None:
    """Route the model's attention through `_attention` (plain SDPA outside a cp forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # HF's mask for generation; the cp forward builds its own
    model.config._attn_implementation = NAME


@contextlib.contextmanager
def _active(group, offset: int, key_valid: torch.Tensor):
    _state.cp = (group, offset, key_valid)
    try:
        yield
    finally:
        _state.cp = None


def cp_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, group,
                      chunk: Optional[int] = 0) -> torch.Tensor:
    """[B, T] log p(token i | tokens < i), 0 at position 0, on every rank of the cp `group`.
    `chunk` 0: whole logits; else the head runs on that many tokens at a time (None: a size of
    models/chunked_logprobs.py's choosing)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    b, t = input_ids.shape
    extra = -t % cp
    ids = torch.cat([input_ids, input_ids.new_zeros((b, extra))], 1) if extra else input_ids
    mask = torch.cat([attention_mask, attention_mask.new_zeros((b, extra))], 1) if extra else attention_mask
    n = ids.shape[1] // cp
    lo, hi = rank * n, (rank + 1) * n
    positions = torch.arange(lo, hi, device=ids.device)[None].expand(b, -1)
    # position g of this chunk predicts token g + 1 (the next chunk's first for the last one)
    targets = torch.cat([ids[:, 1:], ids.new_zeros((b, 1))], 1)[:, lo:hi]
    with _active(group, lo, mask):  # the whole model's forward: FSDP2's root hooks gather the embedding and head
        if chunk != 0:
            from ..chunked_logprobs import model_logprobs

            lp = model_logprobs(model, ids[:, lo:hi], None, targets, chunk, position_ids=positions)
        else:
            logits = model(input_ids=ids[:, lo:hi], attention_mask=None, position_ids=positions,
                           use_cache=False).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    whole = _gather(lp, group, 1)[:, : ids.shape[1] - 1]  # predictions of tokens 1..T-1
    return torch.cat([torch.zeros_like(whole[:, :1]), whole], 1)[:, :t]

"""Forward passes of a tensor-parallel model: log-probs from the vocabulary-sharded logits
and greedy continuations, both without a whole-vocabulary tensor on any rank.

Sequence parallel shards the sequence evenly, so inputs are right-padded to a multiple of
tp (pad positions are masked out and their outputs dropped).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .vocab_logprobs import sharded_token_logprobs


def _pad_to(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int, pad_id: int = 0):
    extra = -input_ids.shape[1] % multiple
    if not extra:
        return input_ids, attention_mask
    b = input_ids.shape[0]
    return (torch.cat([input_ids, input_ids.new_full((b, extra), pad_id)], 1),
            torch.cat([attention_mask, attention_mask.new_zeros((b, extra))], 1))


def local_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: Optional[torch.Tensor] = None):
    """[B, T, V/tp] logits of this rank's vocabulary slice, the slice's first id, the tp group."""
    # the whole model's forward (not model.model + lm_head): FSDP2's root hooks gather the
    # embedding, final norm and head when dp > 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits  # a DTensor, Shard(-1) over the vocabulary
    local = logits.to_local()
    mesh = logits.device_mesh
    vocab_start = mesh.get_local_rank() * local.shape[-1]  # even split: validation makes tp divide the vocabulary
    return local, vocab_start, mesh.get_group()


def tp_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, tp: int,
                      chunk: Optional[int] = 0) -> torch.Tensor:
    """[B, T] log p(token i | tokens < i), 0 at position 0 (models/fsdp2.token_logprobs' convention).
    `chunk` 0: whole logits; else the head runs on that many tokens at a time (None: a size of
    models/chunked_logprobs.py's choosing)."""
    t = input_ids.shape[1]
    ids, mask = _pad_to(input_ids, attention_mask, tp)
    if chunk != 0:
        from ..chunked_logprobs import next_token_logprobs

        return next_token_logprobs(model, ids, mask, chunk)[:, :t]
    local, start, group = local_logits(model, ids, mask)
    return sharded_token_logprobs(local, ids, start, group)[:, :t]


@torch.no_grad()
def tp_greedy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, eos_id: int,
              pad_id: int, tp: int) -> torch.Tensor:
    """Greedy continuations of left-padded prompts, [B, <= max_new_tokens] (pad after eos, as HF's generate). No KV
    cache: each new token reruns the sequence (teachers' eval prompts are short). The argmax
    over the sharded vocabulary: each rank's best, then the best of those."""
    ids, mask = input_ids, attention_mask
    b = ids.shape[0]
    done = torch.zeros(b, dtype=torch.bool, device=ids.device)
    out = []
    for _ in range(max_new_tokens):
        n = ids.shape[1]
        pids, pmask = _pad_to(ids, mask, tp, pad_id)
        positions = (pmask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
        local, start, group = local_logits(model, pids, pmask, positions)
        last = local[:, n - 1].float()
        best, arg = last.max(-1)
        pairs = [torch.empty(2, b, device=last.device) for _ in range(dist.get_world_size(group))]  # NCCL: on the GPU
        dist.all_gather(pairs, torch.stack([best, (arg + start).float()]), group=group)
        stacked = torch.stack(pairs)  # [tp, 2, B]; ties go to the lowest vocabulary slice, as argmax does
        winner = stacked[:, 0].argmax(0)
        nxt = stacked[winner, 1, torch.arange(b, device=last.device)].long()
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out.append(nxt)
        done |= nxt == eos_id
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, (~done | (nxt == eos_id)).long()[:, None]], 1)
        if bool(done.all()):
            break
    return torch.stack(out, 1)

"""Token log-probs from vocabulary-parallel logits: each tensor-parallel rank holds a block
of the vocabulary's logits, and no rank ever builds the whole [tokens, vocab] tensor.

Forward: the max and the sum of exponentials are all-reduced over the tensor-parallel
group, and the target's logit comes from the rank whose block holds it. Backward needs no
communication: d log p(t) / d logit_v = [v == t] - softmax_v, computed on each rank's block
from what the forward saved. (Every rank computes the same loss from these log-probs; a
differentiable all-reduce would count that loss once per rank.)

Pure torch.distributed: tests/test_megatron_vocab_parallel.py runs it over gloo on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group, vocab_size) -> torch.Tensor:
        logits = logits.float()
        if vocab_size is not None and vocab_start + logits.shape[-1] > vocab_size:
            # Megatron pads the vocabulary; padding rows are not tokens and must not take
            # probability mass (24 zero logits out of 128 would shift every log-prob by
            # log(128/104) on a tiny model)
            logits = logits.clone()
            logits[..., max(vocab_size - vocab_start, 0):] = float("-inf")
        m = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        n = logits.shape[-1]
        local = target - vocab_start
        mine = (local >= 0) & (local < n)
        idx = local.clamp(0, n - 1)
        # where(), not a product: a rank holding only padding has -inf there, and -inf * 0 is nan
        picked = torch.where(mine, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(total))
        if group is not None:
            both = torch.stack([total, picked])
            dist.all_reduce(both, group=group)
            total, picked = both[0], both[1]
        ctx.save_for_backward(exp / total.unsqueeze(-1), idx, mine)
        return picked - total.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, idx, mine = ctx.saved_tensors
        g = -softmax
        g.scatter_add_(-1, idx.unsqueeze(-1), mine.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group=None,
                            vocab_size: Optional[int] = None) -> torch.Tensor:
    """log p(target) for logits [..., V_local] holding vocabulary rows [vocab_start,
    vocab_start + V_local) of a vocabulary split over `group` (None: the whole vocabulary);
    rows from `vocab_size` on (Megatron's padding) get no probability."""
    return _VocabParallelLogprob.apply(logits, target, vocab_start, group, vocab_size)

"""Log-probs of the chosen tokens from vocabulary-sharded logits, without gathering them.

Each tensor-parallel rank holds logits for its contiguous slice of the vocabulary (the
lm_head is column parallel). The log-softmax needs only three numbers per position from
the other ranks: the maximum, the sum of exponentials, and the target's logit (held by
exactly one rank). Gradients need no communication at all: d log p(y) / d z_v is
1[v = y] - softmax(z)_v, and each rank computes it for its own slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
        # logits [N, V_local] fp32, target [N] global ids
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        v_local = logits.shape[-1]
        local_t = target - vocab_start
        here = (local_t >= 0) & (local_t < v_local)
        safe = torch.where(here, local_t, torch.zeros_like(local_t))
        picked = shifted.gather(-1, safe[:, None]).squeeze(-1) * here
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(exp, sum_exp, safe, here)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        exp, sum_exp, safe, here = ctx.saved_tensors
        g = -(exp / sum_exp[:, None])
        g.scatter_add_(-1, safe[:, None], here.to(g.dtype)[:, None])
        return g * grad[:, None], None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """logits [..., V_local] (this rank's vocabulary slice from `vocab_start`), target [...]
    global token ids -> [...] log p(target), the same on every rank of `group`."""
    shape = target.shape
    out = _VocabParallelLogProb.apply(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_start, group)
    return out.reshape(shape)


def sharded_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """The project's convention (models/fsdp2.token_logprobs) over sharded logits:
    out[:, i] = log p(ids[:, i] | ids[:, :i]), out[:, 0] = 0."""
    lp = vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], vocab_start, group)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)

"""The sampled tokens' log-probs from the final hidden states, a chunk of tokens at a time.

Why: the model's own forward ends in `lm_head`, whose [rows, tokens, vocab] logits (then a
float32 copy for the log-softmax) are the largest tensor of a step: one 49k-token sequence at
a 131k vocabulary is 25.7 GB of float32 logits. Here the head runs on `chunk` tokens at a
time: each chunk's logits give, per token, the target's logit and the log-sum-exp, and are
dropped. The backward recomputes each chunk's logits (the memory in backward matters as much:
autograd would otherwise keep every chunk's softmax), so at most one chunk's [chunk, vocab]
float32 logits exist at any time, forward or backward.

Under tensor parallelism the head is split over the vocabulary (each rank its rows of the
weight, models/parallel/tensor_parallel.py): a chunk's max, sum of exponentials and target
logit are all-reduced over the tp group, as models/parallel/vocab_logprobs.py does for whole
logits, and the hidden states' gradient (each rank's share of the vocabulary contributes to
it) is all-reduced in the backward. The weight's gradient stays each rank's own slice.

`model_logprobs` runs this inside the model's own call (`model(...)` with its forward
swapped for the backbone plus this head), so FSDP2's root hooks gather the embedding, final
norm and head weights before, and reduce-scatter their gradients after, as for the plain
forward.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from hpc_rl.models import families

# trainer.logprob_chunk_tokens left unset: as many tokens per chunk as keep a chunk's float32
# logits at 2^26 elements (256 MB) on each rank, whatever the vocabulary (or its tp share):
# 2048 tokens at 32k, 512 at 128k, 4096 at 131k over tp=8.
CHUNK_LOGIT_ELEMENTS = 1 << 26


def chunk_tokens_for(chunk: Optional[int], vocab_local: int) -> int:
    """Tokens per chunk: `chunk` when set, else what keeps a chunk at CHUNK_LOGIT_ELEMENTS logits."""
    return int(chunk) if chunk else max(1, CHUNK_LOGIT_ELEMENTS // max(vocab_local, 1))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # at least fp32 (bf16 logits lose the tail of the distribution); a float64 model keeps float64
    return torch.promote_types(dtype, torch.float32)


class _ChunkedLogprob(torch.autograd.Function):
    """hidden [N, H], weight [V_local, H] (this rank's vocabulary rows from `vocab_start`),
    target [N] global ids -> [N] log p(target) over the whole vocabulary."""

    @staticmethod
    def forward(ctx, hidden, weight, target, chunk: int, vocab_start: int, group, dtype: torch.dtype):
        n, v_local = hidden.shape[0], weight.shape[0]
        acc = _acc_dtype(dtype)
        out = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen explicitly
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                logits = (hidden[s:e].to(dtype) @ w.t()).to(acc)  # [c, V_local]: the only vocabulary-wide tensor
                local_t = target[s:e] - vocab_start
                here = (local_t >= 0) & (local_t < v_local)
                picked = logits.gather(-1, torch.where(here, local_t, 0)[:, None]).squeeze(-1) * here
                m = logits.max(-1).values
                if group is not None:
                    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                # in place: one chunk-sized buffer; the sum of exponentials and the target's logit
                # travel in one all-reduce
                pair = torch.stack([logits.sub_(m[:, None]).exp_().sum(-1), picked])
                del logits
                if group is not None:
                    dist.all_reduce(pair, group=group)
                lse[s:e] = m + pair[0].log()
                out[s:e] = pair[1] - lse[s:e]
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.chunk, ctx.vocab_start, ctx.group, ctx.dtype = chunk, vocab_start, group, dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target, lse = ctx.saved_tensors
        chunk, dtype, n, v_local = ctx.chunk, ctx.dtype, hidden.shape[0], weight.shape[0]
        acc = _acc_dtype(dtype)
        w = weight.to(dtype)
        d_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if ctx.needs_input_grad[0] else None
        # summed over chunks in the accumulation dtype, cast to the weight's once at the end
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad = grad.to(acc)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                h = hidden[s:e].to(dtype)
                # d log p(y) / d z_v = 1[v = y] - softmax(z)_v, on this rank's slice of v (in place
                # on the recomputed logits: one chunk-sized buffer)
                g = (h @ w.t()).to(acc).sub_(lse[s:e, None]).exp_().mul_(-grad[s:e, None])
                local_t = target[s:e] - ctx.vocab_start
                here = (local_t >= 0) & (local_t < v_local)
                g.scatter_add_(-1, torch.where(here, local_t, 0)[:, None], (grad[s:e] * here)[:, None])
                g = g.to(dtype)
                if d_hidden is not None:
                    d_hidden[s:e] = g @ w
                if d_weight is not None and d_weight.dtype == g.dtype:
                    d_weight.addmm_(g.t(), h)  # no weight-sized temporary per chunk
                elif d_weight is not None:
                    d_weight += (g.t() @ h).to(acc)
                # before the next chunk's logits exist: else two chunks' buffers live at once (measured
                # by bench/memory_model.py: the backward's peak held a second chunk of 256 MB)
                del g, h
        if d_hidden is not None and ctx.group is not None:
            # each tp rank's vocabulary slice contributes a part of every hidden state's gradient
            dist.all_reduce(d_hidden, group=ctx.group)
        return (None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if d_weight is None else d_weight.to(weight.dtype), None, None, None, None, None)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int,
                     vocab_start: int = 0, group=None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """hidden [..., H], weight [V_local, H], target [...] -> [...] log p(target) (at least fp32).
    `dtype`: the head's compute dtype (None: the hidden states' and weight's common one)."""
    if dtype is None:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    shape = target.shape
    out = _ChunkedLogprob.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), int(chunk),
                                int(vocab_start), group, dtype)
    return out.reshape(shape)


def head_logprobs(lm_head: torch.nn.Module, hidden, target: torch.Tensor, chunk: Optional[int]) -> torch.Tensor:
    """The head's log-probs of `target` [B, T] at every position of `hidden` [B, T, H], in
    chunks of `chunk` tokens (None: chunk_tokens_for's size)."""
    from torch.distributed.tensor import DTensor, Replicate

    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("chunked log-probs take a head without bias (Llama, Qwen2, Qwen3-MoE, Nemotron-H)")
    weight, group, start = lm_head.weight, None, 0
    if isinstance(weight, DTensor):  # tensor parallel: this rank's vocabulary rows (Shard(0) on the tp mesh)
        mesh = weight.device_mesh
        weight = weight.to_local()
        group, start = mesh.get_group(), mesh.get_local_rank() * weight.shape[0]  # even split (validation)
    if isinstance(hidden, DTensor):  # sequence parallel: the final norm's output is Shard(1); gather the tokens
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    dtype = None
    if torch.is_autocast_enabled(hidden.device.type):  # what the head's matmul would run in under autocast
        dtype = torch.get_autocast_dtype(hidden.device.type)
    return chunked_logprobs(hidden, weight, target, chunk_tokens_for(chunk, weight.shape[0]), start, group, dtype)


@contextlib.contextmanager
def _forward_swapped(model: torch.nn.Module, forward):
    """The instance's forward replaced while the block runs: `model(...)` still runs its
    hooks (FSDP2's unshard / reshard, DTensor's), only the body differs."""
    had = "forward" in model.__dict__
    old = model.__dict__.get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = old
        else:
            del model.forward


def model_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   target: torch.Tensor, chunk: Optional[int], position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T] log p(target[:, i] | the model's state after input_ids[:, :i+1]) through a
    Hugging Face causal LM (`model.model` the backbone, `model.lm_head` the head), never
    holding more than `chunk` tokens' logits."""

    # the HF forward's own scaling after lm_head (Granite's logits_scaling), which running the head
    # here would skip; scaling the hidden states scales the logits (the head has no bias)
    fam = families.of_config(model.config.to_dict())
    scale = fam.logit_scale(model.config.to_dict()) if fam is not None else 1.0

    def forward(input_ids=None, attention_mask=None, position_ids=None, **_):
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)
        hidden = out[0] if scale == 1.0 else out[0] * scale
        # a fresh tensor, not a view: FSDP2 hooks its pre-backward onto the root's output
        return head_logprobs(model.lm_head, hidden, target, chunk).clone()

    with _forward_swapped(model, forward):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits, [B, T] ids -> [B, T] with out[:, i] = log p(ids[:, i] | ids[:, :i]), out[:, 0] = 0."""
    # at least fp32 (bf16 logits lose the tail of the distribution); a float64 model keeps float64
    lp = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def next_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                        chunk: Optional[int], position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """models/fsdp2.token_logprobs' convention, chunked: out[:, i] = log p(ids[:, i] | ids[:, :i]),
    out[:, 0] = 0. The last position predicts nothing: its target is a dummy, its value dropped.
    A packed row (models/packing.py) comes with its position ids and no attention mask."""
    target = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
    lp = model_logprobs(model, input_ids, attention_mask, target, chunk, position_ids=position_ids)[:, :-1]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)

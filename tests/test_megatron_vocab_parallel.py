"""Vocabulary-parallel log-probs (the Megatron backend's loss input) over real gloo ranks on
CPU: values and gradients equal log_softmax over the whole vocabulary."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_rl.models.megatron.vocab_parallel import vocab_parallel_logprobs

V, TP = 12, 3


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V, generator=g, dtype=torch.float64).float() * 4
    target = torch.randint(0, V, (2, 5), generator=g)
    weights = torch.randn(2, 5, generator=g)
    return logits, target, weights


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        logits, target, w = _data()
        n = V // TP
        local = logits[..., rank * n:(rank + 1) * n].clone().requires_grad_(True)
        lp = vocab_parallel_logprobs(local, target, rank * n, dist.group.WORLD)
        (lp * w).sum().backward()
        # Megatron's padded vocabulary: 12 real rows padded to 18, 6 per rank; the last rank
        # holds nothing but padding
        padded = torch.cat([logits, torch.zeros(2, 5, 6)], -1)[..., rank * 6:(rank + 1) * 6].clone().requires_grad_(True)
        lp_pad = vocab_parallel_logprobs(padded, target, rank * 6, dist.group.WORLD, vocab_size=V)
        (lp_pad * w).sum().backward()
        # numpy pickles by value: torch tensors would travel as shared memory the exiting child takes away
        out.put((rank, *(t.detach().numpy() for t in (lp, local.grad, lp_pad, padded.grad))))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_logprobs_and_grads_match_the_whole_vocabulary():
    logits, target, w = _data()
    full = logits.clone().requires_grad_(True)
    want = torch.log_softmax(full, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (want * w).sum().backward()
    alone = logits.clone().requires_grad_(True)
    lp1 = vocab_parallel_logprobs(alone, target, 0)
    (lp1 * w).sum().backward()
    torch.testing.assert_close(lp1, want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(alone.grad, full.grad, rtol=0, atol=1e-6)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(TP)]
    for p in procs:
        p.start()
    got = sorted((q.get(timeout=120) for _ in range(TP)), key=lambda x: x[0])
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    n = V // TP
    padded_grad = torch.cat([full.grad, torch.zeros(2, 5, 6)], -1)
    for rank, *arrays in got:
        lp, grad, lp_pad, grad_pad = (torch.from_numpy(a) for a in arrays)
        torch.testing.assert_close(lp, want.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, full.grad[..., rank * n:(rank + 1) * n], rtol=0, atol=1e-6)
        torch.testing.assert_close(lp_pad, want.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(grad_pad, padded_grad[..., rank * 6:(rank + 1) * 6], rtol=0, atol=1e-6)


def test_padding_rows_take_no_probability():
    logits, target, _ = _data()
    padded = torch.cat([logits, torch.zeros(2, 5, 4)], dim=-1).requires_grad_(True)
    lp = vocab_parallel_logprobs(padded, target, 0, vocab_size=V)
    want = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-5)
    lp.sum().backward()
    assert not padded.grad[..., V:].any()
    # without the vocabulary size the padding would take mass: the check can fail
    assert (vocab_parallel_logprobs(padded.detach(), target, 0) - want).abs().max() > 0.01

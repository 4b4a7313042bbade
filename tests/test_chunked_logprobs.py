"""Log-probs in chunks (hpc_rl/models/chunked_logprobs.py) and activation checkpointing on the
fsdp2 backend (issue 44): the same values and gradients as the whole-logits forward, on a tiny
Llama and a tiny Nemotron-H (one process), under tensor parallel 2 with and without sequence
parallel (vocab-parallel chunks), context parallel 2, and FSDP2 over 2 data-parallel ranks with
uneven rows (gloo), the no-grad pass split by its token budget included.

Tolerances from the arithmetic: both paths compute the same float32 sums in another order (a
chunk's log-sum-exp against the whole row's log_softmax; the head's gradient summed over chunks),
so they differ by a few float32 roundings of the values they add: |log p| <= log(V) ~ 5 here,
eps32 = 1.2e-7, so values within 2e-6; gradients within 1e-5 of the largest gradient entry.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_rl.models.assets import ModelSpec, MoeModelSpec, NemotronHModelSpec, save_untrained
from hpc_rl.models.chunked_logprobs import chunk_tokens_for, chunked_logprobs
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
from backend_batches import masked_batch, masked_loss
from gloo_ranks import run_ranks

SPECS = {"llama": ModelSpec(hidden=32, intermediate=64, layers=2, heads=2, max_positions=64),
         "nemotron_h": NemotronHModelSpec(),
         "qwen3_moe": MoeModelSpec(hidden=64, expert_intermediate=32, layers=2)}
VALUE_TOL = 2e-6
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    return {name: str(save_untrained(root / name, spec, seed=0)) for name, spec in SPECS.items()}


def _grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _close_grads(a: dict, b: dict) -> float:
    """The largest difference relative to the largest gradient entry; the same parameters must have one."""
    assert a.keys() == b.keys() and a
    scale = max(float(g.abs().max()) for g in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def _run(backend: FSDP2Backend, ids, attn):
    """Values and gradients of one masked loss through forward_logprobs, and the no-grad pass."""
    lp = backend.forward_logprobs(ids, attn)
    loss, _ = masked_loss(attn)(lp, slice(0, ids.shape[0]))
    loss.backward()
    return lp.detach().cpu(), _grads(backend.model), backend.logprobs(ids, attn).cpu()


def test_chunked_function_gradcheck():
    """The custom autograd function against autograd itself, in float64 (torch's gradcheck), with
    chunks that do not divide the tokens."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, 11, (7,), generator=g)
    whole = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, target[:, None]).squeeze(-1)
    assert torch.allclose(chunked_logprobs(hidden, weight, target, 3), whole, atol=1e-12)
    assert torch.autograd.gradcheck(lambda h, w: chunked_logprobs(h, w, target, 3), (hidden, weight))


@pytest.mark.parametrize("family", ["llama", "nemotron_h"])
def test_chunked_equals_whole(ckpts, family):
    ids, attn = masked_batch(4, 12)
    # whole logits and one forward, against chunks of 5 tokens (not dividing 4 x 12) and one row per forward
    whole = _run(FSDP2Backend(ckpts[family], optim=OptimConfig(), logprob_chunk_tokens=0, logprob_batch_tokens=0),
                 ids, attn)
    chunked = _run(FSDP2Backend(ckpts[family], optim=OptimConfig(), logprob_chunk_tokens=5, logprob_batch_tokens=12),
                   ids, attn)
    assert float((whole[0] - chunked[0]).abs().max()) < VALUE_TOL
    assert float((whole[2] - chunked[2]).abs().max()) < VALUE_TOL
    assert float((whole[0] - whole[2]).abs().max()) < VALUE_TOL  # the no-grad pass gives the forward's values
    assert _close_grads(whole[1], chunked[1]) < GRAD_RTOL
    # the keys' defaults: chunks sized by the vocabulary, the no-grad pass's own token budget
    default = FSDP2Backend(ckpts[family], train=False)
    assert default.chunk_tokens is None and default.batch_tokens > 0
    assert float((whole[2] - default.logprobs(ids, attn)).abs().max()) < VALUE_TOL


def test_chunk_size_from_the_vocabulary():
    assert chunk_tokens_for(None, 32768) == 2048 and chunk_tokens_for(None, 131072) == 512
    assert chunk_tokens_for(None, 131072 // 8) == 4096  # a tp=8 share
    assert chunk_tokens_for(7, 131072) == 7


@pytest.mark.parametrize("family", ["llama", "nemotron_h", "qwen3_moe"])
def test_activation_checkpointing_same_gradients(ckpts, family):
    ids, attn = masked_batch(4, 12)
    plain = _run(FSDP2Backend(ckpts[family], optim=OptimConfig()), ids, attn)
    b = FSDP2Backend(ckpts[family], optim=OptimConfig(), activation_checkpointing=True)
    assert b.activation_checkpointing
    # the parameter names (checkpoints, refit) are those of the plain model
    assert set(b.model.state_dict()) == set(FSDP2Backend(ckpts[family], train=False).model.state_dict())
    b.model.train()
    calls = []
    # a module inside the first block (the recompute runs the block's body, not its own hooks)
    next(b.model.model.layers[0].children()).register_forward_hook(lambda *_: calls.append(1))
    ckpt = _run(b, ids, attn)
    assert len(calls) == 3  # the forward, its recompute in the backward, the no-grad pass: checkpointing is on
    assert float((plain[0] - ckpt[0]).abs().max()) < VALUE_TOL
    assert _close_grads(plain[1], ckpt[1]) < GRAD_RTOL


def _ranks_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    ids, attn = masked_batch(4, 11)  # odd length: sequence parallel pads it
    res = {}
    layouts = {"tp": {"parallel": {"tp": 2}}, "tp_sp": {"parallel": {"tp": 2}, "sequence_parallel": True},
               "cp": {"parallel": {"cp": 2}}}
    for name, kw in layouts.items():
        whole = _run(FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OptimConfig(), logprob_chunk_tokens=0, **kw),
                     ids, attn)
        chunked = _run(FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OptimConfig(), logprob_chunk_tokens=5, **kw),
                       ids, attn)
        res[name] = (float((whole[0] - chunked[0]).abs().max()), float((whole[2] - chunked[2]).abs().max()),
                     _close_grads(whole[1], chunked[1]), chunked[0])
    # FSDP2 over 2 dp ranks: rank 0 has 3 rows, rank 1 one; one row per no-grad forward, so
    # rank 1 runs two spare forwards (a hang here if the counts were not agreed)
    mine = [0, 1, 2] if rank == 0 else [3]
    for ac in (False, True):
        b = FSDP2Backend(ckpt, group=dist.group.WORLD, optim=OptimConfig(), logprob_chunk_tokens=5,
                         logprob_batch_tokens=11, activation_checkpointing=ac)
        b.model.train()
        lp = b.forward_logprobs(ids[mine], attn[mine])
        loss, _ = masked_loss(attn)(lp, mine)
        loss.backward()
        grads = _grads(b.model)  # before the no-grad pass: FSDP2's root keeps its weights unsharded after it
        res[f"dp_ac{int(ac)}"] = (lp.detach(), b.logprobs(ids[mine], attn[mine]), grads)
    # gradients of FSDP2 are averaged over the dp ranks: gather them whole
    torch.save(res, f"{out}.{rank}")


def test_chunked_on_gloo_ranks(ckpts, tmp_path: Path):
    ckpt = ckpts["llama"]
    run_ranks(_ranks_worker, 2, tmp_path / "store", ckpt, str(tmp_path / "res"))
    res = [torch.load(tmp_path / f"res.{r}", weights_only=False) for r in range(2)]
    ids, attn = masked_batch(4, 11)
    ref = _run(FSDP2Backend(ckpt, optim=OptimConfig(), logprob_chunk_tokens=0), ids, attn)
    for name in ("tp", "tp_sp", "cp"):
        for r in range(2):
            value, nograd, grad, lp = res[r][name]
            assert value < VALUE_TOL and nograd < VALUE_TOL, (name, r, value, nograd)
            assert grad < GRAD_RTOL, (name, r, grad)
            assert float((lp - ref[0]).abs().max()) < 1e-5  # against one process (the layouts differ in sums only)
    for key in ("dp_ac0", "dp_ac1"):
        lp = torch.cat([res[0][key][0], res[1][key][0]])
        nograd = torch.cat([res[0][key][1], res[1][key][1]])
        assert float((lp - ref[0]).abs().max()) < 1e-5 and float((nograd - ref[0]).abs().max()) < 1e-5
        # FSDP2's gradients: the mean over the 2 dp ranks of each rank's loss gradient
        assert _close_grads({k: 2 * v for k, v in res[0][key][2].items()}, ref[1]) < 1e-4
    assert _close_grads(res[0]["dp_ac0"][2], res[0]["dp_ac1"][2]) < GRAD_RTOL

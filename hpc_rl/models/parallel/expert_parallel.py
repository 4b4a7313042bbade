"""Expert parallel for Hugging Face MoE layers in the torch backend (gloo on CPU, NCCL on GPU).

The trainer's ranks form groups of `ep` consecutive ranks (the placement keeps such a group
inside one NVLink domain). Inside a group, rank j holds experts [j*E/ep, (j+1)*E/ep) of every
MoE layer; the router, attention, norms and embeddings stay as they were (FSDP2 over all the
trainer's ranks). A token's hidden state goes to the ranks owning its top-k experts with one
all_to_all, comes back weighted the same way, and the gradients retrace both exchanges.
Everything beside the routed experts stays replicated as a dense weight: the router (with
Nemotron-H's `e_score_correction_bias`, a buffer every rank loads from the same checkpoint
and nothing updates: transformers has no bias-update rule, so it stays the checkpoint's value),
the shared expert and Nemotron-H's latent projections (the block runs them itself, around
the experts module this one replaces).

Expert weights are DTensors Shard(0) over the ep group, so state dicts, checkpoints and the
refit see their global shape and each rank's box. Ranks with the same position in different
ep groups (the expert data-parallel group) hold the same experts: their gradients are summed
there, and every expert gradient is divided by the trainer's world size, which makes it the
mean over all ranks' losses, as FSDP2 makes it for every other weight.

The experts' layout differs by model family (Qwen3-MoE's gated `gate_up_proj`/`down_proj`,
Nemotron-H's non-gated `up_proj`/`down_proj`): expert_families.py describes each, and this
one dispatch path serves them all.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List

import torch
import torch.distributed as dist
from torch import nn

from .expert_families import ExpertFamily, block_names, family_of_block


class EPGroups:
    """This rank's ep group (consecutive ranks) and expert data-parallel group (the ranks at
    its position in the other ep groups). Only members create a subgroup (local
    synchronization): the trainer's ranks share the job's world with other roles, which
    take no part."""

    def __init__(self, group: dist.ProcessGroup, ep: int, device_type: str = "cpu"):
        from torch.distributed.device_mesh import DeviceMesh

        world, me = dist.get_world_size(group), dist.get_rank(group)
        if ep < 1 or world % ep:
            raise ValueError(f"expert parallel {ep} does not divide the {world} trainer ranks")
        ranks = dist.get_process_group_ranks(group)  # global ranks, in the group's order
        self.ep, self.world, self.edp = ep, world, world // ep
        self.ep_rank = me % ep
        first = me - self.ep_rank
        self.ep_group = self._subgroup(group, ranks, ranks[first:first + ep])
        self.edp_group = self._subgroup(group, ranks, ranks[self.ep_rank::ep]) if self.edp > 1 else None
        self.mesh = DeviceMesh.from_group(self.ep_group, device_type=device_type)

    @staticmethod
    def _subgroup(group: dist.ProcessGroup, ranks: List[int], members: List[int]) -> dist.ProcessGroup:
        if members == ranks:
            return group
        return dist.new_group(members, backend=dist.get_backend(group), use_local_synchronization=True)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows; its gradient goes back with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelExperts(nn.Module):
    """Drop-in for an HF fused experts module: forward(hidden [N, D], top_k_index [N, k],
    top_k_weights [N, k]) -> [N, D], with this rank holding only its block of experts (D: the
    hidden size, or Nemotron-H's latent MoE size). Its parameters keep the replaced module's
    names, so state dicts, checkpoints and the refit see the same names as without ep."""

    def __init__(self, experts: nn.Module, groups: EPGroups, family: ExpertFamily):
        super().__init__()
        from torch.distributed.tensor import DTensor, Shard

        self.num_experts = experts.num_experts
        if self.num_experts % groups.ep:
            raise ValueError(f"{self.num_experts} experts do not split over expert parallel {groups.ep}")
        self.per_rank = self.num_experts // groups.ep
        self.groups, self.act_fn, self.family = groups, experts.act_fn, family
        lo = groups.ep_rank * self.per_rank
        for name in family.fused:
            local = getattr(experts, name).detach()[lo:lo + self.per_rank].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(local, groups.mesh, [Shard(0)], run_check=False)))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        group, ep = self.groups.ep_group, self.groups.ep
        weights = {n: getattr(self, n).to_local() for n in self.family.fused}
        # FSDP2's mixed precision casts the rest of the layer; the experts follow its dtype
        weights = {n: w if w.dtype == hidden.dtype else w.to(hidden.dtype) for n, w in weights.items()}
        k = top_k_index.shape[1]
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, so by owning rank
        token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)[order]
        expert = expert[order]
        send = torch.bincount(expert // self.per_rank, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        local_expert = torch.empty(sum(recv_splits), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(local_expert, (expert % self.per_rank).contiguous(), recv_splits, send_splits, group=group)
        rows = _AllToAll.apply(hidden[token], recv_splits, send_splits, group)
        out = torch.zeros_like(rows)
        # every local expert runs, even on no rows, so that each has a gradient (zeros) on
        # every rank: the expert data-parallel sum then never waits on a missing one
        for j in range(self.per_rank):
            sel = (local_expert == j).nonzero().squeeze(1)
            out = out.index_add(0, sel, self.family.mlp(rows[sel], {n: w[j] for n, w in weights.items()}, self.act_fn))
        back = _AllToAll.apply(out, send_splits, recv_splits, group)
        # weighted and summed in the wider of the two dtypes, as HF's own experts do (Qwen3-MoE:
        # its router's weights are in the hidden dtype; Nemotron-H: fp32 router weights, fp32 sum)
        acc = torch.promote_types(hidden.dtype, top_k_weights.dtype)
        gate = top_k_weights.reshape(-1)[order].to(acc)
        summed = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        return summed.index_add(0, token, back.to(acc) * gate[:, None]).to(hidden.dtype)


def is_moe(model: nn.Module) -> bool:
    return any(family_of_block(m) is not None for m in model.modules())


def shard_experts(model: nn.Module, groups: EPGroups) -> List[nn.Parameter]:
    """Replace every MoE block's experts by this rank's block of them; returns the expert
    parameters (FSDP2 must leave them alone: `fully_shard(..., ignored_params=...)`)."""
    found = [(m, family_of_block(m)) for m in model.modules() if family_of_block(m) is not None]
    if not found:
        raise ValueError(f"expert parallel needs an MoE model ({', '.join(block_names())}); "
                         f"{type(model).__name__} has no MoE block")
    params: List[nn.Parameter] = []
    for block, family in found:
        block.experts = ExpertParallelExperts(block.experts, groups, family)
        params += list(block.experts.parameters())
    return params


def finish_expert_grads(params: Iterable[nn.Parameter], groups: EPGroups) -> None:
    """After the step's backward passes: sum each expert's gradient over its replicas and
    divide by the world size (the mean over every rank's loss, as FSDP2 gives the rest)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad.to_local()
        if groups.edp_group is not None:
            dist.all_reduce(g, group=groups.edp_group)
        g.div_(groups.world)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over parameters that live on different meshes (FSDP2's and
    the experts'): one norm per mesh, made whole, then one coefficient for all."""
    from torch.distributed.tensor import DTensor

    by_mesh: Dict[object, List[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p.grad)
    squares = 0.0
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += float(norm) ** 2
    total = math.sqrt(squares)
    coef = min(max_norm / (total + 1e-6), 1.0)
    for grads in by_mesh.values():
        for g in grads:
            g.mul_(coef)
    return torch.tensor(total)


def expert_param_groups(model: nn.Module, expert_params: List[nn.Parameter]) -> List[dict]:
    """Optimizer groups that never mix meshes in one foreach kernel."""
    ids = {id(p) for p in expert_params}
    return [{"params": [p for p in model.parameters() if id(p) not in ids]}, {"params": list(expert_params)}]



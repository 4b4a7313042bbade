"""Expert parallel for Hugging Face MoE layers in the torch backend (gloo on CPU, NCCL on GPU).

The trainer's ranks form groups of `ep` consecutive ranks (the placement keeps such a group
inside one NVLink domain). Inside a group, rank j holds experts [j*E/ep, (j+1)*E/ep) of every
MoE layer; the router, attention, norms and embeddings stay as they were (FSDP2 over all the
trainer's ranks). A token's hidden state goes to the ranks owning its top-k experts with one
all_to_all, comes back weighted the same way, and the gradients retrace both exchanges.

Expert weights are DTensors Shard(0) over the ep group, so state dicts, checkpoints and the
refit see their global shape and each rank's box. Ranks with the same position in different
ep groups (the expert data-parallel group) hold the same experts: their gradients are summed
there, and every expert gradient is divided by the trainer's world size, which makes it the
mean over all ranks' losses, as FSDP2 makes it for every other weight.

Only HF's fused expert layout is handled (`experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I], as transformers 5 builds Qwen3-MoE in memory).
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# HF classes whose `experts` submodule this module replaces (their router stays)
MOE_BLOCKS = ("Qwen3MoeSparseMoeBlock",)


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
    """Drop-in for an HF fused experts module: forward(hidden [N, H], top_k_index [N, k],
    top_k_weights [N, k]) -> [N, H], with this rank holding only its block of experts."""

    def __init__(self, experts: nn.Module, groups: EPGroups):
        super().__init__()
        from torch.distributed.tensor import DTensor, Shard

        self.num_experts = experts.num_experts
        if self.num_experts % groups.ep:
            raise ValueError(f"{self.num_experts} experts do not split over expert parallel {groups.ep}")
        self.per_rank = self.num_experts // groups.ep
        self.groups, self.act_fn = groups, experts.act_fn
        lo = groups.ep_rank * self.per_rank
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(experts, name).detach()[lo:lo + self.per_rank].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(local, groups.mesh, [Shard(0)], run_check=False)))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        group, ep = self.groups.ep_group, self.groups.ep
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        if gate_up.dtype != hidden.dtype:  # FSDP2's mixed precision casts the rest of the layer
            gate_up, down = gate_up.to(hidden.dtype), down.to(hidden.dtype)
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
            gate, up = F.linear(rows[sel], gate_up[j]).chunk(2, dim=-1)
            out = out.index_add(0, sel, F.linear(self.act_fn(gate) * up, down[j]))
        back = _AllToAll.apply(out, send_splits, recv_splits, group)
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, (back * weights[:, None]).to(hidden.dtype))


def is_moe(model: nn.Module) -> bool:
    return any(type(m).__name__ in MOE_BLOCKS for m in model.modules())


def shard_experts(model: nn.Module, groups: EPGroups) -> List[nn.Parameter]:
    """Replace every MoE block's experts by this rank's block of them; returns the expert
    parameters (FSDP2 must leave them alone: `fully_shard(..., ignored_params=...)`)."""
    found = [m for m in model.modules() if type(m).__name__ in MOE_BLOCKS]
    if not found:
        raise ValueError(f"expert parallel needs an MoE model ({', '.join(MOE_BLOCKS)}); "
                         f"{type(model).__name__} has no MoE block")
    params: List[nn.Parameter] = []
    for block in found:
        block.experts = ExpertParallelExperts(block.experts, groups)
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



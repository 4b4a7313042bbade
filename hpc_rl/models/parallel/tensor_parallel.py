"""DTensor tensor parallel (and sequence parallel) for Hugging Face Llama-style decoders, by
the plan of the model's family (hpc_rl/models/families/: `TensorParallelPlan`).

Megatron's split, expressed with torch's parallel styles: q/k/v, gate and up are column
parallel (each rank keeps whole heads, whole MLP columns), o_proj and down_proj are row
parallel, the embedding is split over the vocabulary (rows) and the lm_head over the
vocabulary too (its logits stay sharded: vocab_logprobs.py reads them without a gather).

With `sequence_parallel` the residual stream between the blocks is sharded over the
sequence (Shard(1)): the norms run on a 1/tp slice of the tokens, and the row-parallel
outputs are reduce-scattered instead of all-reduced; attention and the MLP gather the
sequence at their input. Without it the residual stream is replicated (Replicate DTensors)
and the norms run whole on every rank. Either way every parameter is a DTensor on the tp
mesh, so clipping and the optimizer see one kind of tensor.
"""

from __future__ import annotations


import torch

# the launcher's check (no torch there); the name stays importable from here
from ..checkpoint_check import tp_problems  # noqa: F401

from hpc_rl.models import families
from hpc_rl.models.families.spec import TensorParallelPlan


def plan_of(model: torch.nn.Module) -> TensorParallelPlan:
    """The tensor-parallel plan of the model's family; refuses a family without one
    (validation refuses it earlier: rl/inputs.py _check_family_parallel)."""
    fam = families.of_config(model.config.to_dict())
    if fam is None or fam.tp_plan is None:
        raise ValueError(f"{type(model).__name__}: no tensor-parallel plan for this model's family"
                         + (f" ({fam.parallel_refusal})" if fam is not None else ""))
    return fam.tp_plan


def parallelize(model: torch.nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Turn the model's parameters into DTensors on `tp_mesh`, in place."""
    plan = plan_of(model)
    if sequence_parallel:
        _sequence_parallel_plan(model, tp_mesh, plan)
    else:
        _replicated_stream_plan(model, tp_mesh, plan)
    _head_norms(model, tp_mesh, plan)
    _keep_grad_sharded(model.model.embed_tokens.weight)
    # The rotary cache (inv_freq) is a buffer computed from the config: identical on every rank.


def _keep_grad_sharded(param) -> None:
    """The vocabulary-split embedding's gradient comes back from DTensor's backward as a
    Replicate DTensor: the whole [vocab, hidden] on every rank (measured: torch 2.13). Cut it
    back to the parameter's own rows as soon as it is accumulated (a local slice, no
    communication), so a rank holds 1/tp of it like every other gradient."""

    def hook(p):
        if p.grad is not None and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)

    param.register_post_accumulate_grad_hook(hook)


def _head_norms(model, tp_mesh, plan: TensorParallelPlan) -> None:
    """Per-head norms (Qwen3's q_norm / k_norm, weight [head_dim]) run on the output of a
    column-parallel projection viewed as [batch, seq, heads, head_dim]: this rank's heads.
    Their input is marked Shard(2) (heads), their weight Replicate, so the weight's gradient
    (a sum over every head) is summed over the tp ranks, as the unsharded model's is."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    for layer in model.model.layers:
        for name in plan.head_norms:
            parallelize_module(layer.get_submodule(name), tp_mesh, SequenceParallel(sequence_dim=2, use_local_output=True))


def _sequence_parallel_plan(model, tp_mesh, plan: TensorParallelPlan) -> None:
    """The residual stream as Shard(1) DTensors; norms on their slice of the tokens."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    inner = model.model
    parallelize_module(inner.embed_tokens, tp_mesh,
                       RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False))
    for layer in inner.layers:
        styles = {name: ColwiseParallel() for name in plan.column}
        styles.update({name: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) for name in plan.row})
        styles.update({name: SequenceParallel() for name in plan.norms})
        # attention and the MLP gather the sequence and work on plain local tensors (own heads / columns)
        styles["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                 desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                 use_local_output=True)
        styles["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True)
        parallelize_module(layer, tp_mesh, styles)
    parallelize_module(inner.norm, tp_mesh, SequenceParallel())
    parallelize_module(model.lm_head, tp_mesh,
                       ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False))


def _replicated_stream_plan(model, tp_mesh, plan: TensorParallelPlan) -> None:
    """The residual stream as plain (whole, identical) tensors: torch's classic TP. The norms'
    weights still become Replicate DTensors, wrapped at their input and output, so every
    parameter is a DTensor on the tp mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def into(module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False) for x in inputs)

    def out_of(module, output, mesh):
        return output.to_local()

    inner = model.model
    parallelize_module(inner.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    for layer in inner.layers:
        styles = {name: ColwiseParallel() for name in plan.column}
        styles.update({name: RowwiseParallel() for name in plan.row})
        parallelize_module(layer, tp_mesh, styles)
        for name in plan.norms:
            distribute_module(getattr(layer, name), tp_mesh, input_fn=into, output_fn=out_of)
    distribute_module(inner.norm, tp_mesh, input_fn=into, output_fn=out_of)
    parallelize_module(model.lm_head, tp_mesh,
                       ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False))

"""The vLLM side of a refit, described in Hugging Face names.

vLLM keeps some HF parameters fused: q/k/v live in one `qkv_proj`, gate/up in one
`gate_up_proj`, each tensor-parallel rank holding its slice of every member. The refit
moves HF-named slices, so the destination layout is written in HF names (a TP rank keeps
rows r of q_proj, of k_proj and of v_proj), and `fused_targets` says where each HF slice
lands inside the fused vLLM parameter (which parameter, which shard id, at which offset).

A family whose vLLM model differs from these Llama-style rules says how in its refit hooks
(hpc_rl/models/families/<name>/, `RefitHooks`): Nemotron-H's names, its Mamba mixers'
part-wise splits and its MoE layers' (models/families/nemotron_h/refit_layout.py,
moe_layout.py). Where a split depends on the checkpoint's config rather than on the tensors'
shapes (a Mamba mixer's single B/C group, which vLLM replicates), the layout takes the HF
config (`hf_config`, config.json's mapping).

`check_against_model` compares these names with a live vLLM model at setup, so a trainer
parameter vLLM does not have (or a shape that does not add up) stops the run before any
step, naming the parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hpc_rl.models import families
from hpc_rl.models.families.spec import RefitHooks

from .layout import Layout, LayoutError, Piece, chunk_bounds, megatron_tp_dim, sharded

Specs = Mapping[str, Tuple[Sequence[int], str]]

# HF member -> (vLLM fused module, shard id as vLLM's weight loaders name it)
FUSED_MEMBERS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_MEMBER = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
# One routed expert's tensor, as checkpoints and vLLM's MoE loader name it; vLLM stacks
# every expert of a layer into `...experts.<...>w13_weight` [E, 2I, H] (gate, up) and
# `w2_weight` [E, H, I] (down), and tensor parallel splits I (column gate/up, row down);
# with expert parallel each worker stacks only its own experts, whole (ep_expert_blocks)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


_HOOKS: Tuple[RefitHooks, ...] = tuple(f.refit for f in families.FAMILIES if f.refit is not None)


def _hooks(hf_name: str) -> Optional[RefitHooks]:
    """The refit hooks of the family whose own name this tensor is (None: the common rules)."""
    return next((h for h in _HOOKS if h.owns(hf_name)), None)


def _keeps_fp32(hf_name: str) -> bool:
    return any(h.keeps_fp32(hf_name) for h in _HOOKS)


@dataclass(frozen=True)
class FusedTarget:
    param: str  # the vLLM parameter that holds this HF tensor's slice
    shard_id: object  # "q"/"k"/"v" or 0/1, as vLLM's weight loaders call it
    offset: int  # first row of this member inside the rank's fused parameter
    rows: int  # rows of this member on the rank


def _member(hf_name: str) -> Optional[str]:
    """The HF member of a fused vLLM parameter this tensor is (None: not fused)."""
    if _EXPERT.match(hf_name):
        return None
    if (h := _hooks(hf_name)) is not None:
        return h.fused_member(hf_name)
    m = _MEMBER.search(hf_name)
    return m.group(1) if m else None


def vllm_name(hf_name: str) -> str:
    if (h := _hooks(hf_name)) is not None:
        return h.vllm_name(hf_name)
    m = _MEMBER.search(hf_name)
    if _EXPERT.match(hf_name):  # loaded through the MoE layer's expert mapping, not a fused linear
        return hf_name
    if not m:
        return hf_name
    return hf_name.replace(f".{m.group(1)}.", f".{FUSED_MEMBERS[m.group(1)][0]}.")


VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it
_VOCAB = re.compile(r"(embed_tokens|embeddings|lm_head)\.weight$")  # embeddings: Nemotron-H


def padded_rows_per_rank(vocab: int, tp: int) -> int:
    """Rows of the vocabulary each TP rank of vLLM holds, padding included."""
    return -(-(-(-vocab // VOCAB_PADDING) * VOCAB_PADDING) // tp)


def vocab_bounds(vocab: int, tp: int) -> List[Tuple[int, int]]:
    """vLLM's vocabulary split: the padded vocabulary in equal parts, clipped to the real
    rows (the padding rows exist only on the engine)."""
    per = padded_rows_per_rank(vocab, tp)
    return [(min(r * per, vocab), min((r + 1) * per, vocab)) for r in range(tp)]


def vllm_tp_layout(specs: Specs, ranks: Sequence[int], expert_parallel: bool = False,
                   hf_config: Optional[Mapping] = None) -> Layout:
    """One vLLM engine of tensor parallel len(ranks): column-parallel (and fused members)
    split along dim 0, row-parallel along dim 1, the vocabulary by vLLM's padded split,
    the rest replicated. With `expert_parallel` (vLLM's enable_expert_parallel, data
    parallel 1) each routed expert's tensors go whole to the worker that owns the expert
    (`ep_expert_blocks`); attention, shared experts, router and vocabulary are unchanged.
    The owner loads them by their HF name with its global id: RoutedExperts.weight_loader
    (vllm/model_executor/layers/fused_moe/routed_experts.py) maps the id through the
    worker's expert_map to its local slot, and skips (returns False for) an id the worker
    does not own, so no other worker needs them. `hf_config`: the checkpoint's config.json,
    for the splits its tensors' shapes do not tell (families' refit hooks)."""
    if hf_config is not None and families.resolve(hf_config) is families.GENERIC:
        return whole(specs, ranks)
    experts = {n: v for n, v in specs.items() if expert_parallel and _EXPERT.match(n)}
    # a family's own tensors (Nemotron-H's Mamba mixers and MoE layers): each part split (or
    # replicated) on its own; routed experts under expert parallel go whole to their owner below
    mixers = {n: p for n, (shape, _) in specs.items() if n not in experts and (h := _hooks(n)) is not None
              and (p := h.pieces(n, shape, specs, ranks, hf_config))}
    lay = sharded({n: v for n, v in specs.items() if not _VOCAB.search(n) and n not in experts and n not in mixers},
                  ranks, megatron_tp_dim)
    for name, pieces in mixers.items():  # the families' own tensors: every part on its own
        lay.add(name, specs[name][0], specs[name][1], pieces)
    for name, (shape, dtype) in specs.items():
        if _VOCAB.search(name):
            rest = tuple(shape[1:])
            lay.add(name, shape, dtype, [Piece(r, (a,) + (0,) * len(rest), (b,) + rest)
                                         for r, (a, b) in zip(ranks, vocab_bounds(shape[0], len(ranks)))])
    counts = expert_counts(experts)
    for name, (shape, dtype) in experts.items():
        m = _EXPERT.match(name)
        e = int(m.group("e"))
        owner = next(r for r, (a, b) in zip(ranks, ep_expert_blocks(counts[m.group("prefix")], len(ranks)))
                     if a <= e < b)
        lay.add(name, shape, dtype, [Piece(owner, (0,) * len(shape), tuple(shape))])
    return lay


def whole(specs: Specs, ranks: Sequence[int]) -> Layout:
    """The generic path's destination (models/families/generic/): every tensor whole on every
    worker of the engine, in HF names; vLLM's own loader fuses and slices it for its rank."""
    lay = Layout()
    for name, (shape, dtype) in specs.items():
        lay.add(name, shape, dtype, [Piece(r, (0,) * len(shape), tuple(shape)) for r in ranks])
    return lay


def ep_expert_blocks(num_experts: int, ep: int) -> List[Tuple[int, int]]:
    """The experts [a, b) each expert-parallel rank of vLLM 0.32 holds: its default "linear"
    placement (vllm/config/parallel.py: ParallelConfig.expert_placement_strategy), computed
    in vllm/model_executor/layers/fused_moe/expert_map_manager.py: determine_expert_map as
    contiguous blocks of E // ep, the first E % ep ranks one expert more (its docstring says
    the remainder goes to the last rank; the code gives it to the first ones, and the code
    is what places the weights). "round_robin" is only honoured for grouped-expert models
    (determine_expert_placement_strategy falls back to linear otherwise), so Qwen3-MoE is
    always linear. Under EP vLLM sets ep = its TP size and tp = 1 for the experts
    (fused_moe/config.py: FusedMoEParallelConfig.make), so an expert is never sliced."""
    base, extra = divmod(num_experts, ep)
    starts = [r * base + min(r, extra) for r in range(ep + 1)]
    return list(zip(starts[:-1], starts[1:]))


def expert_counts(specs: Specs) -> Dict[str, int]:
    """Experts per MoE layer (by the `...experts` prefix) among the routed-expert names; the
    ids must run 0..E-1, since vLLM's placement depends on E."""
    ids: Dict[str, set] = {}
    for name in specs:
        m = _EXPERT.match(name)
        if m:
            ids.setdefault(m.group("prefix"), set()).add(int(m.group("e")))
    for prefix, found in ids.items():
        if found != set(range(len(found))):
            raise LayoutError(f"{prefix}: expert ids {sorted(found)} are not 0..{len(found) - 1}; vLLM places "
                              f"experts by their count, so every expert of the layer must be named")
    return {prefix: len(found) for prefix, found in ids.items()}


def fused_targets(specs: Specs, tp_size: int) -> Dict[str, FusedTarget]:
    """For every fused HF member: its place inside the fused vLLM parameter on each rank
    (the same on every rank: members are split evenly)."""
    out: Dict[str, FusedTarget] = {}
    groups: Dict[str, List[str]] = {}
    for name in specs:
        if _member(name):
            groups.setdefault(vllm_name(name), []).append(name)
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    for param, members in groups.items():
        offset = 0
        for name in sorted(members, key=lambda n: order[_member(n)]):
            rows0 = specs[name][0][0]
            if rows0 % tp_size:
                raise LayoutError(f"{name}: {rows0} rows do not split over tensor parallel {tp_size}")
            rows = rows0 // tp_size
            out[name] = FusedTarget(param, FUSED_MEMBERS[_member(name)][1], offset, rows)
            offset += rows
    return out


def check_against_model(specs: Specs, params: Mapping[str, Tuple[Sequence[int], str]], tp_size: int = 1,
                        expert_parallel: bool = False, hf_config: Optional[Mapping] = None) -> None:
    """`params`: the live vLLM model's named parameters (name -> local shape, dtype), as
    its first worker (TP rank 0) reports them. Every HF tensor must land in a vLLM
    parameter, with shapes that add up; raises LayoutError listing every problem.
    `expert_parallel`: the engine runs with enable_expert_parallel (whole experts per
    worker, the first worker holding the first block of `ep_expert_blocks`). `hf_config`: the
    checkpoint's config.json, as vllm_tp_layout takes it."""
    if hf_config is not None and families.resolve(hf_config) is families.GENERIC:
        return  # the generic path: vLLM's own loader places (or refuses) every HF-named tensor
    problems: List[str] = []
    targets = fused_targets(specs, tp_size)
    fused_rows: Dict[str, int] = {}
    blocks = {}
    if expert_parallel:
        blocks = {p: ep_expert_blocks(n, tp_size)[0] for p, n in expert_counts(specs).items()}
    gated = {m.group("prefix") for n in specs if (m := _EXPERT.match(n)) and m.group("kind") == "gate_proj"}
    for name, (shape, dtype) in specs.items():
        if _EXPERT.match(name):
            prefix = _EXPERT.match(name).group("prefix")
            problems += _expert_problems(name, shape, dtype, params, tp_size, blocks.get(prefix), prefix in gated)
            continue
        target = vllm_name(name)
        if target not in params:
            problems.append(f"{name}: vLLM's model has no parameter {target}; is the checkpoint's architecture "
                            f"the one vLLM loaded?")
            continue
        vshape, vdtype = params[target]
        hooks = _hooks(name)
        # parameters vLLM keeps in float32 whatever the engine's dtype (Nemotron-H's A: its loader
        # widens A_log before -exp): a lower-precision tensor loads, rounded
        widened = hooks is not None and hooks.widens(target) and vdtype == "float32"
        router = _keeps_fp32(name)
        if router and dtype != "float32":
            problems.append(f"{name}: dtype {dtype} (trainer side); vLLM keeps the router's weight and correction "
                            f"bias in float32 where it can, and they decide the routing: send them in float32 "
                            f"(the family's refit hooks: keeps_fp32)")
        elif vdtype != dtype and not widened and not router:  # a bf16 router weight: the loader rounds it
            problems.append(f"{name}: dtype {dtype} (trainer side) vs {vdtype} (vLLM's {target}); the refit sends "
                            f"the engine's dtype, so build the source layout with it")
        if name in targets:
            fused_rows[target] = fused_rows.get(target, 0) + targets[name].rows
            if tuple(vshape[1:]) != tuple(shape[1:]):
                problems.append(f"{name}: shape {tuple(shape)} does not fit vLLM's {target} {tuple(vshape)}")
        elif hooks is not None and (local := hooks.local_shape(name, shape, specs, tp_size, hf_config)) is not None:
            if tuple(local) != tuple(vshape):
                problems.append(f"{name}: shape {tuple(shape)} (local {tuple(local)}) vs vLLM's {tuple(vshape)}: "
                                f"the family's split does not match the engine's (a Mamba mixer's groups: vLLM splits "
                                f"them when tensor parallel {tp_size} divides n_groups and replicates a single one; "
                                f"was the checkpoint's config given?)")
        else:
            dim = megatron_tp_dim(name)
            local = list(shape)
            if _VOCAB.search(name):  # the engine's rows include the padding
                local[0] = padded_rows_per_rank(shape[0], tp_size)
            elif dim is not None:
                a, b = chunk_bounds(shape[dim], tp_size)[0]
                local[dim] = b - a
            if tuple(local) != tuple(vshape):
                problems.append(f"{name}: shape {tuple(shape)} (local {tuple(local)}) vs vLLM's {tuple(vshape)}")
    for param, rows in fused_rows.items():
        if params[param][0][0] != rows:
            problems.append(f"{param}: its members add up to {rows} rows, vLLM's parameter has {params[param][0][0]}")
    if problems:
        raise LayoutError("the trainer's weights do not map onto vLLM's model:\n  " + "\n  ".join(problems))


def _expert_problems(name: str, shape: Sequence[int], dtype: str, params: Mapping[str, Tuple[Sequence[int], str]],
                    tp_size: int, block: Optional[Tuple[int, int]] = None, gated: bool = True) -> List[str]:
    """One expert's HF tensor against the layer's stacked vLLM parameter. `block`: under
    expert parallel, the experts [a, b) the checked worker holds, each whole; otherwise
    every expert is on every worker, sliced over tensor parallel. `gated`: the layer's
    experts have gate_proj and up_proj (w13 stacks both); a non-gated layer's (Nemotron-H's
    relu2 experts) w13 holds up_proj alone."""
    m = _EXPERT.match(name)
    down = m.group("kind") == "down_proj"
    suffix = "w2_weight" if down else "w13_weight"
    found = [p for p in params if p.startswith(m.group("prefix") + ".") and p.endswith(suffix)]
    if len(found) != 1:
        return [f"{name}: vLLM's model has no single {m.group('prefix')}.*{suffix} to load it into (found {found})"]
    vshape, vdtype = params[found[0]]
    problems = [] if vdtype == dtype else [f"{name}: dtype {dtype} (trainer side) vs {vdtype} (vLLM's {found[0]})"]
    rows, cols = shape
    split = 1 if block is not None else tp_size
    want = (rows, cols // split) if down else ((2 if gated else 1) * rows // split, cols)
    # under EP a worker stacks only its block, so the global id may exceed its stack
    stacked = block[1] - block[0] if block is not None else None
    fits = len(vshape) == 3 and tuple(vshape[1:]) == want and (
        vshape[0] == stacked if block is not None else int(m.group("e")) < vshape[0])
    if not fits:
        how = (f"expert parallel: {stacked} whole experts of {want}" if block is not None
               else f"per expert {want}")
        problems.append(f"{name}: shape {tuple(shape)} does not fit expert {m.group('e')} of vLLM's {found[0]} "
                        f"{tuple(vshape)} ({how} expected)")
    return problems


def specs_of(state: Mapping[str, object], dtype: Optional[str] = None) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """HF name -> (global shape, dtype name) of a state dict (DTensors report global shapes)."""
    return {k: (tuple(v.shape), dtype or str(v.dtype).split(".")[1]) for k, v in state.items()}


def wire_specs(specs: Mapping[str, Tuple[Sequence[int], object]], engine_dtype: str) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """What the refit sends of each tensor: its shape, in the engine's dtype except where vLLM
    keeps a tensor in float32 whatever the engine's dtype (Nemotron-H's router weight and
    correction bias: rounded to bf16 they would move the routing; check_against_model refuses it)."""
    return {n: (tuple(shape), "float32" if _keeps_fp32(n) else engine_dtype)
            for n, (shape, _) in specs.items()}

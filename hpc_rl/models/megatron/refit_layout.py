"""The refit source side of a Megatron-core trainer, in the Hugging Face names the planner
(hpc_rl/refit/planner.py) and the vLLM side speak, and a vLLM destination with pipeline
stages.

A Megatron rank's tensors map to HF boxes without copies of whole tensors:
  - its `linear_qkv` rows are whole query groups, so they split into one contiguous row
    block of each of q_proj, k_proj, v_proj;
  - its `linear_fc1` rows are its gate block then its up block;
  - an expert's fc1/fc2 on expert-tensor-parallel rank t is row/column block t of that
    expert's gate/up/down, on the expert-parallel rank that owns the expert: etp > 1 is
    just smaller boxes here;
  - the vocabulary rows of a rank are its block of Megatron's padded vocabulary, clipped
    to the real rows (a rank holding only padding sends nothing);
  - a pipeline stage holds its layers' boxes under global layer numbers.
Every context- and data-parallel replica holds the same boxes; the planner picks the
least-loaded one per slice, so replicas share the sending.

`megatron_layout` derives the layout from shapes alone (meta tensors through the same
conversion the backend runs on real tensors), so the source layout and the boxes
`local_hf_shards` hands the transport cannot disagree. `vllm_engine_layout` is an engine
of tensor parallel x pipeline parallel workers, layers split as vLLM splits them.
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from hpc_rl.refit.layout import Layout, LayoutError, Piece, merge
from hpc_rl.refit.vllm_layout import vllm_tp_layout

from hpc_rl.models.families.nemotron_h import megatron_mapping as nemotron_h_mapping
from hpc_rl.models.families.nemotron_h import megatron_refit as nemotron_h_refit
from .hf_mapping import ModelDims, Style, _layer_names, hf_to_megatron, split_qkv, vocab_rows
from hpc_rl.models.families.nemotron_h.megatron_mapping import NemotronHDims
from .shards import Parallel, coords_of, local_state, stage_layers

Start = Tuple[int, ...]
Specs = Mapping[str, Tuple[Sequence[int], str]]
_LOCAL = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def _zeros(t: torch.Tensor) -> Start:
    return tuple(0 for _ in t.shape)


def local_hf_shards(local: Mapping[str, torch.Tensor], d: ModelDims, s: Style, p: Parallel, rank: int
                    ) -> Dict[str, Tuple[Start, torch.Tensor]]:
    """This rank's Megatron tensors (local names) as HF-named boxes: name -> (global
    start, tensor). Views where the rows are contiguous, small copies for q/k/v. Nemotron-H:
    nemotron_h_refit.local_hf_shards (a mixer's in_proj / conv1d as a list of boxes)."""
    if isinstance(d, NemotronHDims):
        return nemotron_h_refit.local_hf_shards(local, d, s, p, rank)
    c = coords_of(rank, p)
    out: Dict[str, Tuple[Start, torch.Tensor]] = {}
    first = stage_layers(d.num_layers, p.pp, c.pp).start
    renames = {}
    for name, t in local.items():
        if name.endswith("_extra_state"):
            continue
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name == "output_layer.weight" and d.tied:
                continue  # the tied model's copy: HF has one tensor, the embedding
            rows = vocab_rows(c.tp, t, d.vocab)  # None: a rank holding only vocabulary padding sends nothing
            if rows:
                out["model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"] = ((rows[0], 0), rows[1])
            continue
        if name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = (_zeros(t), t)
            continue
        m = _LOCAL.match(name)
        if m is None:
            raise LayoutError(f"{name}: not a Megatron GPT parameter this mapping knows")
        layer, suffix = first + int(m.group(1)), m.group(2)
        hp = f"model.layers.{layer}."
        if layer not in renames:
            renames[layer] = {v: k for k, v in _layer_names(d, s, layer).items()}
        e = _LOCAL_EXPERT.match(suffix)
        if e:
            per = d.num_experts // p.ep
            expert = c.ep * per + int(e.group(1) if e.group(1) is not None else e.group(4))
            x = f"{hp}mlp.experts.{expert}."
            if (e.group(2) or e.group(3)) == "linear_fc1":
                gate, up = t.chunk(2)
                out[x + "gate_proj.weight"] = ((c.etp * gate.shape[0], 0), gate)
                out[x + "up_proj.weight"] = ((c.etp * up.shape[0], 0), up)
            else:
                out[x + "down_proj.weight"] = ((0, c.etp * t.shape[1]), t)
        elif suffix.startswith("self_attention.linear_qkv.") and "layer_norm" not in suffix:
            kind = suffix.rsplit(".", 1)[1]
            groups = d.kv_heads // p.tp
            q, k, v = split_qkv(t, groups, d.heads // d.kv_heads * d.head_dim, d.head_dim)
            for part, rows in (("q", q), ("k", k), ("v", v)):
                out[f"{hp}self_attn.{part}_proj.{kind}"] = ((c.tp * rows.shape[0],) + (0,) * (t.dim() - 1), rows)
        elif suffix == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2)
            out[hp + "mlp.gate_proj.weight"] = ((c.tp * gate.shape[0], 0), gate)
            out[hp + "mlp.up_proj.weight"] = ((c.tp * up.shape[0], 0), up)
        elif suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            out[hp + renames[layer][suffix]] = ((0, c.tp * t.shape[1]), t)
        elif suffix in renames[layer]:
            out[hp + renames[layer][suffix]] = (_zeros(t), t)
        else:
            raise LayoutError(f"{name}: no HF counterpart")
    return out


def _meta(specs: Specs) -> Dict[str, torch.Tensor]:
    return {n: torch.empty(tuple(shape), dtype=torch.float32, device="meta") for n, (shape, _) in specs.items()}


def megatron_layout(specs: Specs, d: ModelDims, s: Style, p: Parallel, ranks: Optional[Sequence[int]] = None) -> Layout:
    """The source layout of a Megatron mesh `p` over `ranks` (default 0..world-1, in
    Megatron's rank order) for HF `specs` (name -> (global shape, dtype name))."""
    ranks = list(ranks) if ranks is not None else list(range(p.world))
    if len(ranks) != p.world:
        raise LayoutError(f"{len(ranks)} trainer ranks for a Megatron mesh of {p.world}")
    convert = nemotron_h_mapping.hf_to_megatron if isinstance(d, NemotronHDims) else hf_to_megatron
    whole = convert(_meta(specs), d, s)
    lay = Layout()
    by_key: Dict[tuple, Dict[str, Tuple[Start, torch.Tensor]]] = {}
    for i, rank in enumerate(ranks):
        c = coords_of(i, p)
        key = (c.tp, c.pp, c.etp, c.ep)  # cp, dp and expert-dp replicas hold the same boxes
        if key not in by_key:
            by_key[key] = local_hf_shards(local_state(whole, d, p, i), d, s, p, i)
        for name, boxes in by_key[key].items():
            shape, dtype = specs[name]
            lay.add(name, shape, dtype, [Piece(rank, tuple(start), tuple(a + n for a, n in zip(start, t.shape)))
                                         for start, t in nemotron_h_refit.pieces(boxes)])
    return lay


# -------------------------------------------------------------------- vLLM with pipeline

def vllm_stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """vLLM's default split of layers over pipeline stages (VLLM_PP_LAYER_PARTITION unset):
    equal parts, the remainder one layer each to the stages before the last, from the back
    (tests compare with vllm.distributed.utils.get_pp_indices)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    a = sum(parts[:stage])
    return range(a, a + parts[stage])


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def vllm_engine_layout(specs: Specs, ranks: Sequence[int], tp: int, pp: int, num_layers: int) -> Layout:
    """One vLLM engine of tp x pp workers; worker order is vLLM's (tensor parallel
    fastest: ranks[stage * tp + t]). Stage 0 keeps the embedding, the last stage the final
    norm and lm_head; inside a stage the tensor-parallel split of vllm_tp_layout."""
    if len(ranks) != tp * pp:
        raise LayoutError(f"an engine of tp {tp} x pp {pp} needs {tp * pp} ranks, got {len(ranks)}")
    if pp > 1 and "lm_head.weight" not in specs:
        raise LayoutError("tied embeddings with generator pipeline parallel > 1: the last stage's lm_head would "
                          "need the embedding, which this layout does not send there; use generator.parallel.pp=1")
    stages = []
    for st in range(pp):
        layers = vllm_stage_layers(num_layers, pp, st)
        mine = {}
        for name, v in specs.items():
            m = _HF_LAYER.match(name)
            if m:
                keep = int(m.group(1)) in layers
            elif name == "model.embed_tokens.weight":
                keep = st == 0
            else:  # model.norm, lm_head
                keep = st == pp - 1
            if keep:
                mine[name] = v
        stages.append(vllm_tp_layout(mine, list(ranks[st * tp:(st + 1) * tp])))
    return merge(*stages)


def megatron_refit_setup(specs: Specs, d: ModelDims, s: Style, p: Parallel, n_engines: int, prefix: str,
                         engine_tp: int = 1, engine_pp: int = 1, timeout_s: float = 120.0, domain_of=None,
                         bucket_bytes: int = 64 << 20, transport: str = "torch"):
    """The refit group of a Megatron trainer (refit ranks 0..world-1, Megatron's order)
    and `n_engines` vLLM engines of engine_tp x engine_pp workers (engine g's workers are
    refit ranks world + g*tp*pp + their vLLM rank)."""
    from hpc_rl.refit.session import RefitSetup

    n = p.world
    per = engine_tp * engine_pp
    src = megatron_layout(specs, d, s, p)
    engines = [list(range(n + g * per, n + (g + 1) * per)) for g in range(n_engines)]
    dst = merge(*[vllm_engine_layout(specs, r, engine_tp, engine_pp, d.num_layers) for r in engines])
    names = {i: f"trainer:{i}" for i in range(n)}
    for g, ranks in enumerate(engines):
        names.update({r: f"generator:{g}" + (f"/w{j}" if per > 1 else "") for j, r in enumerate(ranks)})
    return RefitSetup(src=src.to_dict(), dst=dst.to_dict(), proc_of={r: r for r in names}, names=names, prefix=prefix,
                      domain_of=domain_of, bucket_bytes=bucket_bytes, timeout_s=timeout_s, transport=transport)


def layer_count(specs: Specs) -> int:
    return 1 + max((int(m.group(1)) for m in map(_HF_LAYER.match, specs) if m), default=-1)


def ranks_holding(layout: Layout, name: str) -> List[int]:
    return sorted({pc.rank for pc in layout.tensors[name].pieces})

"""Megatron-core's sharding of a whole Megatron state dict: which rank holds which slice,
under its local name (local layer and expert indices). Pure torch.

Rank order is Megatron's default `tp-cp-ep-dp-pp` (tensor parallel varies fastest):
dense weights see rank = tp + TP*(cp + CP*(dp + DP*pp)); expert weights see the expert
mesh rank = etp + ETP*(ep + EP*(edp + EDP*pp)) over the same ranks, where
etp*ep*edp = tp*cp*dp. tests/test_megatron_mapping.py checks both against megatron-core's
own RankGenerator.

How each tensor is split (full Megatron name, whole -> rank):
  vocab   embedding, output layer: rows over tp (the padded vocabulary divides evenly)
  col     linear_qkv weight and bias: rows over tp (whole query groups per rank)
  row     linear_proj, dense linear_fc2: columns over tp
  glu     dense linear_fc1: the gate half and the up half each split over tp, then joined
  eglu    an expert's linear_fc1: as glu, over etp
  erow    an expert's linear_fc2: columns over etp
  (rest)  norms, router: whole on every rank
Nemotron-H (a NemotronHDims, megatron-core's MambaModel) adds:
  parts   a Mamba mixer's in_proj (z, x, B, C, dt rows) and conv1d (x, B, C channels): each
          part split over tp, a rank's pieces joined in that order (mamba_ssm's TP layout)
  col     the mixer's A_log, D, dt_bias (heads) and gated norm (inner rows), the non-gated
          MLP's and shared expert's linear_fc1
  ecol    a non-gated expert's linear_fc1: rows over etp
  row     the mixer's out_proj, the shared expert's linear_fc2
  (rest)  the latent projections (megatron-core duplicates them on every rank), the router
          and its expert bias
Layers go to pipeline stages in equal contiguous blocks; the embedding lives on the first
stage, the final norm and output layer on the last (a tied model's last stage keeps a copy
of the embedding as its output layer when pp > 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .hf_mapping import MappingError, ModelDims
from hpc_rl.models.families.nemotron_h.megatron_mapping import NemotronHDims

Index = Tuple[slice, ...]


@dataclass(frozen=True)
class Parallel:
    """Sizes of one Megatron model's mesh (dp is derived by the caller from the world)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        inner = self.tp * self.cp * self.dp
        if inner % (self.etp * self.ep):
            raise MappingError(f"expert tensor parallel {self.etp} x expert parallel {self.ep} does not divide "
                               f"tp*cp*dp = {inner}")
        return inner // (self.etp * self.ep)


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


def coords_of(rank: int, p: Parallel) -> Coords:
    tp, r = rank % p.tp, rank // p.tp
    cp, r = r % p.cp, r // p.cp
    dp, pp = r % p.dp, r // p.dp
    etp, r = rank % p.etp, rank // p.etp
    ep, r = r % p.ep, r // p.ep
    edp = r % p.edp
    return Coords(tp, cp, dp, pp, etp, ep, edp)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    if num_layers % pp:
        raise MappingError(f"{num_layers} layers do not split evenly over {pp} pipeline stages")
    n = num_layers // pp
    return range(stage * n, (stage + 1) * n)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def _kind(suffix: str, layer: bool, d: Optional[ModelDims] = None) -> Tuple[Optional[str], Tuple[int, ...]]:
    """(split kind, part sizes for kind "parts" / "glu") of a Megatron tensor."""
    if not layer:
        return ("vocab" if suffix in ("embedding.word_embeddings.weight", "output_layer.weight") else None), ()
    hybrid = isinstance(d, NemotronHDims)
    m = _EXPERT.match(suffix)
    if m:
        fc = m.group(2) or m.group(3)
        return ("erow" if fc == "linear_fc2" else "ecol" if hybrid else "eglu"), ()
    if suffix.startswith("self_attention.linear_qkv.") and suffix.endswith(("weight", "bias")) and "layer_norm" not in suffix:
        return "col", ()
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return "row", ()
    if suffix == "mlp.linear_fc1.weight":
        return ("col", ()) if hybrid else ("glu", ())
    if hybrid:
        if suffix == "mixer.in_proj.weight":
            return "parts", d.in_proj_parts()
        if suffix in ("mixer.conv1d.weight", "mixer.conv1d.bias"):
            return "parts", d.conv_parts()
        if suffix in ("mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight",
                      "mlp.shared_experts.linear_fc1.weight"):
            return "col", ()
        if suffix in ("mixer.out_proj.weight", "mlp.shared_experts.linear_fc2.weight"):
            return "row", ()
    return None, ()


def _split(shape: Tuple[int, ...], kind: Optional[str], tp: int, rank: int,
           parts: Tuple[int, ...] = ()) -> List[Tuple[Index, Index]]:
    """(whole index, local index) pairs for the slices rank `rank` of `tp` holds."""
    full = tuple(slice(0, n) for n in shape)
    if kind is None or tp == 1:
        return [(full, full)]
    if kind in ("vocab", "col", "row", "erow", "ecol"):
        dim = 1 if kind in ("row", "erow") else 0
        if shape[dim] % tp:
            raise MappingError(f"dimension {dim} of {shape} does not split over {tp} ranks")
        n = shape[dim] // tp
        whole, local = list(full), list(full)
        whole[dim], local[dim] = slice(rank * n, (rank + 1) * n), slice(0, n)
        return [(tuple(whole), tuple(local))]
    # glu / eglu: the gate rows, then the up rows; parts: a Mamba mixer's in_proj / conv1d
    sizes = parts if kind == "parts" else (shape[0] // 2, shape[0] // 2)
    if any(n % tp for n in sizes):
        raise MappingError(f"parts of {list(sizes)} rows do not split over {tp} ranks")
    rest, out, whole_at, local_at = full[1:], [], 0, 0
    for size in sizes:
        n = size // tp
        out.append(((slice(whole_at + rank * n, whole_at + (rank + 1) * n),) + rest, (slice(local_at, local_at + n),) + rest))
        whole_at, local_at = whole_at + size, local_at + n
    return out


def placement(name: str, shape: Tuple[int, ...], d: ModelDims, p: Parallel, c: Coords,
              tied_output: bool = False) -> Optional[Tuple[str, List[Tuple[Index, Index]], Tuple[int, ...]]]:
    """Where a whole-model Megatron tensor sits on the rank at `c`: (its local name, the
    (whole, local) index pairs, the local shape), or None when the rank does not hold it."""
    m = _LAYER.match(name)
    last = c.pp == p.pp - 1
    if m is None:
        if name.startswith("embedding."):
            on = c.pp == 0
        elif name == "output_layer.weight" or name.startswith(("decoder.final_layernorm", "decoder.final_norm")):
            on = last and (name != "output_layer.weight" or not d.tied or tied_output)
        else:
            raise MappingError(f"{name}: not a Megatron GPT parameter this mapping knows")
        if not on:
            return None
        (kind, parts), tp, rank, local = _kind(name, False), p.tp, c.tp, name
    else:
        layer, suffix = int(m.group(1)), m.group(2)
        layers = stage_layers(d.num_layers, p.pp, c.pp)
        if layer not in layers:
            return None
        kind, parts = _kind(suffix, True, d)
        tp, rank = (p.etp, c.etp) if kind in ("eglu", "erow", "ecol") else (p.tp, c.tp)
        e = _EXPERT.match(suffix)
        if e:
            expert = int(e.group(1) if e.group(1) is not None else e.group(4))
            per = d.num_experts // p.ep
            if expert // per != c.ep:
                return None
            le = expert % per
            suffix = (f"mlp.experts.local_experts.{le}.{e.group(2)}.weight" if e.group(1) is not None
                      else f"mlp.experts.{e.group(3)}.weight{le}")
        local = f"decoder.layers.{layer - layers.start}.{suffix}"
    pairs = _split(tuple(shape), kind, tp, rank, parts)
    lshape = tuple(max(s.stop for _, loc in pairs for s in [loc[k]]) for k in range(len(shape)))
    return local, pairs, lshape


def local_state(whole: Mapping[str, torch.Tensor], d: ModelDims, p: Parallel, rank: int) -> Dict[str, torch.Tensor]:
    """The state dict Megatron's model on `rank` has (local names, local slices)."""
    if d.num_experts and d.num_experts % p.ep:
        raise MappingError(f"{d.num_experts} experts do not divide over expert parallel {p.ep}")
    c = coords_of(rank, p)
    out: Dict[str, torch.Tensor] = {}
    tied_copy = d.tied and p.pp > 1 and "output_layer.weight" not in whole
    for name, t in whole.items():
        where = placement(name, tuple(t.shape), d, p, c)
        if where is None:
            continue
        local, pairs, lshape = where
        buf = t.new_empty(lshape)
        for w, loc in pairs:
            buf[loc] = t[w]
        out[local] = buf
    if tied_copy and c.pp == p.pp - 1:
        # a tied model's last stage holds its own copy of the embedding as the output layer
        where = placement("embedding.word_embeddings.weight", tuple(whole["embedding.word_embeddings.weight"].shape),
                          d, p, Coords(c.tp, c.cp, c.dp, 0, c.etp, c.ep, c.edp))
        _, pairs, lshape = where
        buf = whole["embedding.word_embeddings.weight"].new_empty(lshape)
        for w, loc in pairs:
            buf[loc] = whole["embedding.word_embeddings.weight"][w]
        out["output_layer.weight"] = buf
    return out


def gather(locals_: Mapping[int, Mapping[str, torch.Tensor]], specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
           d: ModelDims, p: Parallel) -> Dict[str, torch.Tensor]:
    """Every rank's local state dict -> the whole Megatron state dict of `specs` (whole
    name -> shape, dtype). Raises MappingError when an element is held by no rank or two
    ranks disagree on it."""
    out = {n: torch.empty(shape, dtype=dt) for n, (shape, dt) in specs.items()}
    seen = {n: torch.zeros(shape, dtype=torch.bool) for n, (shape, _) in specs.items()}
    for rank, state in locals_.items():
        c = coords_of(rank, p)
        for name, (shape, _) in specs.items():
            where = placement(name, tuple(shape), d, p, c)
            if where is None:
                continue
            local, pairs, _ = where
            t = state[local]
            for w, loc in pairs:
                if seen[name][w].any() and not torch.equal(out[name][w][seen[name][w]], t[loc][seen[name][w]]):
                    raise MappingError(f"{name}: rank {rank} disagrees with another replica")
                out[name][w] = t[loc]
                seen[name][w] = True
    missing = [n for n, s in seen.items() if not bool(s.all())]
    if missing:
        raise MappingError(f"no rank holds all of {missing[:4]}")
    return out


# The process groups megatron-core's ProcessGroupCollection names, as lists of mesh ranks:
# name -> (the mesh, the coordinates that vary inside one group).
_GROUPS = {
    "tp": ("dense", ("tp",)), "cp": ("dense", ("cp",)), "dp": ("dense", ("dp",)), "pp": ("dense", ("pp",)),
    "tp_cp": ("dense", ("tp", "cp")), "dp_cp": ("dense", ("dp", "cp")), "mp": ("dense", ("tp", "pp")),
    "tp_dp_cp": ("dense", ("tp", "dp", "cp")),
    "ep": ("expert", ("ep",)), "expt_tp": ("expert", ("etp",)), "expt_dp": ("expert", ("edp",)),
    "tp_ep": ("expert", ("etp", "ep")), "tp_ep_pp": ("expert", ("etp", "ep", "pp")),
}
_MESH = {"dense": ("tp", "cp", "dp", "pp"), "expert": ("etp", "ep", "edp", "pp")}


def mesh_groups(p: Parallel) -> Dict[str, List[List[int]]]:
    """Every group of every kind (ranks ascending, groups in order of their lowest rank);
    `embd` joins the first and last pipeline stage, `pos_embd` is the first stage alone."""
    coords = [coords_of(r, p) for r in range(p.world)]
    out: Dict[str, List[List[int]]] = {}
    for name, (mesh, vary) in _GROUPS.items():
        fixed = [a for a in _MESH[mesh] if a not in vary]
        by: Dict[tuple, List[int]] = {}
        for r, c in enumerate(coords):
            by.setdefault(tuple(getattr(c, a) for a in fixed), []).append(r)
        out[name] = sorted(by.values())
    last = p.pp - 1
    out["embd"] = [sorted({g[0], g[-1]}) for g in out["pp"]] if last else [[g[0]] for g in out["pp"]]
    out["pos_embd"] = [[g[0]] for g in out["pp"]]
    return out

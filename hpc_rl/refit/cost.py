"""Refit at scale: a vectorised plan over regular layouts, and its time on stated links.

A 671B model under PP16 x EP16 -> TP32 x DP8 is about 45,000 expert tensors with 256
destination pieces each: millions of slice transfers, far beyond a cell-by-cell Python
planner. Here layouts are regular: each tensor is cut into even parts along one dimension
(or kept whole), and each part is held by the same number of replicas. Tensors of one
shape and placement are planned together as numpy arrays, so planning such a model takes
seconds.

The routing rules are the exact planner's (planner.py): a destination domain that holds a
byte already takes it from there; otherwise the byte crosses into the domain once, to one
landing rank that keeps it, which forwards it to the domain's other ranks over NVLink.
Replicas and landing ranks are chosen by rotation (tensor and cell index), not by running
load counters, so the choice is vectorisable and still deterministic; both spread bytes
evenly across replicas.

The cost model charges each GPU's NVLink and its inter-domain NIC (InfiniBand) per
direction: predicted time = the busiest link direction over the whole refit (buckets
pipeline the landing and forwarding stages), next to the stage-by-stage sum and a physical
lower bound. It covers moving the bytes; each engine's weight processing comes on top.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .layout import chunk_bounds
from .vllm_layout import vocab_bounds


@dataclass(frozen=True)
class Links:
    name: str
    nvlink_GBps: float  # per GPU per direction, inside an NVLink domain
    ib_GBps: float  # per GPU per direction, between domains
    gpus_per_domain: int  # GPUs a job uses in one NVLink domain


# A GB200 NVL72 rack: 16 of its 18 compute trays are used (the placement keeps 2 spare), 4 GPUs each
GB200 = Links("GB200 NVL72 (NVLink 900 GB/s per GPU per direction in a rack, IB 50 GB/s per GPU between racks)",
              900.0, 50.0, 64)
H100 = Links("H100 (NVLink 450 GB/s per GPU per direction in a node, IB 50 GB/s per GPU between nodes)", 450.0, 50.0, 8)


@dataclass
class Group:
    """Tensors of one shape and placement kind. src: [T, parts, replicas] ranks per tensor;
    dst: [parts, replicas] ranks (the same for every tensor of the group)."""

    label: str
    shape: Tuple[int, ...]
    itemsize: int
    src_dim: Optional[int]
    src_bounds: List[Tuple[int, int]]
    src: np.ndarray
    dst_dim: Optional[int]
    dst_bounds: List[Tuple[int, int]]
    dst: np.ndarray

    @property
    def count(self) -> int:
        return self.src.shape[0]


@dataclass
class ScalePlan:
    ranks: int
    send: Dict[Tuple[str, int], np.ndarray]  # (link, stage) -> bytes sent per rank; link "nvlink" | "ib"
    recv: Dict[Tuple[str, int], np.ndarray]
    transfers: int = 0  # slice transfers (cells; the exact planner merges neighbours)
    tensors: int = 0
    bytes_model: int = 0
    kept: Optional[np.ndarray] = None  # bytes each destination rank keeps
    planning_s: float = 0.0

    def total(self, which: str, link: str) -> np.ndarray:
        d = self.send if which == "send" else self.recv
        return d[(link, 0)] + d[(link, 1)]


def _cells(shape, src_dim, src_bounds, dst_dim, dst_bounds, itemsize):
    """(src part, dst part, bytes) of every cell of the grid both placements cut."""
    if src_dim is not None and dst_dim is not None and src_dim != dst_dim:
        rest = itemsize
        for d, n in enumerate(shape):
            if d not in (src_dim, dst_dim):
                rest *= n
        return [(i, j, (a1 - a0) * (b1 - b0) * rest)
                for i, (a0, a1) in enumerate(src_bounds) for j, (b0, b1) in enumerate(dst_bounds)
                if a1 > a0 and b1 > b0]
    dim = src_dim if src_dim is not None else dst_dim
    if dim is None:
        return [(0, 0, int(np.prod(shape)) * itemsize)]
    rest = itemsize
    for d, n in enumerate(shape):
        if d != dim:
            rest *= n
    sb = src_bounds if src_dim is not None else [(0, shape[dim])]
    db = dst_bounds if dst_dim is not None else [(0, shape[dim])]
    cuts = sorted({c for a, b in sb + db for c in (a, b)})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        if hi <= lo:
            continue
        i = next(k for k, (a, b) in enumerate(sb) if a <= lo < b)
        j = next(k for k, (a, b) in enumerate(db) if a <= lo < b)
        out.append((i, j, (hi - lo) * rest))
    return out


def plan_scale(groups: Sequence[Group], domain_of: np.ndarray) -> ScalePlan:
    """Per-rank bytes per link and stage for every tensor of `groups`. `domain_of[rank]` is
    an integer domain id for every rank of both sides."""
    t0 = time.perf_counter()
    n = len(domain_of)
    plan = ScalePlan(n, {(l, s): np.zeros(n) for l in ("nvlink", "ib") for s in (0, 1)},
                     {(l, s): np.zeros(n) for l in ("nvlink", "ib") for s in (0, 1)}, kept=np.zeros(n))
    offset = 0
    for g in groups:
        T, _, r_src = g.src.shape
        rot_base = np.arange(T) + offset
        offset += T
        plan.tensors += T
        plan.bytes_model += T * int(np.prod(g.shape)) * g.itemsize
        for ci, (sp, dp, nb) in enumerate(_cells(g.shape, g.src_dim, g.src_bounds, g.dst_dim, g.dst_bounds, g.itemsize)):
            holders = g.src[:, sp, :]  # [T, r_src]
            hdom = domain_of[holders]
            needers = g.dst[dp]
            ndom = domain_of[needers]
            np.add.at(plan.kept, needers, nb * T)
            rot = rot_base + ci
            shift = rot % r_src
            idx = (np.arange(r_src)[None, :] + shift[:, None]) % r_src
            rows = np.arange(T)
            for d in np.unique(ndom):
                want = needers[ndom == d]
                local = np.take_along_axis(hdom == d, idx, 1)
                has_local = local.any(1)
                # a holder inside the domain: it sends directly to every rank that needs the cell
                if has_local.any():
                    chosen = holders[rows, idx[rows, local.argmax(1)]][has_local]
                    plan.send[("nvlink", 0)] += np.bincount(chosen, minlength=n) * nb * len(want)
                    plan.recv[("nvlink", 0)][want] += nb * int(has_local.sum())
                    plan.transfers += int(has_local.sum()) * len(want)
                remote = ~has_local
                k = int(remote.sum())
                if not k:
                    continue
                src = holders[rows, shift][remote]
                landing = want[rot[remote] % len(want)]
                plan.send[("ib", 0)] += np.bincount(src, minlength=n) * nb
                land_count = np.bincount(landing, minlength=n)
                plan.recv[("ib", 0)] += land_count * nb
                plan.transfers += k * len(want)
                if len(want) > 1:  # forwards over NVLink to the domain's other ranks
                    plan.send[("nvlink", 1)] += land_count * nb * (len(want) - 1)
                    plan.recv[("nvlink", 1)][want] += nb * (k - land_count[want])
    plan.planning_s = time.perf_counter() - t0
    return plan


def predict(plan: ScalePlan, links: Links, src_ranks: np.ndarray, dst_ranks: np.ndarray, domain_of: np.ndarray) -> dict:
    """Seconds to move the plan's bytes on `links`, and a lower bound for any plan."""
    bw = {"nvlink": links.nvlink_GBps * 1e9, "ib": links.ib_GBps * 1e9}

    def busiest(stages):
        loads = []
        for link in ("nvlink", "ib"):
            for d in (plan.send, plan.recv):
                loads.append(sum(d[(link, s)] for s in stages) / bw[link])
        per_rank = np.max(np.stack(loads), axis=0)
        return float(per_rank.max()), int(per_rank.argmax())

    pipelined, worst = busiest((0, 1))
    staged = busiest((0,))[0] + busiest((1,))[0]
    # Lower bound for any plan with these layouts and links:
    #  - each destination GPU takes in the bytes it keeps, at best at NVLink speed;
    #  - a destination domain takes in, over its GPUs' NICs, every byte its ranks need and
    #    no rank of the domain already holds (the plan brings each such byte in once);
    #  - those bytes leave source GPUs through their NICs.
    ib_in = plan.recv[("ib", 0)]
    gpu_in = float(plan.kept[dst_ranks].max()) / bw["nvlink"]
    by_domain = {}
    for d in np.unique(domain_of[dst_ranks]):
        ranks = dst_ranks[domain_of[dst_ranks] == d]
        by_domain[int(d)] = float(ib_in[ranks].sum()) / (bw["ib"] * len(ranks))
    domain_in = max(by_domain.values()) if by_domain else 0.0
    src_out = float(ib_in.sum()) / (bw["ib"] * len(src_ranks))
    return {"links": links.name, "predicted_s": pipelined, "stage_by_stage_s": staged,
            "lower_bound_s": max(gpu_in, domain_in, src_out),
            "lower_bound_parts_s": {"dst_gpu_ingress": gpu_in, "dst_domain_ingress": domain_in, "src_egress": src_out},
            "busiest_rank": worst, "inter_domain_bytes": float(ib_in.sum()),
            "nvlink_bytes": float(plan.recv[("nvlink", 0)].sum() + plan.recv[("nvlink", 1)].sum())}


# ------------------------------------------------------------------------------------ models

def to_layouts(groups: Sequence[Group], dtype: str = "bfloat16"):
    """The exact planner's layouts of small groups (tests compare the two planners)."""
    from .layout import Layout, Piece

    src, dst = Layout(), Layout()

    def boxes(shape, dim, bounds):
        if dim is None:
            return [((0,) * len(shape), tuple(shape))]
        out = []
        for a, b in bounds:
            lo, hi = [0] * len(shape), list(shape)
            lo[dim], hi[dim] = a, b
            out.append((tuple(lo), tuple(hi)))
        return out

    for g in groups:
        for t in range(g.count):
            name = f"{g.label}.{t}"
            for part, (lo, hi) in enumerate(boxes(g.shape, g.src_dim, g.src_bounds)):
                src.add(name, g.shape, dtype, [Piece(int(r), lo, hi) for r in g.src[t, part]])
            for part, (lo, hi) in enumerate(boxes(g.shape, g.dst_dim, g.dst_bounds)):
                dst.add(name, g.shape, dtype, [Piece(int(r), lo, hi) for r in g.dst[part]])
    return src, dst


def _g(label, shape, src_dim, src_bounds, src, dst_dim, dst_bounds, dst, itemsize=2) -> Group:
    return Group(label, tuple(shape), itemsize, src_dim, src_bounds, np.asarray(src, dtype=np.int64), dst_dim,
                 dst_bounds, np.asarray(dst, dtype=np.int64))


def _tp_dst(first: int, tp: int, dp: int) -> np.ndarray:
    """[tp, dp] ranks of dp vLLM instances of TP tp: part p lives on rank p of each instance."""
    return np.array([[first + i * tp + p for i in range(dp)] for p in range(tp)])


def deepseek_v3_groups(links: Links, tp: int = 32, dp: int = 8, pp: int = 16, ep: int = 16) -> Tuple[List[Group], dict]:
    """DeepSeek-V3 (61 layers, 3 dense then 58 MoE, hidden 7168, 256 routed + 1 shared
    expert of FFN 2048, dense FFN 18432, vocab 129280, MLA: q_lora 1536, kv_lora 512,
    128 heads of 128 + 64 rope dims, value 128), BF16. Trainer: PP16 x EP16 (TP 1), layers
    in balanced stages, experts in blocks of 16 per EP rank, the rest replicated over the
    16 ranks of its stage. vLLM: TP32 x DP8 (experts split along FFN by TP)."""
    H, V, E, F_E, F_D, L, DENSE = 7168, 129280, 256, 2048, 18432, 61, 3
    q_lora, kv_lora, heads, nope, rope, vdim = 1536, 512, 128, 128, 64, 128
    n_src = pp * ep
    per = [L // pp + (1 if s < L % pp else 0) for s in range(pp)]
    stage_of = np.repeat(np.arange(pp), per)
    stage_ranks = np.arange(n_src).reshape(pp, ep)  # [stage, ep]
    dst_first = n_src
    groups: List[Group] = []

    def dense(label, shape, layers, dst_dim, dst_bounds=None):
        src = stage_ranks[stage_of[layers]][:, None, :]  # [T, 1 part, ep replicas]
        if dst_dim is None:
            dst = np.arange(dst_first, dst_first + tp * dp)[None, :]
            bounds = []
        else:
            dst = _tp_dst(dst_first, tp, dp)
            bounds = dst_bounds or chunk_bounds(shape[dst_dim], tp)
        groups.append(_g(label, shape, None, [], src, dst_dim, bounds, dst))

    all_layers = np.arange(L)
    moe_layers = np.arange(DENSE, L)
    for label, shape, dim in [
        ("input_layernorm", (H,), None), ("post_attention_layernorm", (H,), None),
        ("q_a_proj", (q_lora, H), None), ("q_a_layernorm", (q_lora,), None),
        ("q_b_proj", (heads * (nope + rope), q_lora), 0), ("kv_a_proj_with_mqa", (kv_lora + rope, H), None),
        ("kv_a_layernorm", (kv_lora,), None), ("kv_b_proj", (heads * (nope + vdim), kv_lora), 0),
        ("o_proj", (H, heads * vdim), 1),
    ]:
        dense(label, shape, all_layers, dim)
    dense_layers = np.arange(DENSE)
    for label, shape, dim in [("mlp.gate_proj", (F_D, H), 0), ("mlp.up_proj", (F_D, H), 0), ("mlp.down_proj", (H, F_D), 1)]:
        dense(label, shape, dense_layers, dim)
    for label, shape, dim in [("shared_experts.gate_proj", (F_E, H), 0), ("shared_experts.up_proj", (F_E, H), 0),
                              ("shared_experts.down_proj", (H, F_E), 1), ("mlp.gate", (E, H), None),
                              ("e_score_correction_bias", (E,), None)]:
        dense(label, shape, moe_layers, dim)
    # routed experts: one owner each (its stage's EP rank e // (E / ep))
    owners = stage_ranks[stage_of[moe_layers]][:, np.arange(E) // (E // ep)].reshape(-1)  # [layers * E]
    src = owners[:, None, None]
    for label, shape, dim in [("experts.gate_proj", (F_E, H), 0), ("experts.up_proj", (F_E, H), 0),
                              ("experts.down_proj", (H, F_E), 1)]:
        groups.append(_g(label, shape, None, [], src, dim, chunk_bounds(shape[dim], tp), _tp_dst(dst_first, tp, dp)))
    # embeddings on the first stage, final norm and head on the last; vLLM pads the vocabulary
    for label, stage, dim in [("embed_tokens", 0, 0), ("lm_head", pp - 1, 0)]:
        groups.append(_g(label, (V, H), None, [], stage_ranks[stage][None, None, :], dim, vocab_bounds(V, tp),
                         _tp_dst(dst_first, tp, dp)))
    groups.append(_g("norm", (H,), None, [], stage_ranks[pp - 1][None, None, :], None, [],
                     np.arange(dst_first, dst_first + tp * dp)[None, :]))
    n = n_src + tp * dp
    domain = _domains(n_src, tp * dp, links)
    meta = {"trainer": f"PP{pp} x EP{ep} ({n_src} GPUs)", "vllm": f"TP{tp} x DP{dp} ({tp * dp} GPUs)",
            "src_ranks": np.arange(n_src), "dst_ranks": np.arange(n_src, n), "domain_of": domain}
    return groups, meta


def _domains(n_src: int, n_dst: int, links: Links) -> np.ndarray:
    """Ranks in order, trainer first then vLLM, filling whole domains (a GB200 rack's 64
    used GPUs, an H100 node's 8). The two sides never share a domain."""
    per = links.gpus_per_domain
    src = np.arange(n_src) // per
    dst = src.max() + 1 + np.arange(n_dst) // per
    return np.concatenate([src, dst])


def ultra_groups(links: Links) -> Tuple[List[Group], dict]:
    """The ultra_mopd plan on a 550B-parameter MoE stand-in (NVIDIA publishes the total; the
    split is assumed): 60 MoE layers of 128 routed experts (FFN 2816, hidden 8192) and 60
    mixer layers (in 34816 x 8192, out 8192 x 16384), vocab 131072, BF16: 558B parameters.
    Trainer: TP8 x CP32 over 256 GPUs (64 nodes), experts EP64 x ETP1 (so 4 expert data-
    parallel replicas, one per rack: the placement keeps each EP group in a rack), dense
    weights TP-split and replicated over the 32 CP ranks. vLLM: 64 instances of TP8 / EP8
    (2 nodes each, 128 nodes), dense weights TP-split, experts whole on their EP rank."""
    H, V, E, F_E, L = 8192, 131072, 128, 2816, 60
    tp, cp, ep, n_inst, inst_tp = 8, 32, 64, 64, 8
    n_src = tp * cp
    edp = n_src // ep
    dst_first = n_src
    n_dst = n_inst * inst_tp
    groups: List[Group] = []
    # dense: trainer rank = cp_rank * tp + tp_rank; part p on ranks {c * tp + p}
    src_tp = np.array([[c * tp + p for c in range(cp)] for p in range(tp)])  # [tp parts, cp replicas]
    dst_tp = _tp_dst(dst_first, inst_tp, n_inst)

    def tp_dense(label, shape, src_dim, dst_dim, count, src_bounds=None, dst_bounds=None):
        src = np.broadcast_to(src_tp, (count,) + src_tp.shape) if src_dim is not None else \
            np.broadcast_to(np.arange(n_src)[None, :], (count, 1, n_src))
        dst = dst_tp if dst_dim is not None else np.arange(dst_first, dst_first + n_dst)[None, :]
        groups.append(_g(label, shape, src_dim, src_bounds or (chunk_bounds(shape[src_dim], tp) if src_dim is not None else []),
                         np.ascontiguousarray(src), dst_dim,
                         dst_bounds or (chunk_bounds(shape[dst_dim], inst_tp) if dst_dim is not None else []), dst))

    tp_dense("mixer.in_proj", (34816, H), 0, 0, L)
    tp_dense("mixer.out_proj", (H, 16384), 1, 1, L)
    tp_dense("norms", (H,), None, None, 2 * L)
    tp_dense("router", (E, H), None, None, L)
    tp_dense("embed_tokens", (V, H), 0, 0, 1, dst_bounds=vocab_bounds(V, inst_tp))
    tp_dense("lm_head", (V, H), 0, 0, 1, dst_bounds=vocab_bounds(V, inst_tp))
    # experts: EP rank k of replica r is trainer rank r * ep + k (one rack per replica)
    per_src = E // ep
    owner_sets = np.array([[r * ep + e // per_src for r in range(edp)] for e in range(E)])  # [E, edp]
    src = np.tile(owner_sets, (L, 1))[:, None, :]  # [L * E, 1, edp]
    per_dst = E // inst_tp
    # vLLM EP8 inside each instance: expert e whole on rank e // per_dst of every instance
    dst_by_expert = np.array([[dst_first + i * inst_tp + e // per_dst for i in range(n_inst)] for e in range(E)])
    for label, shape in [("experts.gate_proj", (F_E, H)), ("experts.up_proj", (F_E, H)), ("experts.down_proj", (H, F_E))]:
        for e in range(E):  # the destination set differs by expert: one group per expert index
            groups.append(_g(label, shape, None, [], src[e::E], None, [], dst_by_expert[e][None, :]))
    domain = _domains(n_src, n_dst, links)
    meta = {"trainer": f"TP{tp} x CP{cp}, EP{ep} ({n_src} GPUs, 64 nodes)",
            "vllm": f"{n_inst} instances of TP{inst_tp}/EP{inst_tp} ({n_dst} GPUs, 128 nodes)",
            "src_ranks": np.arange(n_src), "dst_ranks": np.arange(n_src, n_src + n_dst), "domain_of": domain}
    return groups, meta


NVIDIA_REFERENCE = {
    ("deepseek_v3", "gb200"): "1.93-2.59 s (NVIDIA, measured)",
    ("deepseek_v3", "h100"): "2.39-2.83 s (NVIDIA, measured)",
    ("ultra_mopd", "gb200"): "2.32 s (NVIDIA, its Ultra reshard)",
}


def scale_report() -> dict:
    """Plan and predict every case; planning time includes building the layouts."""
    out = {}
    for model, build in (("deepseek_v3", deepseek_v3_groups), ("ultra_mopd", ultra_groups)):
        for cluster, links in (("gb200", GB200), ("h100", H100)):
            if model == "ultra_mopd" and cluster == "h100":
                continue  # the recipe targets GB200 racks
            t0 = time.perf_counter()
            groups, meta = build(links)
            plan = plan_scale(groups, meta["domain_of"])
            planning_s = time.perf_counter() - t0
            pred = predict(plan, links, meta["src_ranks"], meta["dst_ranks"], meta["domain_of"])
            out[f"{model}/{cluster}"] = {
                "trainer": meta["trainer"], "vllm": meta["vllm"], "tensors": plan.tensors,
                "model_bytes": plan.bytes_model, "params_b": plan.bytes_model / 2 / 1e9,
                "slice_transfers": plan.transfers, "planning_s": planning_s, "planning_goal_s": 10.0,
                **pred, "nvidia": NVIDIA_REFERENCE.get((model, cluster)),
                "goal_s": 1.0 if model == "ultra_mopd" else None,
            }
    return out

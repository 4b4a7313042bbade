"""The vectorised scale planner and cost model: it agrees with the exact planner on what
does not depend on how replicas are balanced, its link arithmetic is checked by hand on a
case small enough to reason about, and the DeepSeek-V3 / Ultra layouts plan in seconds."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from hpc_rl.refit.cost import GB200, Links, _g, deepseek_v3_groups, plan_scale, predict, scale_report, to_layouts
from hpc_rl.refit.layout import chunk_bounds
from hpc_rl.refit.planner import plan_refit

TINY_LINKS = Links("test links", nvlink_GBps=100.0, ib_GBps=10.0, gpus_per_domain=2)


def _small_groups():
    """Trainer: 4 ranks (2 domains), TP2 x 2 replicas for dense weights, 8 experts with one
    owner each. vLLM: 2 instances of TP2 in domain 2, plus one in domain 3."""
    dst_first = 4
    tp_src = np.array([[0, 2], [1, 3]])  # part p on ranks p and p + 2
    dst_tp = np.array([[dst_first + i * 2 + p for i in range(3)] for p in range(2)])
    groups = [
        _g("dense.col", (8, 6), 0, chunk_bounds(8, 2), np.broadcast_to(tp_src, (3, 2, 2)).copy(), 0, chunk_bounds(8, 2), dst_tp),
        _g("dense.row", (6, 8), 0, chunk_bounds(6, 2), np.broadcast_to(tp_src, (2, 2, 2)).copy(), 1, chunk_bounds(8, 2), dst_tp),
        _g("norm", (6,), None, [], np.array([[[0, 1, 2, 3]]] * 2), None, [], np.arange(dst_first, dst_first + 6)[None, :]),
        _g("experts", (4, 6), None, [], (np.arange(8) % 4)[:, None, None], 0, chunk_bounds(4, 2), dst_tp),
    ]
    domain = np.array([0, 0, 1, 1, 2, 2, 2, 2, 3, 3])
    return groups, domain


def test_scale_planner_agrees_with_the_exact_planner_on_bytes_per_rank_and_per_domain():
    groups, domain = _small_groups()
    scale = plan_scale(groups, domain)
    src, dst = to_layouts(groups)
    exact = plan_refit(src, dst, {r: int(d) for r, d in enumerate(domain)})
    received, inter = defaultdict(int), defaultdict(int)
    for t in exact.transfers:
        received[t.dst] += t.nbytes
        if t.inter_domain:
            inter[int(domain[t.dst])] += t.nbytes
    got = scale.total("recv", "ib") + scale.total("recv", "nvlink")
    for r in range(4, 10):
        assert got[r] == received[r] == dst.bytes_on(r), r  # every rank gets exactly what it keeps
    scale_inter = defaultdict(int)
    for r, b in enumerate(scale.recv[("ib", 0)]):
        if b:
            scale_inter[int(domain[r])] += int(b)
    assert dict(scale_inter) == dict(inter)  # each byte enters each destination domain once
    assert scale.bytes_model == sum(np.prod(t.shape) * 2 for t in src.tensors.values())


def test_link_arithmetic_on_a_case_worked_by_hand():
    # one source GPU (domain 0) holds 4 tensors of 1e9 bytes; two GPUs of domain 1 each need all
    g = _g("w", (500_000_000,), None, [], np.zeros((4, 1, 1), dtype=int), None, [], np.array([[1, 2]]))
    plan = plan_scale([g], np.array([0, 1, 1]))
    pred = predict(plan, TINY_LINKS, np.array([0]), np.array([1, 2]), np.array([0, 1, 1]))
    # 4 GB cross once (the NIC of rank 0: 0.4 s at 10 GB/s); landings alternate, so each
    # destination takes 2 GB over IB (0.2 s) and 2 GB forwarded over NVLink (0.02 s)
    assert plan.recv[("ib", 0)].tolist() == [0, 2e9, 2e9]
    assert plan.recv[("nvlink", 1)].tolist() == [0, 2e9, 2e9]
    assert pred["predicted_s"] == pytest.approx(0.4)
    assert pred["lower_bound_s"] == pytest.approx(0.4)  # the source's NIC is the bottleneck
    assert pred["stage_by_stage_s"] == pytest.approx(0.4 + 0.02)


def test_deepseek_v3_has_its_public_size_and_plans_fast():
    groups, meta = deepseek_v3_groups(GB200)
    plan = plan_scale(groups, meta["domain_of"])
    assert plan.bytes_model / 2 / 1e9 == pytest.approx(671, rel=0.005)  # 671B parameters
    assert plan.tensors > 45_000
    # each of the 8 TP32 instances keeps the split weights once and the replicated ones
    # (norms, q_a/kv_a projections, router) on all of its 32 GPUs
    replicated = sum(g.count * np.prod(g.shape) * 2 for g in groups if g.dst_dim is None)
    kept = plan.kept[meta["dst_ranks"]]
    assert kept.sum() == 8 * (plan.bytes_model + 31 * replicated)


def test_scale_report_predicts_every_case_within_the_planning_budget():
    report = scale_report()
    assert set(report) == {"deepseek_v3/gb200", "deepseek_v3/h100", "ultra_mopd/gb200"}
    for case in report.values():
        assert case["planning_s"] < 10.0
        assert case["lower_bound_s"] <= case["predicted_s"] <= case["stage_by_stage_s"]
    # H100 nodes are smaller domains than GB200 racks: more bytes cross between domains
    assert report["deepseek_v3/h100"]["inter_domain_bytes"] > report["deepseek_v3/gb200"]["inter_domain_bytes"]

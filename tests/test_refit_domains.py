"""The RL loop's refit domain map comes from the rendezvous placement: trainer ranks then
every engine worker, each in the NVLink domain of its task's segment (a fake 2-rack
placement: the real one needs multi-node segments, which the local cluster does not have)."""

from __future__ import annotations

from types import SimpleNamespace

from hpc_rl.plan.placement import JobPlacement, RolePlacement
from hpc_rl.rl.roles_setup import domains_for_refit
from hpc_rl.messaging.routes import Routes


def _ctx(placement, engine_tp: int = 1):
    tasks = {"trainer": 4, "generator": 4}
    plan = SimpleNamespace(roles=[SimpleNamespace(name="trainer"), SimpleNamespace(name="generator")],
                           role=lambda r: SimpleNamespace(tasks_per_node=tasks[r], parallel={"tp": engine_tp}))
    return SimpleNamespace(placement=placement, plan=plan)


ROUTES = Routes(trainer=list(range(16)), generators=list(range(16, 24)), envs=[])


def test_fake_two_rack_placement_gives_each_refit_rank_its_segment_domain():
    placement = JobPlacement("slurm", "test", {
        "trainer": RolePlacement("trainer", 2, [f"t{i}" for i in range(4)], [], ["rack1", "rack2"]),
        "generator": RolePlacement("generator", 1, ["g0", "g1"], [], ["rack2", "rack3"]),
    })
    dom = domains_for_refit(_ctx(placement), ROUTES)
    # trainer: 4 tasks per node, segments of 2 nodes -> ranks 0-7 in rack1, 8-15 in rack2
    assert [dom[r] for r in (0, 7, 8, 15)] == ["rack1", "rack1", "rack2", "rack2"]
    # engines (refit ranks 16..23): 4 per node, one node per segment
    assert [dom[r] for r in (16, 19, 20, 23)] == ["rack2", "rack2", "rack3", "rack3"]


def test_without_multi_node_segments_there_is_no_domain_map():
    assert domains_for_refit(_ctx(JobPlacement("slurm", "test", {})), ROUTES) is None
    assert domains_for_refit(_ctx(None), ROUTES) is None


def test_engines_spanning_tasks_map_each_worker_to_its_tasks_domain():
    # 8 generator tasks (4 per node, one node per segment), engines of TP 4 spanning 2 tasks each
    placement = JobPlacement("slurm", "test", {
        "trainer": RolePlacement("trainer", 2, [f"t{i}" for i in range(4)], [], ["rack1", "rack2"]),
        "generator": RolePlacement("generator", 1, ["g0", "g1"], [], ["rack2", "rack3"]),
    })
    routes = Routes(trainer=list(range(16)), generators=list(range(16, 24, 2)), envs=[], engine_tasks=2)
    dom = domains_for_refit(_ctx(placement, engine_tp=4), routes)
    # 4 engines x 4 workers = refit ranks 16..31; engines 0-1 live on tasks 0-3 (node g0), 2-3 on g1
    assert len(dom) == 32
    assert [dom[r] for r in range(16, 24)] == ["rack2"] * 8 and [dom[r] for r in range(24, 32)] == ["rack3"] * 8

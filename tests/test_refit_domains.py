"""The RL loop's refit domain map comes from the rendezvous placement: trainer ranks then
one rank per engine, each in the NVLink domain of its segment (a fake 2-rack placement:
the real one needs multi-node segments, which the local cluster does not have)."""

from __future__ import annotations

from types import SimpleNamespace

from hpc_rl.plan.placement import JobPlacement, RolePlacement
from hpc_rl.rl.program import RLProgram


def _program(placement):
    tasks = {"trainer": 4, "generator": 4}
    return SimpleNamespace(ctx=SimpleNamespace(placement=placement), trainer_role="trainer",
                           trainer_ranks=list(range(16)), gen_ranks=list(range(16, 24)),
                           plan=SimpleNamespace(role=lambda r: SimpleNamespace(tasks_per_node=tasks[r])))


def test_fake_two_rack_placement_gives_each_refit_rank_its_segment_domain():
    placement = JobPlacement("slurm", "test", {
        "trainer": RolePlacement("trainer", 2, [f"t{i}" for i in range(4)], [], ["rack1", "rack2"]),
        "generator": RolePlacement("generator", 1, ["g0", "g1"], [], ["rack2", "rack3"]),
    })
    dom = RLProgram._refit_domains(_program(placement))
    # trainer: 4 tasks per node, segments of 2 nodes -> ranks 0-7 in rack1, 8-15 in rack2
    assert [dom[r] for r in (0, 7, 8, 15)] == ["rack1", "rack1", "rack2", "rack2"]
    # engines (refit ranks 16..23): 4 per node, one node per segment
    assert [dom[r] for r in (16, 19, 20, 23)] == ["rack2", "rack2", "rack3", "rack3"]


def test_without_multi_node_segments_there_is_no_domain_map():
    assert RLProgram._refit_domains(_program(JobPlacement("slurm", "test", {}))) is None
    assert RLProgram._refit_domains(_program(None)) is None

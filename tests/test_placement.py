"""Topology discovery and allocation-side placement, on synthetic GB200 racks (fake:
no NVL72 exists here) and on the real local Slurm cluster's tree topology."""

from __future__ import annotations

import json
import random

import pytest

from hpc_rl.config import load_config
from hpc_rl.plan import build_plan
from hpc_rl.plan.job_plan import RolePlan
from hpc_rl.plan.placement import PlacementError, groups_in_one_domain, place_job, place_role
from hpc_rl.plan.topology import (DiscoveryInputs, DomainMap, NodeFacts, discover, expand_hostlist, from_hostnames,
                                  parse_cluster_uuid, parse_scontrol_topology)
from hpc_rl.runtime.placement import compute_placement

TREE = """SwitchName=rack1 Level=0 LinkSpeed=1 Nodes=node[1-2]
SwitchName=rack2 Level=0 LinkSpeed=1 Nodes=node[3-4]
SwitchName=spine Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=rack[1-2]"""
BLOCK = """BlockName=b1 BlockIndex=0 Nodes=gb-[001-018] BlockSize=18
BlockName=b2 BlockIndex=1 Nodes=gb-[019-036] BlockSize=18
AggregatedBlock=b[1-2] BlockIndex=2 Nodes=gb-[001-036] BlockSize=36"""
SMI = """==============NVSMI LOG==============
    Fabric
        State                                  : Completed
        Status                                 : Success
        CliqueId                               : 32766
        ClusterUUID                            : 2e7b0c1a-55c1-4b8f-9a5b-1f9e8d7c6b5a
"""


def trainer(nodes=64, seg=16) -> RolePlan:
    return RolePlan("trainer", nodes, 4, 4, {"tp": 8, "cp": 32, "ep": 64, "pp": 1, "dp": 1}, seg)


def test_hostlists_expand():
    assert expand_hostlist("node[1-3,7]") == ["node1", "node2", "node3", "node7"]
    assert expand_hostlist("gb-[008-010],login1") == ["gb-008", "gb-009", "gb-010", "login1"]


def test_racks_differing_only_in_letters_never_merge():
    dmap = from_hostnames(["rack-A1-n01", "rack-A1-n02", "rack-B1-n01", "rack-B1-n02"])
    assert dmap.of("rack-A1-n01") == dmap.of("rack-A1-n02") == "rack-A1"
    assert dmap.of("rack-B1-n01") == "rack-B1" != dmap.of("rack-A1-n01")


def test_scontrol_tree_and_block_and_fabric_parsers():
    assert parse_scontrol_topology(TREE) == {"node1": "rack1", "node2": "rack1", "node3": "rack2", "node4": "rack2"}
    block = parse_scontrol_topology(BLOCK)
    assert block["gb-001"] == "b1" and block["gb-018"] == "b1" and block["gb-019"] == "b2"
    assert parse_cluster_uuid(SMI) == "2e7b0c1a-55c1-4b8f-9a5b-1f9e8d7c6b5a"
    assert parse_cluster_uuid("ClusterUUID : N/A") is None


def test_discovery_prefers_trusted_sources_and_says_which():
    nodes = ["node1", "node2", "node3"]
    facts = {n: NodeFacts(f"spine.rack{1 + (i > 0)}.{n}", f"uuid{i}") for i, n in enumerate(nodes)}
    explicit = discover(DiscoveryInputs(nodes, facts, TREE, explicit={"d1": ["node[1-3]"]}))
    assert explicit.source == "explicit" and explicit.of("node3") == "d1"
    slurm = discover(DiscoveryInputs(nodes, facts, TREE))
    assert slurm.source == "slurm" and slurm.of("node2") == "spine.rack2"
    scontrol = discover(DiscoveryInputs(nodes, {}, TREE))
    assert scontrol.source == "slurm" and "scontrol" in scontrol.detail and scontrol.of("node3") == "rack2"
    fabric = discover(DiscoveryInputs(nodes, {n: NodeFacts(None, "u") for n in nodes}))
    assert fabric.source == "fabric"
    assert discover(DiscoveryInputs(["a-n1", "b-n1"])).source == "hostname"
    assert discover(DiscoveryInputs(["a-n1", "b-n1"]), allow_hostname=False).source == "none"


def test_fragmented_allocation_gets_complete_segments_per_rack():
    # Slurm's order interleaves 4 synthetic racks; 13 of rack0 do not make a segment of 16
    rng = random.Random(7)
    racks = {f"r{k}": [f"r{k}-n{i:02d}" for i in range(18)] for k in range(5)}
    alloc = racks["r0"][:13] + racks["r1"][:17] + racks["r2"][:16] + racks["r3"][:18] + racks["r4"][:16]
    rng.shuffle(alloc)
    dmap = DomainMap({n: n.split("-")[0] for n in alloc}, "explicit")
    plain_inside, groups = groups_in_one_domain(alloc[:64], 16, dmap)
    assert groups == 4 and plain_inside < 4  # Slurm's order would split EP groups across racks
    placed = place_role(trainer(), alloc, dmap)
    assert groups_in_one_domain(placed.ordered_nodes, 16, dmap) == (4, 4)
    assert sorted(set(placed.segment_domains)) == ["r1", "r2", "r3", "r4"]
    assert len(placed.spares) == len(alloc) - 64 and all(n.startswith("r0") or n in alloc for n in placed.spares)


def test_no_complete_segments_fails_listing_nodes_per_domain():
    alloc = [f"r0-n{i}" for i in range(12)] + [f"r1-n{i}" for i in range(12)]
    dmap = DomainMap({n: n.split("-")[0] for n in alloc}, "slurm")
    with pytest.raises(PlacementError) as info:
        place_role(trainer(nodes=16), alloc, dmap)
    msg = str(info.value)
    assert "needs 1 segments of 16 nodes" in msg and "r0: 12 nodes (0 segments)" in msg and "r1: 12 nodes" in msg


@pytest.mark.parametrize("name,key", [("trainer", "trainer"), ("teacher/swe", "teachers.swe")])
def test_nodes_that_are_not_whole_segments_are_refused_naming_the_key(name, key):
    # 20 nodes in segments of 16: one segment and 4 nodes with no place (once silently dropped)
    role = RolePlan(name, 20, 4, 4, {"tp": 8, "cp": 1, "ep": 64, "pp": 1, "dp": 1}, 16)
    alloc = [f"r{k}-n{i:02d}" for k in range(2) for i in range(18)]
    dmap = DomainMap({n: n.split("-")[0] for n in alloc}, "explicit")
    with pytest.raises(PlacementError) as info:
        place_role(role, alloc, dmap)
    msg = str(info.value)
    assert f"{key}.nodes=20 is not a multiple of its segment size 16" in msg
    assert f"Set {key}.nodes to a multiple of 16 (e.g. 16)" in msg and f"{key}.segment_size" in msg
    assert place_role(RolePlan(name, 32, 4, 4, role.parallel, 16), alloc, dmap).ordered_nodes  # whole segments place


def test_role_config_keys_match_the_config_sections():
    from hpc_rl.config.resources import role_sections
    from hpc_rl.plan.job_plan import role_config_key

    cfg = load_config(["+recipe=ultra_mopd"])
    pairs = [(name, key) for name, key, _ in role_sections(cfg)]
    assert any(name.startswith("teacher/") for name, _ in pairs)
    assert all(role_config_key(name) == key for name, key in pairs), pairs


def test_required_topology_without_a_source_names_the_sources_to_configure():
    plan = build_plan(load_config(["+recipe=ultra_mopd"]))
    alloc = {r.name: [f"{r.name}-{i}" for i in range(r.nodes)] for r in plan.roles}
    nothing = DomainMap({n: n for ns in alloc.values() for n in ns}, "none")
    with pytest.raises(PlacementError) as info:
        place_job(plan, alloc, nothing, required=True)
    for source in ("cluster.domains", "topology.conf", "ClusterUUID", "cluster.domain_pattern"):
        assert source in str(info.value)
    assert place_job(plan, alloc, nothing, required=False).roles == {}  # not required: Slurm's order stays


def test_ranks_are_renumbered_so_ep_groups_sit_in_one_rack(tmp_path):
    """4 trainer nodes x 1 task with EP over 2 nodes; Slurm's order alternates racks."""
    # 7 nodes announced by hand (nothing is submitted): one more than the local cluster has
    cfg = load_config(["+recipe=comm_check", "cluster=local_slurm", "cluster.max_nodes=7", "trainer.nodes=4", "trainer.parallel.ep=2",
                       "trainer.global_batch_size=4", "algo.prompts_per_step=4"])
    plan = build_plan(cfg)
    assert plan.role("trainer").segment_size == 2
    slurm_order = ["node1", "node3", "node2", "node4"]  # rack1, rack2, rack1, rack2
    announced = {}
    for g, node in enumerate(slurm_order):
        announced[g] = {"role": "trainer", "role_rank": g, "node": node, "local_rank": 0,
                        "topology_addr": f"spine.rack{1 if node in ('node1', 'node2') else 2}.{node}"}
    for k, role in enumerate(plan.roles[1:], start=4):
        announced[k] = {"role": role.name, "role_rank": 0, "node": f"node{k + 1}", "local_rank": 0,
                        "topology_addr": f"spine.rack3.node{k + 1}"}
    placement, mapping = compute_placement(cfg, plan, announced, tmp_path, 0)
    assert placement.source == "slurm"
    by_placed = {mapping[g]: announced[g]["node"] for g in range(4)}
    assert [by_placed[r] for r in range(4)] == ["node1", "node2", "node3", "node4"]
    assert sorted(mapping.values()) == list(range(len(announced)))


@pytest.mark.slurm
def test_ep_group_spanning_two_nodes_lands_on_one_rack(local_slurm, tmp_path):
    from hpc_rl.launchers.slurm import submit
    from hpc_rl.rundir import prepare_run_dir
    from hpc_rl.slurm.preflight import check_slurm
    from hpc_rl.slurm.watch import follow

    cfg = load_config(["+recipe=comm_check", "cluster=local_slurm", "launcher=slurm", "trainer.parallel.ep=2",
                       f"run.dir={tmp_path / 'run'}"])
    plan = build_plan(cfg)
    check_slurm(cfg, plan)
    job = submit(cfg, plan, prepare_run_dir(cfg, plan))
    script = (tmp_path / "run" / "job.sbatch").read_text()
    trainer_opts = script.split("#SBATCH hetjob")[0]
    assert "#SBATCH --switches=1@00:10:00" in trainer_opts  # the EP span (2 nodes) under one leaf switch
    assert follow(job, poll_s=0.5, timeout_s=180, echo=lambda line: None) == "COMPLETED", job.failure()
    t0, t1 = job.results()[:2]
    assert t0["ep_group"]["ranks"] == [0, 1]
    addrs = [m["topology_addr"] for m in t0["ep_group"]["members"]]
    racks = {a.rsplit(".", 1)[0] for a in addrs}
    assert len(racks) == 1 and t0["node"] != t1["node"], addrs  # two nodes, one rack
    report = json.loads((tmp_path / "run" / "placement.0.json").read_text())
    assert report["source"] == "slurm" and len(set(report["roles"]["trainer"]["segment_domains"])) == 1
    assert "placement: topology source slurm" in (tmp_path / "run" / "logs" / "trainer.0.out").read_text()

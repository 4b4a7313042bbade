"""Allocation-side placement: after Slurm allocates, order each role's nodes so every
segment (an EP group's nodes, a vLLM instance, a teacher group) sits in one NVLink domain.

Slurm numbers tasks in the order of its node list, which knows nothing of EP groups: a
64-node trainer whose allocation takes 13 nodes of one rack and 3 of the next puts an
EP group of 16 nodes across two racks. Here each role keeps only complete segments per
domain (allocated nodes left over are spares for a later restart; a role whose own node
count is not whole segments is refused), and ranks are numbered segment by segment, node
by node, GPU by GPU. Megatron lays out expert ranks with expert tensor
parallel innermost, then expert parallel, so each EP group is a run of consecutive ranks
and therefore lands on one segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from .job_plan import JobPlan, RolePlan, role_config_key
from .topology import NO_TOPOLOGY_FIX, DomainMap


class PlacementError(RuntimeError):
    pass


@dataclass
class RolePlacement:
    role: str
    segment_size: int
    ordered_nodes: List[str]  # rank r of the role runs on ordered_nodes[r // tasks_per_node]
    spares: List[str]  # allocated but unused (incomplete segments)
    segment_domains: List[str]  # the domain of each segment, in order

    def node_index(self, node: str) -> int:
        return self.ordered_nodes.index(node)


@dataclass
class JobPlacement:
    source: str
    detail: str
    roles: Dict[str, RolePlacement] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "detail": self.detail,
            "roles": {
                name: {"segment_size": p.segment_size, "ordered_nodes": p.ordered_nodes, "spares": p.spares,
                       "segment_domains": p.segment_domains}
                for name, p in self.roles.items()
            },
        }


def place_role(role: RolePlan, allocated: Sequence[str], dmap: DomainMap) -> RolePlacement:
    """Choose complete segments per domain from `allocated` (in Slurm's order) and order them.

    Domains offering the most complete segments go first (fewest domains per role), ties
    broken by Slurm's order, so every rank computes the same answer from the same input.
    """
    seg = role.segment_size
    if role.nodes % seg:
        # Whole segments only: the rest of the role's nodes would get no place and their ranks
        # no node, so the job could not start them. Validation refuses such a config; a plan
        # built or edited by hand reaches here, and is refused with the same fix.
        key = role_config_key(role.name)
        raise PlacementError(
            f"{role.name}: {key}.nodes={role.nodes} is not a multiple of its segment size {seg} "
            f"({role.nodes // seg} whole segments, {role.nodes % seg} nodes left over). "
            f"Set {key}.nodes to a multiple of {seg} (e.g. {max(seg, role.nodes - role.nodes % seg)}), "
            f"or {key}.segment_size to a divisor of {role.nodes}")
    need = role.nodes // seg
    by_domain = dmap.grouped(allocated)
    first_seen = {d: i for i, d in enumerate(by_domain)}
    complete = {d: len(nodes) // seg for d, nodes in by_domain.items()}
    if sum(complete.values()) < need:
        table = ", ".join(f"{d}: {len(ns)} nodes ({complete[d]} segments)" for d, ns in by_domain.items())
        raise PlacementError(
            f"{role.name}: needs {need} segments of {seg} nodes, each inside one domain (topology source: {dmap.source}), "
            f"but the allocation of {len(allocated)} nodes forms only {sum(complete.values())}: {table}. "
            f"Ask Slurm for whole segments (--segment={seg} on block topology, --switches on tree), add spare nodes, "
            f"or lower {role.name}'s segment size")
    segments: List[List[str]] = []
    domains: List[str] = []
    for d in sorted(by_domain, key=lambda d: (-complete[d], first_seen[d])):
        take = min(complete[d], need - len(segments))
        for i in range(take):
            segments.append(by_domain[d][i * seg:(i + 1) * seg])
            domains.append(d)
        if len(segments) == need:
            break
    ordered = [n for s in segments for n in s]
    used = set(ordered)
    return RolePlacement(role.name, seg, ordered, [n for n in allocated if n not in used], domains)


def needs_placement(role: RolePlan) -> bool:
    return role.segment_size > 1 and role.nodes > 1


def place_job(plan: JobPlan, allocated: Dict[str, Sequence[str]], dmap: DomainMap, required: bool) -> JobPlacement:
    """Place every role that has multi-node segments. Without topology information, keep
    Slurm's order, or fail when the cluster requires topology (NVL72)."""
    out = JobPlacement(dmap.source, dmap.detail)
    roles = [r for r in plan.roles if needs_placement(r)]
    if roles and dmap.source == "none":
        if required:
            raise PlacementError(f"roles {[r.name for r in roles]} need multi-node segments inside one NVLink domain, "
                                 f"but no topology source describes the allocated nodes; {NO_TOPOLOGY_FIX}")
        return out
    errors = []
    for role in roles:
        try:
            out.roles[role.name] = place_role(role, allocated[role.name], dmap)
        except PlacementError as exc:
            errors.append(str(exc))
    if errors:
        raise PlacementError("\n".join(errors))
    return out


def groups_in_one_domain(ordered_nodes: Sequence[str], span: int, dmap: DomainMap) -> tuple:
    """(groups inside one domain, groups) when consecutive runs of `span` nodes form groups."""
    inside = total = 0
    for i in range(0, len(ordered_nodes) - span + 1, span):
        total += 1
        inside += len({dmap.of(n) for n in ordered_nodes[i:i + span]}) == 1
    return inside, total

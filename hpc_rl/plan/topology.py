"""Which NVLink domain (or leaf switch) is each node in?

Sources, in the order they are trusted:
  1. explicit   the cluster config's `domains` map (domain -> node names / hostlists)
  2. slurm      Slurm's topology: SLURM_TOPOLOGY_ADDR of each task (tree: spine.rack1.node1),
                or `scontrol show topology` (tree switches, or block topology on 23.11+)
  3. fabric     NVIDIA fabric: `nvidia-smi -q` ClusterUUID, equal within one NVL72 domain
  4. hostname   a pattern over host names (cluster.domain_pattern, or the default: the name
                without its trailing node number, so rack-A1-n03 and rack-B1-n03 differ)
The source used is recorded with the map, so runs can log it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

SOURCES = ("explicit", "slurm", "fabric", "hostname")


class TopologyError(RuntimeError):
    pass


@dataclass
class DomainMap:
    """node name -> domain name, and where that came from."""

    domains: Dict[str, str]
    source: str  # one of SOURCES, or "none"
    detail: str = ""

    def of(self, node: str) -> str:
        return self.domains[node]

    def grouped(self, nodes: Iterable[str]) -> Dict[str, List[str]]:
        """domain -> nodes in the given order, domains in order of first appearance."""
        out: Dict[str, List[str]] = {}
        for n in nodes:
            out.setdefault(self.domains[n], []).append(n)
        return out


def expand_hostlist(expr: str) -> List[str]:
    """Slurm hostlist expressions: node[1-3,7], gb-[001-018], a,b (one bracket per name)."""
    out: List[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", expr):
        m = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not m:
            out.append(part)
            continue
        prefix, body, suffix = m.groups()
        for rng in body.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                width = len(lo)
                out += [f"{prefix}{k:0{width}d}{suffix}" for k in range(int(lo), int(hi) + 1)]
            else:
                out.append(f"{prefix}{rng}{suffix}")
    return out


def from_explicit(mapping: Mapping[str, Sequence[str]], nodes: Iterable[str]) -> Optional[DomainMap]:
    if not mapping:
        return None
    table = {n: dom for dom, exprs in mapping.items() for e in exprs for n in expand_hostlist(e)}
    nodes = list(nodes)
    missing = [n for n in nodes if n not in table]
    if missing:
        raise TopologyError(f"cluster.domains does not place nodes {missing[:8]}{'...' if len(missing) > 8 else ''}: "
                            "add them to a domain")
    return DomainMap({n: table[n] for n in nodes}, "explicit", f"{len(mapping)} domains from cluster.domains")


def from_topology_addrs(addrs: Mapping[str, Optional[str]]) -> Optional[DomainMap]:
    """SLURM_TOPOLOGY_ADDR per node (tree: spine.rack1.node1): the leaf switch is the domain."""
    if not addrs or any(not a or "." not in a for a in addrs.values()):
        return None
    return DomainMap({n: a.rsplit(".", 1)[0] for n, a in addrs.items()}, "slurm", "SLURM_TOPOLOGY_ADDR of each task")


def parse_scontrol_topology(text: str) -> Dict[str, str]:
    """node -> domain from `scontrol show topology`: leaf switches (Level=0) of a tree, or
    blocks (BlockName=...) of block topology."""
    table: Dict[str, str] = {}
    for line in text.splitlines():
        m_block = re.search(r"BlockName=(\S+)", line)
        m_switch = re.search(r"SwitchName=(\S+)", line)
        nodes = re.search(r"\bNodes=(\S+)", line)
        if not nodes:
            continue
        if m_block:
            name = m_block.group(1)
        elif m_switch and re.search(r"\bLevel=0\b", line):
            name = m_switch.group(1)
        else:
            continue
        for n in expand_hostlist(nodes.group(1)):
            table[n] = name
    return table


def from_scontrol(text: Optional[str], nodes: Iterable[str]) -> Optional[DomainMap]:
    if not text:
        return None
    table = parse_scontrol_topology(text)
    nodes = list(nodes)
    if not table or any(n not in table for n in nodes):
        return None
    kind = "block" if "BlockName=" in text else "tree"
    return DomainMap({n: table[n] for n in nodes}, "slurm", f"scontrol show topology ({kind})")


def parse_cluster_uuid(nvidia_smi_q: str) -> Optional[str]:
    """The fabric ClusterUUID from `nvidia-smi -q` (NVL72 GPUs of one domain share it)."""
    m = re.search(r"ClusterUUID\s*:\s*(\S+)", nvidia_smi_q)
    if not m or m.group(1).upper() in ("N/A", "00000000-0000-0000-0000-000000000000"):
        return None
    return m.group(1)


def from_fabric(uuids: Mapping[str, Optional[str]]) -> Optional[DomainMap]:
    if not uuids or any(not u for u in uuids.values()):
        return None
    return DomainMap({n: f"fabric-{u}" for n, u in uuids.items()}, "fabric", "nvidia-smi ClusterUUID")


# Drop the node number at the end of a host name, and the separator/"n"/"node" before it.
DEFAULT_HOST_PATTERN = r"^(?P<domain>.*?)[-_.]?(?:node|nod|n)?\d+$"


def from_hostnames(nodes: Iterable[str], pattern: Optional[str] = None) -> Optional[DomainMap]:
    rx = re.compile(pattern or DEFAULT_HOST_PATTERN)
    table = {}
    for n in nodes:
        m = rx.match(n)
        if not m or not m.groupdict().get("domain"):
            return None
        table[n] = m.group("domain")
    return DomainMap(table, "hostname", f"pattern {rx.pattern!r}")


@dataclass
class NodeFacts:
    """What the ranks of one node reported at rendezvous."""

    topology_addr: Optional[str] = None
    cluster_uuid: Optional[str] = None


@dataclass
class DiscoveryInputs:
    nodes: List[str]
    facts: Dict[str, NodeFacts] = field(default_factory=dict)
    scontrol_text: Optional[str] = None
    explicit: Mapping[str, Sequence[str]] = field(default_factory=dict)
    host_pattern: Optional[str] = None


def discover(inp: DiscoveryInputs, allow_hostname: bool = True) -> DomainMap:
    """The most trusted source that places every node; DomainMap(source='none') if none does."""
    nodes = list(dict.fromkeys(inp.nodes))
    found = from_explicit(inp.explicit, nodes)
    if found is None:
        found = from_topology_addrs({n: inp.facts.get(n, NodeFacts()).topology_addr for n in nodes})
    if found is None:
        found = from_scontrol(inp.scontrol_text, nodes)
    if found is None:
        found = from_fabric({n: inp.facts.get(n, NodeFacts()).cluster_uuid for n in nodes})
    if found is None and allow_hostname:
        found = from_hostnames(nodes, inp.host_pattern)
    return found or DomainMap({n: n for n in nodes}, "none", "no topology source placed every node")


NO_TOPOLOGY_FIX = ("configure one of: cluster.domains (an explicit domain -> nodes map); Slurm topology "
                   "(topology.conf with block or tree topology, so tasks see SLURM_TOPOLOGY_ADDR); the NVIDIA "
                   "fabric (nvidia-smi reporting ClusterUUID on the nodes); or cluster.domain_pattern "
                   "(a regex with a (?P<domain>...) group over host names)")

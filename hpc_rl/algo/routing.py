"""Which teacher scores a sample: agent name -> teacher alias -> teacher rank group.

Rules (routing.agents maps alias -> agent names; a trailing '*' makes a prefix pattern):
  - an exact agent name wins over any pattern;
  - among patterns, the longest matching prefix wins (swe_pivot_* beats swe_*);
  - an agent nothing lists goes to routing.default, unless routing.strict, where it is an error.
Aliases naming the same checkpoint are served by one rank group, named after the first such
alias in definition order -- the grouping of hpc_rl.config.resources.teacher_groups, so
group indices here are indices into that list (and into the job plan's teacher roles).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from hpc_rl.config.schema import RunConfig


class RoutingError(ValueError):
    """An agent no teacher serves, or a routing table that cannot be resolved."""


class TeacherRouter:
    def __init__(self, agents: Mapping[str, Sequence[str]], default: Optional[str] = None,
                 strict: bool = False, checkpoints: Optional[Mapping[str, str]] = None):
        self.agents: Dict[str, List[str]] = {a: list(names) for a, names in agents.items()}
        self.default = default
        self.strict = strict
        # Without checkpoints every alias is its own group, in the order aliases appear.
        if checkpoints is None:
            order = list(self.agents) + ([default] if default and default not in self.agents else [])
            checkpoints = {a: a for a in order}
        self.checkpoints: Dict[str, str] = dict(checkpoints)

        unknown = [a for a in self.agents if a not in self.checkpoints]
        if default is not None and default not in self.checkpoints:
            unknown.append(default)
        if unknown:
            raise RoutingError(f"routing names aliases {unknown} that are not defined teachers "
                               f"(teachers: {list(self.checkpoints)})")

        # Groups: first alias per checkpoint, definition order (resources.teacher_groups).
        self.groups: List[str] = []
        self._group_of: Dict[str, str] = {}
        first_by_ckpt: Dict[str, str] = {}
        for alias, ckpt in self.checkpoints.items():
            if ckpt not in first_by_ckpt:
                first_by_ckpt[ckpt] = alias
                self.groups.append(alias)
            self._group_of[alias] = first_by_ckpt[ckpt]
        self._group_index = {name: i for i, name in enumerate(self.groups)}

        self._exact: Dict[str, str] = {}
        self._prefixes: Dict[str, str] = {}
        for alias, names in self.agents.items():
            for name in names:
                if "*" in name[:-1]:
                    raise RoutingError(f"routing.agents.{alias}: pattern {name!r} has a '*' before its end; "
                                       f"only a trailing '*' (a prefix match, e.g. 'swe_pivot_*') is supported")
                table, key = (self._prefixes, name[:-1]) if name.endswith("*") else (self._exact, name)
                if table.get(key, alias) != alias:
                    raise RoutingError(f"routing.agents: {name!r} is listed under both {table[key]!r} and {alias!r}; "
                                       f"each sample is scored by exactly one teacher")
                table[key] = alias
        # Longest first, so the first hit is the most specific prefix.
        self._prefix_order = sorted(self._prefixes, key=len, reverse=True)
        self._cache: Dict[str, str] = {}

    @classmethod
    def from_config(cls, cfg: "RunConfig") -> "TeacherRouter":
        from hpc_rl.config.resources import REFERENCE, reference_checkpoint

        r = cfg.routing
        checkpoints = {alias: t.checkpoint for alias, t in cfg.teachers.items()}
        if reference_checkpoint(cfg) is not None:  # a group no agent routes to (teacher_groups' order: last)
            checkpoints[REFERENCE] = reference_checkpoint(cfg)
        return cls(r.agents, default=r.default, strict=r.strict, checkpoints=checkpoints)

    def _describe(self) -> str:
        listed = "; ".join(f"{alias}: {names}" for alias, names in self.agents.items())
        return f"known aliases: {list(self.checkpoints)} (routing.agents: {listed or 'none'})"

    def route(self, agent: str) -> str:
        """The teacher alias that scores this agent's samples."""
        hit = self._cache.get(agent)
        if hit is not None:
            return hit
        alias = self._exact.get(agent)
        if alias is None:
            alias = next((self._prefixes[p] for p in self._prefix_order if agent.startswith(p)), None)
        if alias is None:
            if self.strict:
                raise RoutingError(f"agent {agent!r} matches no routing entry and routing.strict is set; "
                                   f"{self._describe()}")
            if self.default is None:
                raise RoutingError(f"agent {agent!r} matches no routing entry and routing.default is unset; "
                                   f"{self._describe()}")
            alias = self.default
        self._cache[agent] = alias
        return alias

    def group_of(self, alias: str) -> str:
        """The rank group serving an alias: the first alias with the same checkpoint."""
        try:
            return self._group_of[alias]
        except KeyError:
            raise RoutingError(f"{alias!r} is not a teacher alias; {self._describe()}") from None

    def group_index(self, alias: str) -> int:
        return self._group_index[self.group_of(alias)]

    def route_batch(self, agents: Sequence[str]) -> Tuple[List[str], List[int]]:
        """Per sample: its alias and the index (into `groups`) of the one group that scores it."""
        aliases = [self.route(a) for a in agents]
        return aliases, [self.group_index(a) for a in aliases]

    def split_by_group(self, agents: Sequence[str]) -> Dict[str, List[int]]:
        """group name -> indices of the samples it scores (each sample in exactly one list)."""
        out: Dict[str, List[int]] = {}
        for i, g in enumerate(self.route_batch(agents)[1]):
            out.setdefault(self.groups[g], []).append(i)
        return out

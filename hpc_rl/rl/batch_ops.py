"""Prompt groups of a gathered collection (rl/collect.py `Collector.gather`): which carry a
signal, keeping some of them, and joining several collections into one.

A gathered collection is plain data on the driver: `records`, `rows` and every scorer's
answer per item. It is filtered here, before `Collector.batch_of` makes the step's `Batch`
(padding, the student's log-probs), so no tensor is built for a group that is dropped and
the trainer ranks receive only what they train on. The functions treat the keys generically
so that a field a scorer adds later is carried too: a list with one entry per item is
selected and concatenated with its items, a dict keyed by item (a teacher's log-probs: `i`,
or `(i, k)` for a sibling sample) is renumbered; `versions` is the union of the parts';
a number (seconds busy) is summed; anything else is the first part's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from hpc_rl.algo.reward_shaping import overlong_penalty

from .siblings import renumber

Gathered = Dict[str, Any]


def _per_item(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n


def _by_item(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, (int, tuple)) for k in value)


def group_rewards(gathered: Gathered, group_size: int, shaping=None, max_tokens: Optional[int] = None) -> List[List[float]]:
    """Each group's rewards as the advantages will see them: the env's reward plus, with
    `shaping` (algo.overlong_shaping, enabled), DAPO's overlong penalty on the response's
    length, which can set a group's samples apart even when the env scored them alike."""
    rewards = torch.tensor(gathered["rewards"], dtype=torch.float32)
    if shaping is not None and shaping.enabled:
        lengths = [len(r.response_ids) for r in gathered["rows"]]
        rewards = rewards + overlong_penalty(lengths, max_tokens, shaping.buffer_tokens, shaping.penalty)
    return [rewards[g:g + group_size].tolist() for g in range(0, len(rewards), group_size)]


def signal_groups(groups: Sequence[Sequence[float]]) -> List[int]:
    """The groups whose rewards differ: a group of one reward has zero advantage under any
    group baseline (mean or leave-one-out, with or without the std), so it trains nothing."""
    return [g for g, rs in enumerate(groups) if max(rs) != min(rs)]


def select_groups(gathered: Gathered, groups: Sequence[int], group_size: int) -> Gathered:
    """The collection's items of `groups` (in the order given), renumbered from 0."""
    n = len(gathered["rows"])
    if n % group_size:
        raise ValueError(f"{n} items are not whole groups of {group_size}")
    if gathered.get("siblings"):  # config/validate_dynamic_sampling.py refuses agentic runs
        raise ValueError("sibling samples (multi-turn episodes) cannot be selected by group")
    keep = [g * group_size + j for g in groups for j in range(group_size)]
    new_index = {old: new for new, old in enumerate(keep)}
    out: Gathered = {}
    for key, value in gathered.items():
        if key == "versions":
            out[key] = value
        elif _per_item(value, n):
            out[key] = type(value)(value[i] for i in keep)
        elif _by_item(value):
            out[key] = {renumber(k, new_index): v for k, v in value.items() if renumber(k, new_index) is not None}
        else:
            out[key] = value
    return out


def _offset(key, by: int):
    return key + by if isinstance(key, int) else (key[0] + by, *key[1:])


def concat(parts: Sequence[Gathered]) -> Gathered:
    """Several collections as one, items in order (part 0's first)."""
    if len(parts) == 1:
        return parts[0]
    if any(p.get("siblings") for p in parts):
        raise ValueError("sibling samples (multi-turn episodes) cannot be concatenated")
    sizes = [len(p["rows"]) for p in parts]
    out: Gathered = {}
    for key, first in parts[0].items():
        values = [p.get(key) for p in parts]
        if key == "versions":
            out[key] = sorted(set().union(*(v or [] for v in values)))
        elif all(_per_item(v, s) for v, s in zip(values, sizes)):
            out[key] = type(first)(x for v in values for x in v)
        elif all(_by_item(v) for v in values):
            merged: Dict[Any, Any] = {}
            start = 0
            for v, s in zip(values, sizes):
                merged.update({_offset(k, start): x for k, x in v.items()})
                start += s
            out[key] = merged
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)  # seconds busy, counts: the step's total over its collections
        else:
            out[key] = first
    return out

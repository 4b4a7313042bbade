"""Sibling samples: the earlier samples of a multi-turn episode whose history the
environment rewrote (hpc_rl/agentic/history.py: a compacted or edited history is not a
prefix of the next turn, so the trajectory so far closes as a sample of its own and the
episode goes on in a new one, never an assertion or a stall).

An order's item i keeps its position in the batch with the episode's last sample (the one
that holds the episode's end); its earlier samples travel under the keys (i, k), k >= 1, and
join the batch after the collection's items, each a row of its own: trained on, scored by
its routed teacher, and sharing its episode's reward and GRPO advantage. They are not
counted again in accuracy (`correct` None) or in the mean reward.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

Key = Tuple[int, int]


def split(piece: Sequence[Tuple[Any, Any]]) -> Tuple[List[Tuple[int, Any]], List[Tuple[Key, Any]]]:
    """A generator's (key, row) pairs -> (the items' rows, the siblings' rows)."""
    rows = [(k, r) for k, r in piece if isinstance(k, int)]
    return rows, [(tuple(k), r) for k, r in piece if not isinstance(k, int)]


def expand(records: List[Any], rows: List[Any], siblings: Sequence[Tuple[Key, Any]]):
    """(records, rows, sibling_of, index of each sibling key): the siblings appended in key
    order after the items; sibling_of[j] is the item the (n + j)-th row belongs to."""
    ordered = sorted(siblings, key=lambda kv: kv[0])
    n = len(rows)
    index = {key: n + j for j, (key, _) in enumerate(ordered)}
    sibling_of = [key[0] for key, _ in ordered]
    return records + [records[i] for i in sibling_of], rows + [r for _, r in ordered], sibling_of, index


def expand_scores(rewards: Optional[List[float]], correct: Optional[List[Any]], teacher: Optional[Dict[Any, Any]],
                  sibling_of: Sequence[int], index: Dict[Key, int]):
    """The scorers' answers over the expanded rows: a sibling's reward is its episode's,
    its correctness is not counted again, its teacher log-probs come under its key."""
    if rewards is not None:
        rewards = list(rewards) + [rewards[i] for i in sibling_of]
        correct = list(correct) + [None] * len(sibling_of)
    if teacher is not None:
        teacher = {(k if isinstance(k, int) else index[tuple(k)]): v for k, v in teacher.items()}
    return rewards, correct, teacher


def renumber(key, new_index: Dict[int, int]):
    """An item's key (i) or a sibling's ((i, k)) after a filter kept the items of
    `new_index` (old -> new); None when its item was dropped (rl/staleness.py)."""
    i, k = (key, None) if isinstance(key, int) else key
    if i not in new_index:
        return None
    return new_index[i] if k is None else (new_index[i], k)


def keep_items(siblings: Sequence[Tuple[Key, Any]], new_index: Dict[int, int]) -> List[Tuple[Key, Any]]:
    """The siblings of the items a filter kept (rl/staleness.py), renumbered."""
    return [(renumber(key, new_index), r) for key, r in siblings if renumber(key, new_index) is not None]

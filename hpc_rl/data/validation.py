"""The held-out validation set: which rows are one item, the split by item, overlaps.

Evaluating on prompts the run trains on measures memorisation, not learning. Rows are
grouped into items before anything is split, and every row of an item falls on one side:

  - rows with the same content key (the prompt, whitespace-normalised, with its task and
    answer) are one item: the synthetic tasks repeat prompts (addition_1digit has 100
    distinct prompts over 512 rows), and a row id ("addition_1digit-7") names a row there,
    not a question;
  - rows with the same `id` are one item too (a dataset may give several phrasings of one
    problem one id); a row without an id has "<file>:<line>", which links nothing.

Between two files (a validation file against the training data) only the content key
counts: ids are names local to their file (two files numbered from 0 share ids without
sharing a question), while the same question in both is exactly the leak to refuse.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Dict, List, Sequence, Tuple

from .dataset import PromptDataset, PromptRecord


def _normal(text: str) -> str:
    return " ".join(text.split())


def content_key(rec: PromptRecord) -> str:
    """sha256 of the prompt (whitespace-normalised), task and answer: a row's question."""
    prompt = _normal(rec.prompt) if isinstance(rec.prompt, str) else \
        [{"role": m["role"], "content": _normal(m["content"])} for m in rec.prompt]
    blob = json.dumps({"prompt": prompt, "task": rec.task, "answer": rec.answer}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def item_groups(records: Sequence[PromptRecord]) -> List[List[int]]:
    """Row indices grouped into items (shared content key or shared id), each group in row
    order, groups in order of their first row."""
    parent = list(range(len(records)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: Dict[Tuple[str, str], int] = {}
    for i, rec in enumerate(records):
        for key in (("content", content_key(rec)), ("id", str(rec.id))):
            j = first.setdefault(key, i)
            if j != i:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: Dict[int, List[int]] = {}
    for i in range(len(records)):
        groups.setdefault(find(i), []).append(i)
    return [groups[k] for k in sorted(groups)]


def _subset(ds: PromptDataset, rows: Sequence[int]) -> PromptDataset:
    return PromptDataset([ds.records[i] for i in rows], ds.path, ds.skipped_lines, ds.errors, [ds.lines[i] for i in rows])


def split_by_item(ds: PromptDataset, share: float, seed: int) -> Tuple[PromptDataset, PromptDataset]:
    """(training, validation): about `share` of each agent's items (at least one, never all of
    an agent's items, so both sides see every agent that has two items or more), chosen by
    `seed` independently of the rows' order; both keep the rows' order."""
    if share <= 0:
        return ds, _subset(ds, [])
    by_agent: Dict[str, List[Tuple[str, List[int]]]] = {}
    for rows in item_groups(ds.records):
        rec = ds.records[rows[0]]
        by_agent.setdefault(rec.agent, []).append((content_key(rec), rows))
    held: List[int] = []
    for agent in sorted(by_agent):
        items = sorted(by_agent[agent])  # by content key: the same split whatever the file's order
        n = len(items)
        take = min(max(round(share * n), 1), n - 1) if n >= 2 else 0
        random.Random(f"validation:{seed}:{agent}").shuffle(items)
        for _, rows in items[:take]:
            held.extend(rows)
    held_set = set(held)
    return _subset(ds, [i for i in range(len(ds)) if i not in held_set]), _subset(ds, sorted(held))


def overlap(train: PromptDataset, val: PromptDataset) -> List[Tuple[int, int]]:
    """(validation line, training line) of every validation row whose question is also a
    training row's, in validation order."""
    seen: Dict[str, int] = {}
    for rec, line in zip(train.records, train.lines):
        seen.setdefault(content_key(rec), line)
    out = []
    for rec, line in zip(val.records, val.lines):
        hit = seen.get(content_key(rec))
        if hit is not None:
            out.append((line, hit))
    return out


def distinct_items(records: Sequence[PromptRecord]) -> List[PromptRecord]:
    """The first row of each item: a validation prompt is scored once, however often it repeats."""
    return [records[rows[0]] for rows in item_groups(records)]

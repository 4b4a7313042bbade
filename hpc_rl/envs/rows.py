"""The load-time check of a dataset's rows against the verifiers (rl/inputs.py calls it on the
launching machine, before anything is submitted).

A row's `task` names its verifier (envs/registry.py): a task without one, or a reference
answer the verifier cannot read (an empty answer, a calculator answer that is not one
integer), would otherwise surface mid-run on an env or teacher rank, or score 0 for ever
without a word. Each kind of problem is one message naming the file, the first rows (index
and id) and how many there are, with the fix.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .registry import UnknownTaskError, answer_problem, known_tasks

SHOWN_ROWS = 5  # rows named per problem; the count says how many more


def row_problems(records: Sequence, source: Optional[str]) -> List[Tuple[str, str]]:
    """(problem, fix) per kind of problem among `records` (PromptRecords: task, answer, id),
    empty when every row with a task can be scored. `source`: the file, for the messages."""
    where = source or "the generated data"
    unknown: Dict[str, List[str]] = {}  # task -> rows
    unreadable: Dict[str, List[str]] = {}  # "task {t!r}: answer ..." -> rows
    for i, rec in enumerate(records):
        if rec.task is None:  # no verifier reward asked for (data/dataset.py)
            continue
        row = f"row {i + 1} (id {rec.id!r})"
        try:
            problem = answer_problem(rec.task, rec.answer)
        except UnknownTaskError:
            unknown.setdefault(rec.task, []).append(row)
            continue
        if problem is not None:
            unreadable.setdefault(f"task {rec.task!r}: the answer {problem}", []).append(row)
    out = []
    for task, rows in sorted(unknown.items()):
        out.append((f"{where}: {_rows(rows)} name task {task!r}, which has no verifier (known tasks: "
                    f"{', '.join(known_tasks())})",
                    "fix the rows' task to a known one, drop their task (no verifier reward), or register a "
                    "verifier for it (hpc_rl.envs.registry.register)"))
    for problem, rows in sorted(unreadable.items()):
        out.append((f"{where}: {_rows(rows)}, {problem}",
                    "fix those rows' answers (the verifier's reference), or drop their task"))
    return out


def _rows(rows: List[str]) -> str:
    more = len(rows) - SHOWN_ROWS
    return ", ".join(rows[:SHOWN_ROWS]) + (f" and {more} more" if more > 0 else "")

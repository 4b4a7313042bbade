"""JSONL prompt datasets and the resumable iterator that batches them.

One JSON object per line:
  prompt  str, or a non-empty list of chat messages {"role": str, "content": str}
  agent   non-empty str: picks the teacher (hpc_rl.algo.routing) and the environment
  answer  optional str (numbers are accepted and kept as their text): the verifier's reference
  task    optional str: the verifier (hpc_rl.envs.registry); None means no verifier reward
  id      optional str or int; defaults to "<file name>:<line>"
Blank lines are ignored. Every other line is checked when the file is loaded, so a bad
row fails the job at startup, naming the file and line, not hours later on a rank.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

Prompt = Union[str, List[Dict[str, str]]]


class DatasetError(ValueError):
    """A malformed dataset row: the message names the file, the 1-based line and the fault."""

    def __init__(self, path: Union[str, Path], line: int, problem: str):
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"{path}:{line}: {problem}")


@dataclass(frozen=True)
class PromptRecord:
    prompt: Prompt
    agent: str
    answer: Optional[str] = None
    task: Optional[str] = None
    id: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


_KNOWN_FIELDS = ("prompt", "agent", "answer", "task", "id")


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def parse_row(obj: Any, default_id: str) -> PromptRecord:
    """One decoded JSON value -> a record; raises ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {_type_name(obj)}")
    if "prompt" not in obj:
        raise ValueError("missing field 'prompt'")
    prompt = obj["prompt"]
    if isinstance(prompt, list):
        if not prompt:
            raise ValueError("field 'prompt' is an empty message list")
        for i, msg in enumerate(prompt):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
                raise ValueError(f"field 'prompt' message {i} must be an object with string 'role' and 'content', got {msg!r}")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    elif not isinstance(prompt, str):
        raise ValueError(f"field 'prompt' must be a string or a list of chat messages, got {_type_name(prompt)}")
    if "agent" not in obj:
        raise ValueError("missing field 'agent'")
    agent = obj["agent"]
    if not isinstance(agent, str) or not agent:
        raise ValueError(f"field 'agent' must be a non-empty string, got {agent!r}")
    answer = obj.get("answer")
    # bool is an int subclass, but `true` as a reference answer is a data bug, not a number.
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"field 'answer' must be a string or a number, got {_type_name(answer)}")
        answer = str(answer)
    task = obj.get("task")
    if task is not None and not isinstance(task, str):
        raise ValueError(f"field 'task' must be a string, got {_type_name(task)}")
    rid = obj.get("id", default_id)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise ValueError(f"field 'id' must be a string or an integer, got {_type_name(rid)}")
    return PromptRecord(prompt=prompt, agent=agent, answer=answer, task=task, id=str(rid))


class PromptDataset(Sequence[PromptRecord]):
    """A validated JSONL file held in memory (prompt sets are megabytes, not terabytes)."""

    def __init__(self, records: List[PromptRecord], path: Optional[str] = None,
                 skipped_lines: Optional[List[int]] = None, errors: Optional[List[DatasetError]] = None,
                 lines: Optional[List[int]] = None):
        self.records = records
        self.path = path
        self.skipped_lines = skipped_lines or []
        self.errors = errors or []
        # each record's 1-based line in `path` (blank and skipped lines make it differ from
        # the index): what a refusal names, e.g. a validation row that is also a training row
        self.lines = lines if lines is not None else list(range(1, len(records) + 1))

    @property
    def skipped(self) -> int:
        return len(self.skipped_lines)

    @classmethod
    def from_jsonl(cls, path: Union[str, Path], skip_invalid: bool = False) -> "PromptDataset":
        path = Path(path)
        records: List[PromptRecord] = []
        errors: List[DatasetError] = []
        lines: List[int] = []
        with path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    err = DatasetError(path, lineno, f"invalid JSON ({exc.msg} at column {exc.colno})")
                else:
                    try:
                        records.append(parse_row(obj, default_id=f"{path.name}:{lineno}"))
                        lines.append(lineno)
                        continue
                    except ValueError as exc:
                        err = DatasetError(path, lineno, str(exc))
                if not skip_invalid:
                    raise err
                errors.append(err)
        return cls(records, str(path), [e.line for e in errors], errors, lines)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):  # type: ignore[override]
        return self.records[i]

    def __repr__(self) -> str:
        return f"PromptDataset({self.path!r}, rows={len(self)}, skipped={self.skipped})"


class PromptIterator(Iterator[List[PromptRecord]]):
    """Endless fixed-size batches, reshuffled every epoch from (seed, epoch).

    A batch that reaches the end of an epoch is completed from the start of the next one,
    so every step sees `batch_size` prompts whatever the dataset size. The order depends
    only on (seed, epoch), so `state_dict()` -> `load_state_dict()` on a fresh iterator
    continues with exactly the batches the uninterrupted one would have produced.
    """

    def __init__(self, dataset: Sequence[PromptRecord], batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(dataset) == 0:
            raise ValueError("cannot iterate over an empty dataset")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> List[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> List[PromptRecord]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            batch.extend(self.dataset[i] for i in self._order[self.position:self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict:
        # num_rows guards against resuming onto a different file, which would silently
        # reorder everything.
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        rows = state.get("num_rows", len(self.dataset))
        if rows != len(self.dataset):
            raise ValueError(f"iterator state was saved for a dataset of {rows} rows, this one has {len(self.dataset)}")
        if not 0 <= state["position"] <= rows:
            raise ValueError(f"iterator state position {state['position']} is outside 0..{rows}")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)

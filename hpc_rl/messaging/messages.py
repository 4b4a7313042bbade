"""The messages of a step and the batch the trainer ranks assemble from them.

The driver (trainer rank 0) sends each generator an `Order`; a generator forwards its rows
to the ranks that score them as `Work`; scorers answer the driver. Every message is plain
data (lists, small dataclasses): it is pickled point to point (`exchange.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from hpc_rl.data.dataset import PromptRecord
from hpc_rl.engines.base import Sampling
from hpc_rl.refit.vllm_engine import Rollouts, SampleRow

# Order kinds, the generator's whole vocabulary:
COLLECT = "collect"  # sample the items, forward them to env and teachers, return the rows
TEACHER_EVAL = "teacher_eval"  # no sampling: teachers answer the items greedily (their own accuracy)
REFIT = "refit"  # receive the trainer's weights of step `step` (a resume; training collections say theirs)
STOP = "stop"  # a save was requested (time limit): stop for a requeue
END = "end"  # the run is complete
FORWARDED = (COLLECT, TEACHER_EVAL, STOP, END)  # kinds generators pass on to their scorers

TRAINER_SEED_SPACE = 1_000_003


def request_seed(run_seed: int, stream: int, step: int, index: int) -> int:
    """A request's sampling seed: a function of where it is in the run, not of the batch."""
    return (run_seed * TRAINER_SEED_SPACE + stream * 7_919_993 + step * 10_007 + index) % (2 ** 31 - 1)


@dataclass
class Order:
    kind: str
    step: int = 0
    items: List[Tuple[int, PromptRecord, int]] = field(default_factory=list)  # (index, record, seed)
    sampling: Optional[Sampling] = None
    score_env: bool = False  # env ranks verify the rows and answer the driver
    score_teachers: bool = False  # teacher groups score their routed rows and answer the driver
    score_reference: bool = False  # the reference's group scores every row (algo.ref_kl_coef > 0)
    train: bool = False  # a training step's collection: ft.inject_failure's @step fires
    # After forwarding this collection's rows, receive the trainer's weights of this version
    # (None: no refit follows). Lock-step: the order's own step; async: the step before it.
    refit_after: Optional[int] = None
    # In-flight weight updates: the trainer's weights of this version are sent while this
    # order samples (announced on the store, IN_FLIGHT_KEY); the generator loads them between
    # scheduler steps, or after sampling, and always before it sends the driver the rows.
    refit_in_flight: Optional[int] = None


# Set by the driver just before the trainer ranks send an in-flight refit: the generators poll it between scheduler steps.
IN_FLIGHT_KEY = "hpc_rl/in_flight_refit/{restart}/{version}"


@dataclass
class Work:
    """What a generator forwards to one scorer for one order."""

    kind: str
    wanted: bool  # the scorer answers the driver for this order
    step: int = 0
    train: bool = False  # a training step's work (where ft.inject_failure's @step fires)
    items: List[Tuple[int, PromptRecord, Optional[SampleRow]]] = field(default_factory=list)
    # the scorer serves the reference model too and gets every row: it answers (routed, all)
    reference: bool = False


@dataclass
class Batch:
    """One collection as every trainer rank sees it (tensors are [B, T])."""

    records: List[PromptRecord]
    rows: List[SampleRow]
    rollouts: Rollouts
    weight_versions: List[int]  # the engines' weight versions (trainer steps) the rows came from
    student_logprobs: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None  # [B]
    correct: Optional[List[Optional[bool]]] = None
    teacher_logprobs: Optional[torch.Tensor] = None
    aliases: Optional[List[str]] = None  # the routed teacher alias per sample
    ref_logprobs: Optional[torch.Tensor] = None  # the reference model's, [B, T] (algo.ref_kl_coef > 0)
    advantages: Optional[torch.Tensor] = None  # [B, T], set by the train step
    timing: Dict[str, float] = field(default_factory=dict)
    info: Dict[str, Any] = field(default_factory=dict)  # the step's rollout metrics (async: buffer depth, ages)
    # rows after the collection's items are sibling samples of multi-turn episodes: the item
    # each belongs to (rl/siblings.py)
    sibling_of: List[int] = field(default_factory=list)

    @property
    def items(self) -> int:
        """The collection's items (prompts x generations), its sibling samples left out."""
        return len(self.rows) - len(self.sibling_of)

    def _placed(self, scores: Dict[int, List[float]]) -> torch.Tensor:
        """Per-sample response log-probs placed at their tokens' positions, [B, T]."""
        out = torch.zeros_like(self.rollouts.generation_logprobs)
        for i, lps in scores.items():
            p = len(self.rows[i].prompt_ids)
            out[i, p:p + len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return out

    def set_teacher_scores(self, scores: Dict[int, List[float]], aliases: List[str]) -> None:
        self.teacher_logprobs = self._placed(scores)
        self.aliases = aliases

    def set_reference_scores(self, scores: Dict[int, List[float]]) -> None:
        missing = [i for i in range(len(self.rows)) if i not in scores]
        if missing:  # a penalty of 0 for a row would be silently wrong: the protocol broke
            raise RuntimeError(f"the reference model scored {len(scores)} of {len(self.rows)} rows (missing {missing[:5]})")
        self.ref_logprobs = self._placed(scores)

"""Samples that train nothing are not trained (issue 49, `trainer.skip_zero_advantage`).

Under GRPO a group whose samples all got the same reward has advantage 0 on every token, and
a sample cut by the overlong filter has no trained token. Such a row's policy loss is exactly
0 for every loss kind here (each term is a multiple of the advantage over trained tokens:
ppo, ratio_level=sequence, reinforce, with any mismatch weights), so its gradient is exactly
0: its forward and backward are pure cost. Early in RL most groups are like that (the peer
bench, bench/results/peer_trl.json: 84-100% of samples).

The step stays the same step: each minibatch's loss denominator (tokens or sequences of the
rank's whole share, aggregation.py) is computed before rows are left out, so the loss and
every gradient equal the unskipped ones (tests/test_zero_advantage.py). Every data-parallel
rank trains as many rows (the most any rank keeps, at least one; a rank with fewer adds rows
of its own share that train nothing): all ranks decide from the same batch, without a message,
and every backend sees equal micro-batch counts.

Not skipped, with the reason in the step's metrics:
  - MOPD: the advantage is the teacher's minus the student's log-prob, never 0 in advance;
  - a reference KL term in the loss (algo.ref_kl.apply_to=loss): it has a gradient on every row;
  - the training forward's old log-probs with algo.mismatch.seq_logprob_error_threshold: each
    micro-batch then computes its own denominator.
With the training forward's old log-probs, a skipped row has no trainer log-probs: the records
hold NaN there (rollouts.h5 `student_logprobs`) and token_mult_prob_error covers the trained rows.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def skip_off_reason(cfg, advantages: Optional[torch.Tensor], training_forward: bool) -> Optional[str]:
    """Why rows that train nothing are trained anyway this step (None: they are left out)."""
    a = cfg.algo
    if not cfg.trainer.skip_zero_advantage:
        return "trainer.skip_zero_advantage=false"
    if advantages is None:
        return "MOPD's advantages come from each micro-batch's forward"
    if a.ref_kl_coef > 0 and a.ref_kl.apply_to == "loss":
        return "the reference KL in the loss has a gradient on every row"
    if training_forward and a.mismatch.seq_logprob_error_threshold is not None:
        return "algo.mismatch.seq_logprob_error_threshold: each micro-batch computes its own denominator"
    return None


def trains_something(advantages: torch.Tensor, train_mask: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row has a trained token with a non-zero advantage (exactly: a group of equal
    rewards gives exact zeros; anything else is trained)."""
    return ((advantages != 0) & train_mask.bool()).any(dim=-1)


def rows_to_train(rows: Sequence[int], dp: int, dp_rank: int, trains: torch.Tensor) -> Tuple[List[int], List[int]]:
    """(this rank's rows of the minibatch `rows` to train, every rank's trained rows). The ranks'
    shares are rows[r::dp]; each trains as many rows: its rows that train something, then rows
    of its share that do not, up to the most any rank keeps (at least one, at most its share)."""
    shares = [list(rows)[r::dp] for r in range(dp)]
    keep = max(1, max(sum(bool(trains[i]) for i in s) for s in shares))
    chosen = []
    for s in shares:
        useful = [i for i in s if trains[i]]
        filler = [i for i in s if not trains[i]][:max(0, min(keep, len(s)) - len(useful))]
        chosen.append(sorted(useful + filler))
    return chosen[dp_rank], sorted(i for c in chosen for i in c)

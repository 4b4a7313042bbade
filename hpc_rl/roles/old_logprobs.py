"""Where a training step's old log-probs come from (issue 49).

The policy loss's old log-probs (the PPO ratio's denominator, the mismatch weights, MOPD's
advantage) are the student's log-probs at the weights it trains from. When a batch is
trained in exactly one optimizer step from those weights, the training forward computes
the same values: the separate no-grad pass over the batch is then skipped and each
micro-batch takes them from its own forward, detached (`ratio = exp(lp - sg[lp]) = 1`,
whose gradient is the separate pass's). The driver's records (token_mult_prob_error,
reverse KL, rollouts.h5) get the whole batch's values gathered after the step.

`separate_pass_reason` says why the separate pass must run, None when the training forward
serves. The separate pass runs when:
  - the batch spans several optimizer steps (more rows than trainer.global_batch_size): the
    second minibatch's old log-probs are those of the weights before the first step;
  - asynchronous rollouts: the samples come from older weights, and a batch may wait in the
    buffer while the weights move;
  - a sample was generated under other weights than the trainer's current ones;
  - MOPD with algo.opd.baseline=token_mean: the baseline is the batch's mean over every token,
    needed before the first micro-batch;
  - algo.mismatch.seq_logprob_error_threshold with several micro-batches on a rank: the masked
    sequences change the loss's denominator, needed before the first micro-batch;
  - a backend whose loss function does not see every row's log-probs (megatron: only its last
    pipeline stage does);
  - the reference KL in the reward (algo.ref_kl.apply_to=reward): the penalty changes the
    rewards, so the advantages, before the first micro-batch;
  - LoRA dropout (trainer.lora.dropout > 0): the training forward is not the sampling policy's.
So GRPO (any loss kind) and MOPD with baseline=none take the training forward.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from hpc_rl.messaging import p2p as exchange

TRAINING_FORWARD, SEPARATE_PASS = "training_forward", "separate_pass"


def separate_pass_reason(cfg, rows: Sequence, version: Optional[int], dp_size: int,
                         backend_capable: bool) -> Optional[str]:
    """Why the old log-probs of a training batch of `rows` need the separate pass (None: the
    training forward serves). `version`: the weights the trainer holds (None: not checked)."""
    a, tr = cfg.algo, cfg.trainer
    n = len(rows)
    if not backend_capable:
        return f"trainer.backend={tr.backend} does not hand every row's log-probs to the loss"
    if a.async_rollout.enabled:
        return "asynchronous rollouts: samples of older weights"
    if tr.lora.enabled and tr.lora.dropout > 0:  # the engines and the no-grad pass run without it
        return f"trainer.lora.dropout={tr.lora.dropout}: the training forward's log-probs carry adapter dropout"
    if n > tr.global_batch_size:
        return f"{n} rows in minibatches of trainer.global_batch_size={tr.global_batch_size}: several optimizer steps"
    if version is not None and any(r.version_first != version or r.version_last != version for r in rows):
        return f"samples generated under other weights than the trainer's (version {version})"
    if a.name == "mopd" and a.opd.baseline != "none":
        return f"algo.opd.baseline={a.opd.baseline}: the batch mean needs every token first"
    if a.ref_kl_coef > 0 and a.ref_kl.apply_to == "reward":
        return "algo.ref_kl.apply_to=reward: the KL penalty enters the rewards before the advantages"
    per_rank = -(-n // max(dp_size, 1))
    several = tr.packing or per_rank > tr.micro_batch_size  # packed micro-batches: counted by tokens
    if a.mismatch.seq_logprob_error_threshold is not None and several:
        return "algo.mismatch.seq_logprob_error_threshold with several micro-batches: the loss's denominator first"
    return None


class ForwardLogprobs:
    """The detached log-probs each micro-batch's training forward computed, by batch row;
    `whole` assembles the batch's [B, T] on every rank (each rank has its rows)."""

    def __init__(self):
        self.rows: List[int] = []
        self.values: List[torch.Tensor] = []

    def keep(self, idx: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """The old log-probs of these rows: `lp` detached, float32 on CPU as the separate pass
        returns them (so the loss's arithmetic is the same on both paths)."""
        old = lp.detach().float().cpu()
        self.rows += [int(i) for i in idx]
        self.values.append(old)
        return old

    def whole(self, shape, group, world: int) -> torch.Tensor:
        out = torch.zeros(shape, dtype=torch.float32)
        mine = (self.rows, torch.cat(self.values) if self.values else torch.zeros((0, shape[1])))
        # every rank its rows; tensor/context parallel ranks repeat their dp rank's (same values)
        for rows, values in exchange.gather_all(mine, group) if world > 1 else [mine]:
            out[torch.tensor(rows, dtype=torch.long)] = values
        return out

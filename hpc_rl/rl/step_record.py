"""What the driver records of one training step: a metrics line and the step's rollouts."""

from __future__ import annotations

import time
from typing import Any, Dict

import numpy as np
import torch

from hpc_rl.algo import token_mult_prob_error

from hpc_rl.messaging.messages import Batch
from .eval import accuracy_by_task, reverse_kl
from .staleness import age_histogram
from .records import MetricsLog, RolloutStore


def version_split_mult_prob_error(b: Batch, current: int) -> Dict[str, Any]:
    """The engine-vs-trainer agreement, kept apart from the policy's change between weight
    versions. `token_mult_prob_error` covers only the samples whose every token was
    generated under the weights the trainer holds now (version `current`): there the two
    sides run the same weights and any excess over 1 is a mismatch (kernels, precision, a
    bad refit). Samples generated under older weights (asynchronous rollouts, in-flight
    refits) compare two policies; their figure is `policy_change_mult_prob_error`. A key is
    absent when no sample of its kind is in the batch (an asynchronous run's later steps
    hold only one-step-old samples)."""
    mask = b.rollouts.response_mask
    same = torch.tensor([x.version_first == current and x.version_last == current for x in b.rows], dtype=torch.bool)
    out: Dict[str, Any] = {"current_version_samples": int(same.sum())}
    # rows the train step left out (trainer.skip_zero_advantage) have no trainer log-probs: NaN
    have = ~torch.isnan(b.student_logprobs).any(dim=1)
    for key, rows in (("token_mult_prob_error", same & have), ("policy_change_mult_prob_error", ~same & have)):
        if bool(rows.any()):
            out[key] = token_mult_prob_error(b.rollouts.generation_logprobs, b.student_logprobs, mask & rows[:, None])
    return out


def multi_turn_arrays(b: Batch) -> Dict[str, np.ndarray]:
    """rollouts.h5 arrays of multi-turn rows, aligned with input_ids: `token_versions` (the
    weight version of each policy token, -1 elsewhere), `turn_index` (the policy turn a
    response token belongs to: a turn is the policy's tokens and the environment's answer
    after them; -1 on the prompt and padding) and `turns` per row. `response_mask` is the
    loss mask: 1 on the policy's tokens, 0 on the environment's."""
    shape = tuple(b.rollouts.input_ids.shape)
    versions = np.full(shape, -1, dtype=np.int32)
    turn = np.full(shape, -1, dtype=np.int16)
    for i, x in enumerate(b.rows):
        p, mask = len(x.prompt_ids), x.policy_mask()
        tv = x.token_versions if x.token_versions is not None else [x.version_first if m else -1 for m in mask]
        versions[i, p:p + len(tv)] = tv
        k, prev = -1, 0
        for j, m in enumerate(mask):
            k += int(m == 1 and prev == 0)  # a policy segment starts a turn
            turn[i, p + j], prev = max(k, 0), m
    return {"token_versions": versions, "turn_index": turn, "turns": np.array([x.turns for x in b.rows], dtype=np.int16)}


def record_step(step: int, b: Batch, train: Dict[str, Any], timing: Dict[str, float], metrics_log: MetricsLog,
                store: RolloutStore) -> Dict[str, Any]:
    r = b.rollouts
    mask = r.response_mask
    rec: Dict[str, Any] = {"kind": "step", "step": step, "time": time.time(), "samples": len(b.rows),
                           "response_len_mean": float(np.mean(r.generation_lengths)),
                           "truncated_frac": float(np.mean(r.truncated)),
                           **version_split_mult_prob_error(b, step - 1),
                           "weight_version": min(b.weight_versions), **train, **b.info, "timing": timing}
    if any(x.loss_mask is not None for x in b.rows):
        rec["turns_mean"] = float(np.mean([x.turns for x in b.rows]))
    # the weights each sample saw (first and last token) and its age under this step's policy
    first, last = [x.version_first for x in b.rows], [x.version_last for x in b.rows]
    rec["versions"] = {"first_min": min(first), "first_max": max(first), "last_max": max(last),
                       "changed_mid_sample": sum(a != z for a, z in zip(first, last)),
                       "age": age_histogram(first, step - 1)}
    if b.rewards is not None:
        rec["reward_mean"] = float(b.rewards[:b.items].mean())  # per episode: sibling samples repeat theirs
        rec["accuracy"] = accuracy_by_task(b.records, b.correct)
    if b.teacher_logprobs is not None:
        rec["reverse_kl"] = reverse_kl(b)
    metrics_log.append(rec)
    arrays = {"input_ids": r.input_ids.numpy().astype(np.int32), "attention_mask": r.attention_mask.numpy().astype(np.int8),
              "response_mask": mask.numpy().astype(np.int8), "generation_logprobs": r.generation_logprobs.numpy(),
              "student_logprobs": b.student_logprobs.numpy(), "advantages": b.advantages.numpy(),
              "truncated": np.array(r.truncated, dtype=np.int8),
              # the weights each sample was generated under: first and last token (in-flight refits)
              "weight_version_first": np.array([x.version_first for x in b.rows], dtype=np.int32),
              "weight_version_last": np.array([x.version_last for x in b.rows], dtype=np.int32)}
    if any(x.loss_mask is not None for x in b.rows):  # multi-turn trajectories: per token, whose and which weights
        arrays.update(multi_turn_arrays(b))
    if b.teacher_logprobs is not None:
        arrays["teacher_logprobs"] = b.teacher_logprobs.numpy()
    if b.rewards is not None:
        arrays["rewards"] = b.rewards.numpy()
    # item_ids: each row's prompt record (its dataset id): which episodes a step trained on,
    # checked for duplicates and gaps across a requeue (tests/test_agentic_faults.py)
    strings = {"agents": [x.agent for x in b.records], "texts": r.texts, "tasks": [x.task or "" for x in b.records],
               "item_ids": [x.id or "" for x in b.records]}
    if b.aliases:
        strings["teachers"] = b.aliases
    store.write(step, arrays, strings, attrs={"weight_version": min(b.weight_versions)})
    return rec


def brief(rec: Dict[str, Any]) -> str:
    parts = []
    if "reverse_kl" in rec:
        parts.append(f"KL {rec['reverse_kl'].get('mean', float('nan')):.3f}")
    if "reward_mean" in rec:
        parts.append(f"reward {rec['reward_mean']:.3f}")
    if "ref_kl" in rec:  # algo.ref_kl_coef: the batch's KL to the reference model (roles/loss_terms.py)
        parts.append(f"ref KL {rec['ref_kl']:.4f}")
    if "token_mult_prob_error" in rec:  # same weights on both sides: the engine-vs-trainer mismatch
        parts.append(f"mult_prob_err {rec['token_mult_prob_error']:.4f}")
    if "policy_change_mult_prob_error" in rec:  # older weights vs the trainer's: includes the policy's change
        parts.append(f"policy change {rec['policy_change_mult_prob_error']:.4f}")
    parts.append(f"loss {rec.get('loss', float('nan')):.4f}")
    if rec.get("nonfinite_skipped"):  # models/nonfinite.py: the weights did not move
        parts.append(f"NON-FINITE loss or gradients: {rec['nonfinite_skipped']} of {rec['optimizer_steps']} optimizer "
                     f"steps skipped ({rec['nonfinite_skipped_total']} in the run)")
    t = rec["timing"]
    if "dynamic_sampling/collections" in rec:  # rl/dynamic_sampling.py: how hard the step was to fill
        parts.append(f"{rec['dynamic_sampling/collections']} collections, "
                     f"{rec['dynamic_sampling/groups_dropped']} of {rec['dynamic_sampling/groups_sampled']} groups "
                     f"of one reward dropped")
    if "async" in rec:  # the pipeline: what was ahead, what was dropped, who waited
        a = rec["async"]
        parts.append(f"buffer {a['buffer_depth']}, stale dropped {a['stale_dropped']}, ages {rec['versions']['age']}, "
                     f"trainer idle {t['wait_rows_s'] / t['step_s']:.0%}, "
                     f"generator idle {max(0.0, 1 - t['generate_busy_s'] / t['step_s']):.0%}")
    parts.append(f"{t['step_s']:.2f}s")
    return ", ".join(parts)

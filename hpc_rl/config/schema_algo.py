"""The RL algorithm (`algo`) and held-out validation (`data.validation`), beside schema.py.

Its comments document the keys like schema.py's do (hpc_rl/config/reference.py reads both).
Formulas live in hpc_rl/algo/; the names follow the literature (NeMo RL, DAPO, GSPO, verl).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from .trace import Traced


@dataclass
class OPDConfig(Traced):
    adv_clip: float = 20.0  # advantages clipped to [-adv_clip, adv_clip]
    # Subtract the batch's mean advantage over trained tokens (after clipping). A constant
    # baseline leaves the expected policy gradient unchanged and removes the large common
    # offset (wrong tokens all sit near log p_teacher = -10), which on small batches
    # otherwise drowns the signal. "none" is the plain A_t = sg[log p_T - log p_S].
    baseline: Literal["none", "token_mean"] = "none"


@dataclass
class GRPOConfig(Traced):
    leave_one_out: bool = False  # baseline: the mean of the group's other samples (RLOO) instead of the group mean
    normalize_std: bool = True  # divide by the group's reward std, which puts easy and hard prompts on one scale
    # Advantages clamped to [adv_clip_low, adv_clip_high] after the baseline and the std (NeMo RL's
    # grpo.advantage_clip_low/high); None: that side unclipped.
    adv_clip_low: Optional[float] = None
    adv_clip_high: Optional[float] = None  # see adv_clip_low


@dataclass
class LossConfig(Traced):
    # ppo: -min(ratio * A, clip(ratio) * A), the ratio taken against the student's log-probs before
    # this step's updates; reinforce: -A * log-prob (no ratio, no clip).
    kind: Literal["ppo", "reinforce"] = "ppo"
    ratio_clip_low: float = 0.2  # ppo: the ratio is clipped below at 1 - ratio_clip_low
    ratio_clip_high: float = 0.2  # ppo: the ratio is clipped above at 1 + ratio_clip_high (clip-higher when larger)
    # ppo: token: one importance ratio per token (PPO, GRPO, DAPO); sequence: GSPO's one ratio per
    # sequence, exp of the mean over its tokens of log pi - log pi_old, clipped per sequence.
    ratio_level: Literal["token", "sequence"] = "token"
    # How per-token losses make the minibatch's loss: token-mean (every trained token of the minibatch
    # weighs alike: DAPO, NeMo RL's token_level_loss); seq-mean-token-mean (each sequence's mean over
    # its tokens, then the mean over sequences: GRPO's paper, GSPO); seq-mean-token-sum (each sequence's
    # sum over its tokens, then the mean over sequences: no length normalisation, as Dr. GRPO).
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    # DAPO's overlong filtering: a sample cut at generator.sampling.max_tokens without finishing is
    # left out of the loss (its tokens get no gradient; its reward still counts in its group).
    overlong_filtering: bool = False


@dataclass
class MismatchConfig(Traced):
    """Correction for generation (vLLM) vs trainer logprob mismatch."""

    # Each token's loss weight p_trainer / p_vLLM: tis clamps it to [min, max]; icepop zeroes it
    # outside [min, max]; none: weight 1.
    kind: Literal["none", "tis", "icepop"] = "tis"
    min: float = 0.2  # lower bound of the weight (tis, icepop)
    max: float = 5.0  # upper bound of the weight (tis, icepop)
    # mask a sequence whose mean multiplicative probability error exceeds this; None: off
    seq_logprob_error_threshold: Optional[float] = None


@dataclass
class AsyncConfig(Traced):
    enabled: bool = False  # the generators sample step k+1 while the trainer trains step k
    # A prompt group with a sample older than this many policy versions is dropped from the batch.
    max_trajectory_age_steps: int = 1
    # Send step k's weights right after its train step, loaded by the engines between scheduler
    # steps while they sample step k+1 (needs enabled).
    in_flight_weight_updates: bool = False
    # After an in-flight refit, drop the running requests' KV cache so their prompts and
    # tokens so far are prefilled again under the new weights (false: keep the cache built
    # by the old weights, as NeMo RL's default).
    recompute_kv_cache_after_weight_updates: bool = False


@dataclass
class RefKLConfig(Traced):
    """The KL penalty against the reference model (the `reference` role), weighted by algo.ref_kl_coef."""

    # Per-token estimator of KL(pi || pi_ref) from x = log pi_ref - log pi at the sampled token
    # (NeMo RL's calculate_kl): k1 = -x; k2 = x^2 / 2; k3 = exp(x) - 1 - x (unbiased, >= 0).
    estimator: Literal["k1", "k2", "k3"] = "k3"
    # loss: coef * the estimate is added to each token's loss (NeMo RL's reference_policy_kl_penalty,
    # gradient through pi); reward: coef * the sequence's summed estimate is subtracted from its reward
    # before the advantages (classic RLHF), no gradient through the penalty.
    apply_to: Literal["loss", "reward"] = "loss"
    input_clamp: Optional[float] = 20.0  # x clamped to [-input_clamp, input_clamp] first; None: no clamp
    output_clamp: Optional[float] = 10.0  # the estimate clamped to [-output_clamp, output_clamp]; None: no clamp


@dataclass
class DynamicSamplingConfig(Traced):
    """DAPO's dynamic sampling (algo.name=grpo): groups whose rewards are all equal carry no signal."""

    # Drop every group whose samples earned one reward and collect more prompts until the step has
    # algo.prompts_per_step groups that carry a signal.
    enabled: bool = False
    # At most this many collections per step (the first included); a step that still lacks groups
    # fails, naming this key (NeMo RL's dynamic_sampling_max_gen_batches).
    max_collections: int = 8


@dataclass
class OverlongShapingConfig(Traced):
    """DAPO's soft overlong punishment: a length penalty added to the reward near max_tokens."""

    enabled: bool = False
    # The last buffer_tokens tokens before generator.sampling.max_tokens (L_cache): a response of
    # length L > max_tokens - buffer_tokens gets -penalty * (L - max_tokens + buffer_tokens) / buffer_tokens.
    buffer_tokens: int = 0
    penalty: float = 1.0  # the penalty at max_tokens


@dataclass
class AlgoConfig(Traced):
    # mopd: per-token advantage log p_teacher - log p_student from each sample's routed teacher;
    # grpo: group-relative advantages of the env rewards.
    name: Literal["mopd", "grpo"] = "mopd"
    prompts_per_step: int = 8  # prompts drawn per RL step
    generations_per_prompt: int = 1  # samples per prompt, consecutive (grpo's group size)
    # Coefficient of the KL penalty against the reference model (the `reference` role, placed when > 0;
    # NeMo RL's GRPO default is 0.01; with trainer.lora: no role, the trainer scores the base with the
    # adapters off). 0: no reference role, no penalty.
    ref_kl_coef: float = 0.0
    ref_kl: RefKLConfig = field(default_factory=RefKLConfig)  # the estimator and where the penalty goes
    opd: OPDConfig = field(default_factory=OPDConfig)  # MOPD's per-token advantages (algo.name=mopd)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # GRPO's group-relative advantages (algo.name=grpo)
    loss: LossConfig = field(default_factory=LossConfig)  # the policy-gradient loss of both algorithms
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong_shaping: OverlongShapingConfig = field(default_factory=OverlongShapingConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    async_rollout: AsyncConfig = field(default_factory=AsyncConfig)  # overlap sampling with training


@dataclass
class ValidationConfig(Traced):
    """The held-out validation set: never trained on, scored every N steps and at the start and end.
    Its size per task is data.eval_prompts_per_task (0 turns validation off)."""

    # A JSONL file of validation prompts (rows as data.path's). None: a split of the training data.
    path: Optional[str] = None
    # With path unset: the share of each agent's items held out for validation (an item: the rows
    # sharing a prompt with its task and answer, or an id; chosen by run.seed); never drawn for training.
    split: float = 0.1
    every_steps: int = 0  # validate every N steps too (0: only at the start and the end)
    # Samples per prompt for pass@k and mean@k at `temperature` (besides the greedy accuracy); 1: greedy only.
    k: int = 1
    temperature: float = 1.0  # the sampling temperature of pass@k and mean@k

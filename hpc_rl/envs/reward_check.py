"""The one check every reward passes before it leaves an environment for the trainer.

An environment's reward is untrusted data: a verifier, a NeMo Gym /verify, a verifiers
rubric or a user's episode can return NaN, inf, a string or None. NaN passes `float()` and
then the GRPO advantages, the loss, the gradient clip and AdamW: every weight becomes NaN, is
refit and checkpointed. So a reward is a finite real number within +-REWARD_BOUND, or the
episode (the row) is an error, counted by the exception's kind (its class name: the runner
and the env rank count errors by `type(exc).__name__`, agentic/faults.py) and scored 0.

REWARD_BOUND is not a config key: no reward of this project's environments leaves [-1, 1],
and 1e6 keeps a group's variance (up to 1e12) far inside float32, where the advantages are
computed. An environment past it has a bug worth an error, not a silent clamp.

Used at every entry point: envs/registry.score (single-turn verifiers, the teacher's eval),
agentic/runner.run_episode (every multi-turn episode, whatever returned it),
agentic/contract.StepwiseEpisode, and the Gym and verifiers bridges.
"""

from __future__ import annotations

import math
import reprlib

REWARD_BOUND = 1e6

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40  # a 10 MB string "reward" must not land in the log whole


class BadReward(ValueError):
    """A reward that cannot be trained on; its subclass names the kind that is counted."""


class NonNumericReward(BadReward):
    pass


class NonFiniteReward(BadReward):
    pass


class RewardOutOfBounds(BadReward):
    pass


def describe(value: object) -> str:
    """A value as a log can hold it: its type and a bounded repr."""
    try:
        shown = _repr.repr(value)
    except Exception:  # a user object whose __repr__ raises
        shown = "<unprintable>"
    return f"{type(value).__name__} {shown}"


def checked_reward(value: object, source: str = "the environment") -> float:
    """`value` as a float when it is a finite real number (int, float, bool, or a scalar of
    numpy / torch) within +-REWARD_BOUND; else a BadReward subclass naming `source` and
    the value. Strings are refused even when they spell a number ("1.0"): an environment
    that returns text has a bug a silent conversion would hide."""
    try:
        # text and arrays have no single reward; a 0-d numpy/torch value has shape ()
        if isinstance(value, (str, bytes, bytearray)) or tuple(getattr(value, "shape", ())) != ():
            raise TypeError
        reward = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int past float's range (10**400)
        raise RewardOutOfBounds(f"{source} returned reward {describe(value)}: beyond +-{REWARD_BOUND:g}") from None
    except Exception:  # TypeError, ValueError, or whatever a user type's __float__ raises
        raise NonNumericReward(f"{source} returned reward {describe(value)}: not a number") from None
    if not math.isfinite(reward):
        raise NonFiniteReward(f"{source} returned reward {describe(value)}: not finite")
    if abs(reward) > REWARD_BOUND:
        raise RewardOutOfBounds(f"{source} returned reward {describe(value)}: beyond +-{REWARD_BOUND:g}")
    return reward

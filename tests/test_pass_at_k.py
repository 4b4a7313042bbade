"""pass@k and mean@k of the held-out validation (rl/eval.py) against a brute-force count."""

from __future__ import annotations

from itertools import combinations

import pytest

from hpc_rl.data.dataset import PromptRecord
from hpc_rl.rl.eval import mean_of, pass_and_mean_at_k, pass_at_k


def brute_pass_at_k(outcomes, k: int) -> float:
    """The share of the k-subsets of the samples holding at least one correct sample."""
    subsets = list(combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_the_unbiased_estimator_equals_the_brute_force_count(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k)), (n, c, k)


def test_with_n_equal_k_pass_at_k_is_any_correct():
    assert pass_at_k(4, 0, 4) == 0.0
    assert all(pass_at_k(4, c, 4) == 1.0 for c in range(1, 5))
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_per_task_pass_and_mean_at_k_on_a_fixed_set():
    k = 3
    prompts = [PromptRecord("1+1", "add", "2", "addition"), PromptRecord("2+2", "add", "4", "addition"),
               PromptRecord("2*3", "mul", "6", "multiplication"), PromptRecord("3*3", "mul", "9", "multiplication")]
    outcomes = {0: [False, True, False], 1: [False, False, False], 2: [True, True, True], 3: [None, True, True]}
    records = [p for p in prompts for _ in range(k)]
    correct = [c for i in range(len(prompts)) for c in outcomes[i]]
    passed, share = pass_and_mean_at_k(records, correct, k)
    # brute force, per prompt, averaged per task; the prompt with an unscored sample is left out
    assert passed == {"add": pytest.approx((brute_pass_at_k(outcomes[0], k) + brute_pass_at_k(outcomes[1], k)) / 2),
                      "mul": pytest.approx(brute_pass_at_k(outcomes[2], k))}
    assert passed == {"add": 0.5, "mul": 1.0}
    assert share == {"add": pytest.approx((1 / 3 + 0) / 2), "mul": 1.0}
    assert mean_of(passed) == 0.75 and mean_of({}) is None

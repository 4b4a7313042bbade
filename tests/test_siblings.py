"""Sibling samples of rewritten multi-turn histories in the batch (rl/siblings.py): their
rows join after the items, share their episode's reward and GRPO advantage, are scored under
their own key, and leave with their episode when the age bound drops it. The end-to-end
run is tests/test_agentic_run.py."""

from __future__ import annotations

import torch

from hpc_rl.algo.advantages import grpo_advantages
from hpc_rl.engines.rows import SampleRow
from hpc_rl.rl import siblings
from hpc_rl.rl.staleness import drop_stale


def _row(tag: int, version: int = 5) -> SampleRow:
    return SampleRow([1, 2], [tag, tag], [-0.1, -0.2], False, str(tag), version_first=version, version_last=version)


def test_siblings_join_after_the_items_with_their_episodes_reward_and_their_own_teacher_scores():
    records = ["r0", "r1", "r2", "r3"]
    piece = [(0, _row(10)), ((2, 1), _row(21)), (1, _row(11)), ((0, 1), _row(1)), (2, _row(12)), (3, _row(13)), ((2, 2), _row(22))]
    mine, theirs = siblings.split(piece)
    rows = [None] * 4
    for i, r in mine:
        rows[i] = r
    recs, rows, sibling_of, index = siblings.expand(records, rows, theirs)
    assert [r.text for r in rows] == ["10", "11", "12", "13", "1", "21", "22"]  # items keep their places
    assert recs == records + ["r0", "r2", "r2"] and sibling_of == [0, 2, 2]
    teacher = {0: [0.0], 1: [1.0], 2: [2.0], 3: [3.0], (0, 1): [4.0], (2, 1): [5.0], (2, 2): [6.0]}
    rewards, correct, t = siblings.expand_scores([1.0, 0.0, 0.5, 0.0], [True, False, None, False], teacher, sibling_of, index)
    assert rewards == [1.0, 0.0, 0.5, 0.0, 1.0, 0.5, 0.5]
    assert correct == [True, False, None, False, None, None, None]  # accuracy counts each episode once
    assert [t[j] for j in range(7)] == [[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [6.0]]


def test_a_sibling_takes_its_episodes_grpo_advantage():
    from hpc_rl.messaging.messages import Batch
    from hpc_rl.engines.rows import pad_rows

    rows = [_row(k) for k in range(6)]
    b = Batch(["p"] * 6, rows, pad_rows(rows, 0), [5], sibling_of=[0, 2])
    b.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])  # items 0-3 in groups of 2, then the siblings'
    assert b.items == 4
    # what TrainerRole.advantages does for GRPO
    adv = grpo_advantages(b.rewards[:b.items], 2, False, True)
    adv = torch.cat([adv, adv[torch.tensor(b.sibling_of)]])
    assert adv.tolist()[4:] == [adv[0].item(), adv[2].item()] and adv[0] != adv[2]


def test_the_age_bound_drops_an_episodes_siblings_with_it():
    rows = [_row(0, 1), _row(1, 1), _row(2, 5), _row(3, 5)]  # group 0 (items 0, 1) is too old
    gathered = {"records": ["a", "b", "c", "d"], "rows": rows, "rewards": [1.0, 0.0, 1.0, 0.0],
                "correct": [True, False, True, False], "siblings": [((0, 1), _row(9, 1)), ((3, 1), _row(8, 5))],
                "teacher": {0: [0.0], 1: [1.0], 2: [2.0], 3: [3.0], (0, 1): [9.0], (3, 1): [8.0]}}
    out, dropped = drop_stale(gathered, policy_version=5, bound=2, group_size=2)
    assert dropped == 2 and [r.text for r in out["rows"]] == ["2", "3"]
    assert [(k, r.text) for k, r in out["siblings"]] == [((1, 1), "8")]  # item 3 is item 1 now
    assert out["teacher"] == {0: [2.0], 1: [3.0], (1, 1): [8.0]}

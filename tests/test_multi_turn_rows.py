"""Multi-turn rows in the trainer's batch: environment and tool tokens are context, never
trained on (engines/rows.py), and what rollouts.h5 keeps of them (rl/step_record.py)."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.algo.advantages import grpo_advantages, opd_advantages, per_token
from hpc_rl.algo.losses import policy_loss
from hpc_rl.engines.rows import SampleRow, pad_rows
from hpc_rl.models.fsdp2 import token_logprobs

# prompt 4 tokens; turn 1: 3 policy tokens; tool answer: 4 environment tokens; turn 2: 2 policy tokens
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1]


def _row(seed: int, loss_mask=MASK) -> SampleRow:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (4 + len(MASK),), generator=g).tolist()
    lps = [-0.5 * (k + 1) if m else 0.0 for k, m in enumerate(MASK)]
    return SampleRow(ids[:4], ids[4:], lps, False, "", loss_mask=loss_mask, turns=2,
                     token_versions=[3 if m else -1 for m in MASK])


def test_pad_rows_trains_only_the_policys_tokens_and_refuses_a_mask_of_the_wrong_length():
    r = pad_rows([_row(0), SampleRow([1, 2], [3, 4, 5], [-1.0] * 3, False, "")], pad_id=0)
    assert r.response_mask[0].tolist() == [False] * 4 + [bool(m) for m in MASK]
    assert r.response_mask[1].tolist()[:5] == [False, False, True, True, True]  # single turn: every response token
    assert r.attention_mask[0].sum() == 4 + len(MASK)  # environment tokens stay in the context
    with pytest.raises(ValueError, match="loss mask of 2 for 9"):
        pad_rows([_row(0, loss_mask=[1, 0])], pad_id=0)


def _lp_grads(rows, model, algo: str) -> torch.Tensor:
    """d loss / d log p(token) for each position, through the trainer's loss on a real model."""
    batch = pad_rows(rows, pad_id=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = token_logprobs(logits, batch.input_ids)
    lp.retain_grad()
    mask = batch.response_mask
    if algo == "mopd":  # a teacher that disagrees everywhere: every advantage is non-zero
        adv = opd_advantages(lp.detach() - 1.0, lp.detach(), mask, clip=20.0)
    else:
        adv = per_token(grpo_advantages(torch.tensor([1.0, 0.0]), 2, False, False), mask)
    loss, _ = policy_loss(lp, lp.detach(), adv, mask, kind="ppo")
    loss.backward()
    return lp.grad


@pytest.mark.parametrize("algo", ["mopd", "grpo"])
def test_environment_and_tool_tokens_get_no_gradient(tmp_path, algo):
    from transformers import AutoModelForCausalLM

    from hpc_rl.models.assets import ModelSpec, save_untrained

    model = AutoModelForCausalLM.from_pretrained(save_untrained(tmp_path / "m", ModelSpec(layers=1)), dtype=torch.float32)
    grad = _lp_grads([_row(1), _row(2)], model, algo)
    env = torch.tensor([False] * 4 + [m == 0 for m in MASK])
    policy = torch.tensor([False] * 4 + [m == 1 for m in MASK])
    assert torch.all(grad[:, env] == 0), "a tool or environment token got a gradient"
    assert torch.all(grad[:, policy] != 0), "a policy token got no gradient"
    # the same trajectories without their loss mask (the bug this guards against): the
    # environment's tokens would be trained on, and the check above would fail
    leaky = _lp_grads([_row(1, loss_mask=None), _row(2, loss_mask=None)], model, algo)
    assert torch.all(leaky[:, env] != 0)


def test_rollouts_keep_each_tokens_weight_version_and_turn(tmp_path):
    import h5py

    from hpc_rl.data.dataset import PromptRecord
    from hpc_rl.messaging.messages import Batch
    from hpc_rl.rl.records import RolloutStore
    from hpc_rl.rl.step_record import multi_turn_arrays

    rows = [_row(3), _row(4)]
    b = Batch([PromptRecord("p", "calc_agent", "a", "calculator")] * 2, rows, pad_rows(rows, 0), [3])
    arrays = multi_turn_arrays(b)
    assert arrays["token_versions"][0].tolist() == [-1] * 4 + [3 if m else -1 for m in MASK]
    assert arrays["turn_index"][0].tolist() == [-1] * 4 + [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert arrays["turns"].tolist() == [2, 2]
    store = RolloutStore(tmp_path)
    store.write(1, arrays, {})
    with h5py.File(store.path) as f:
        assert f["step_000001/turn_index"][1].tolist() == arrays["turn_index"][1].tolist()

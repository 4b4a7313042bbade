"""Token-exact multi-turn history (hpc_rl/agentic/history.py): a turn's prompt is the previous
prompt, the policy's ids verbatim, then the tokenized template delta; a rewritten history
becomes a sibling sample. The bookkeeping cases use a scripted policy (named so); token
exactness is checked on a real model's generations."""

from __future__ import annotations

import pytest
import torch
from test_agentic_common import ChatterEnv, CompactingEpisode, Recorder, check_token_exact, hf_logprobs, run

from hpc_rl.agentic.contract import EpisodeResult, Limits, StepwiseEpisode
from hpc_rl.agentic.history import TokenHistory, changed_policy_tokens
from hpc_rl.agentic.runner import run_episode


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from hpc_rl.models.tokenizer import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def student():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.rl.inputs import resolve_model_ref

    path = resolve_model_ref("tiny:student")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_delta_is_the_template_delta_and_policy_ids_stay_verbatim(tok):
    eos = tok.eos_token_id
    h = TokenHistory(tok)
    user = {"role": "user", "content": "What is 2 plus 3?"}
    first = h.prompt([user])
    assert first == ids_of(tok, "<|user|>What is 2 plus 3?<|end|><|assistant|>")
    # scripted policy output: the *characters* "<|end|>" and then the real eos. Decoded and
    # tokenized again they would become one special token: the history keeps the 7 ids.
    scripted = ids_of(tok, "5") + [tok.convert_tokens_to_ids(c) for c in "<|end|>"] + [eos]
    assert len(ids_of(tok, tok.decode(scripted))) != len(scripted)
    text = h.add_policy(scripted, [-0.5] * len(scripted), 3, 3)
    said = {"role": "assistant", "content": tok.decode(scripted, skip_special_tokens=True)}
    nxt = {"role": "user", "content": "Sure?"}
    second = h.prompt([user, said, nxt])
    assert second == first + scripted + ids_of(tok, "<|user|>Sure?<|end|><|assistant|>")
    assert text.endswith("<|end|><|end|>")
    # a turn cut off by max_tokens (no eos): the template closes it, and that <|end|> is the
    # environment's token (mask 0), not the policy's
    cut = ids_of(tok, "Yes I")
    h.add_policy(cut, [-1.0] * len(cut), 4, 5)
    third = h.prompt([user, said, nxt, {"role": "assistant", "content": "Yes I"}, {"role": "tool", "content": "7"}])
    delta = ids_of(tok, "<|end|><|tool|>7<|end|><|assistant|>")
    assert third == second + cut + delta
    (row,) = h.rows()
    assert row.prompt_ids == first and row.prompt_ids + row.response_ids == second + cut
    assert row.loss_mask == [1] * len(scripted) + [0] * (len(second) - len(first) - len(scripted)) + [1] * len(cut)
    assert row.token_versions[:len(scripted)] == [3] * len(scripted) and row.token_versions[-len(cut):] == [4] * 4 + [5]
    assert (row.version_first, row.version_last, row.turns, h.siblings) == (3, 5, 2, 0)
    assert changed_policy_tokens(h.rows(), h.row_turns()) == 0


def test_token_in_prompts_extend_the_sample_or_start_a_sibling(tok):
    # prompt_ids: a library renders its own prompts (verifiers); ids are taken as given
    h = TokenHistory(tok)
    first = ids_of(tok, "<|user|>What is 2 plus 3?<|end|><|assistant|>")
    assert h.prompt_ids(first) == first
    said = ids_of(tok, "5") + [tok.eos_token_id]
    h.add_policy(said, [-0.25] * len(said), 1, 1)
    more = ids_of(tok, "<|user|>Sure?<|end|><|assistant|>")
    assert h.prompt_ids(first + said + more) == first + said + more  # the held ids are a prefix: extend
    again = ids_of(tok, "6")
    h.add_policy(again, [-0.5], 2, 2)
    (row,) = h.rows()
    assert row.prompt_ids == first and row.response_ids == said + more + again
    assert row.loss_mask == [1] * len(said) + [0] * len(more) + [1]
    assert row.logprobs == [-0.25] * len(said) + [0.0] * len(more) + [-0.5]
    assert row.token_versions == [1] * len(said) + [-1] * len(more) + [2]
    # a prompt that does not start with the held ids (the library compacted it): a sibling
    other = ids_of(tok, "<|user|>Again?<|end|><|assistant|>")
    assert h.prompt_ids(other) == other and h.siblings == 1
    h.add_policy(again, [-0.5], 3, 3)
    assert [r.prompt_ids for r in h.rows()] == [first, other]


def test_changed_policy_tokens_counts_what_moved(tok):
    h = TokenHistory(tok)
    h.prompt([{"role": "user", "content": "hi"}])
    out = ids_of(tok, "hello") + [tok.eos_token_id]
    h.add_policy(out, [0.0] * len(out), 0, 0)
    rows, turns = h.rows(), h.row_turns()
    assert changed_policy_tokens(rows, turns) == 0
    rows[0].response_ids[1] += 1  # a token changed
    rows[0].loss_mask[3] = 0  # a policy token masked out
    assert changed_policy_tokens(rows, turns) == 2


def test_rewritten_history_starts_a_sibling(student):
    model, tok = student
    from hpc_rl.agentic.local import HFPolicy

    torch.manual_seed(0)
    rec = Recorder(HFPolicy(model, tok, greedy=False))
    task = {"prompt": "What is 3 plus 4?", "answer": "7", "task": "addition"}
    rows, result = run(run_episode(task, CompactingEpisode(), rec, tok, Limits(max_tokens_per_turn=12)))
    assert result.info["siblings"] == 1 and len(rows) == 2 and not result.truncated
    assert [r.turns for r in rows] == [1, 2]
    compacted = [{"role": "user", "content": "Summary: asked once. What is 3 plus 4?"}]
    text = tok.apply_chat_template(compacted, tokenize=False, add_generation_prompt=True)
    assert rows[1].prompt_ids == ids_of(tok, text)  # the whole new rendering, all of it prompt
    check_token_exact(rows[0], rec.calls[:1])
    check_token_exact(rows[1], rec.calls[1:])
    assert result.info["changed_policy_tokens"] == 0


def test_an_edited_assistant_message_is_rendered_as_edited(student):
    model, tok = student
    from hpc_rl.agentic.local import HFPolicy

    class Editing:
        async def run(self, task, chat):
            msgs = [{"role": "user", "content": task["prompt"]}]
            reply = await chat(msgs)
            reply["content"] = "(redacted)"  # the env rewrites what the policy said
            await chat(msgs + [reply, {"role": "user", "content": "ok"}])
            return EpisodeResult(0.0, False)

    rec = Recorder(HFPolicy(model, tok))
    rows, result = run(run_episode({"prompt": "What is 1 plus 1?"}, Editing(), rec, tok))
    assert result.info["siblings"] == 1 and len(rows) == 2
    assert "(redacted)" in tok.decode(rows[1].prompt_ids)
    check_token_exact(rows[1], rec.calls[1:])


def test_multi_turn_ids_are_token_exact_with_a_real_model(student):
    """Sampled generations over 4 turns, some cut off by the per-turn cap: each turn's prompt
    is the previous one plus the policy's ids verbatim, and a forward of the stored ids gives
    the policy's logprobs back on its tokens."""
    model, tok = student
    from hpc_rl.agentic.local import HFPolicy

    torch.manual_seed(1)
    ended = {"stop": 0, "length": 0}
    for i in range(4):
        rec = Recorder(HFPolicy(model, tok, greedy=False))
        task = {"prompt": f"What is {i} plus {i + 2}?"}
        rows, result = run(run_episode(task, StepwiseEpisode(lambda: ChatterEnv(4)), rec, tok,
                                       Limits(max_tokens=256, max_tokens_per_turn=2 if i % 2 else 8)))
        (row,) = rows
        assert result.reward == 1.0 and result.info["turns"] == 4 and result.info["changed_policy_tokens"] == 0
        check_token_exact(row, rec.calls)
        for prompt, ids, _ in rec.calls:
            ended["stop" if ids[-1] == tok.eos_token_id else "length"] += 1
        mine = hf_logprobs(model, row)
        for j, m in enumerate(row.loss_mask):
            if m:
                assert abs(mine[j] - row.logprobs[j]) < 1e-4
    assert ended["stop"] and ended["length"], ended  # both kinds of turn end were exercised

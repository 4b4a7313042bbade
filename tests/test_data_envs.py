"""Synthetic tasks, the JSONL prompt dataset and its iterator, and the reward verifiers."""

from __future__ import annotations

import json
import re

import pytest

from hpc_rl.data import (DatasetError, PromptDataset, PromptIterator, addition, mixed, multiplication,
                         reverse, write_jsonl)
from hpc_rl.envs import UnknownTaskError, extract_answer, score, verify_math, verify_reverse

# ---------------------------------------------------------------- tasks


def test_tasks_are_fixed_by_their_seed():
    # Written out: a change to templates, ranges or seeding shows up here, not in a run.
    assert addition(2, seed=7) == [
        {"prompt": "Add 87 and 18.", "answer": "105", "agent": "add_agent", "task": "addition"},
        {"prompt": "What is 83 plus 94?", "answer": "177", "agent": "add_agent", "task": "addition"},
    ]
    assert multiplication(2, seed=7) == [
        {"prompt": "What is 43 times 6?", "answer": "258", "agent": "mul_agent", "task": "multiplication"},
        {"prompt": "A box holds 98 pens. How many pens are in 4 boxes?", "answer": "392", "agent": "mul_agent",
         "task": "multiplication"},
    ]
    assert reverse(2, seed=7) == [
        {"prompt": "Reverse the word 'horse'.", "answer": "esroh", "agent": "reverse_agent", "task": "reverse"},
        {"prompt": "Write 'river' backwards.", "answer": "revir", "agent": "reverse_agent", "task": "reverse"},
    ]
    assert addition(50, seed=3) == addition(50, seed=3)
    assert addition(50, seed=3) != addition(50, seed=4)


def test_task_answers_are_correct_and_small():
    for s in addition(200, seed=1):
        a, b = map(int, re.findall(r"\d+", s["prompt"]))
        assert 10 <= a <= 99 and 10 <= b <= 99 and s["answer"] == str(a + b)
    for s in multiplication(200, seed=1):
        a, b = map(int, re.findall(r"\d+", s["prompt"]))
        assert 10 <= a <= 99 and 2 <= b <= 9 and s["answer"] == str(a * b)
    for s in reverse(200, seed=1):
        word = re.search(r"'([a-z]+)'", s["prompt"]).group(1)
        assert s["answer"] == word[::-1]
    # Every generated answer passes its own verifier.
    for s in mixed(30, seed=2):
        assert score(s["task"], f"The answer is {s['answer']}.", s["answer"]).reward == 1.0


def test_generated_file_loads_as_a_dataset(tmp_path):
    path = write_jsonl(tmp_path / "sub" / "train.jsonl", mixed(4, seed=0))
    ds = PromptDataset.from_jsonl(path)
    assert len(ds) == 12 and ds.skipped == 0
    assert [r.agent for r in ds[:3]] == ["add_agent", "mul_agent", "reverse_agent"]
    assert ds[0].id == "addition-0" and ds[0].task == "addition"


# ---------------------------------------------------------------- dataset


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"prompt": "What is 1 plus 2?", "agent": "add_agent", "answer": "3", "task": "addition"})


def test_bad_json_names_file_and_line(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD, GOOD, '{"prompt": "x", "agent": ', GOOD])
    with pytest.raises(DatasetError) as err:
        PromptDataset.from_jsonl(path)
    assert err.value.line == 3
    assert str(err.value).startswith(f"{path}:3: invalid JSON")


def test_missing_agent_names_file_line_and_field(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD, json.dumps({"prompt": "hi", "answer": "1"})])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: missing field 'agent'")):
        PromptDataset.from_jsonl(path)


def test_non_object_and_ill_typed_rows(tmp_path):
    cases = {
        "[1, 2]": "expected a JSON object, got list",
        '"just a string"': "expected a JSON object, got str",
        json.dumps({"prompt": 5, "agent": "a"}): "field 'prompt' must be a string or a list of chat messages, got int",
        json.dumps({"prompt": [{"role": "user"}], "agent": "a"}): "field 'prompt' message 0 must be an object",
        json.dumps({"prompt": "p", "agent": ""}): "field 'agent' must be a non-empty string",
        json.dumps({"prompt": "p", "agent": "a", "answer": True}): "field 'answer' must be a string or a number, got bool",
        json.dumps({"prompt": "p", "agent": "a", "task": 3}): "field 'task' must be a string, got int",
    }
    for i, (row, problem) in enumerate(cases.items()):
        path = _write(tmp_path / f"d{i}.jsonl", [row])
        with pytest.raises(DatasetError) as err:
            PromptDataset.from_jsonl(path)
        assert str(err.value).startswith(f"{path}:1: {problem}"), str(err.value)


def test_skip_invalid_counts_and_keeps_line_numbers(tmp_path):
    chat = json.dumps({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                       "agent": "chat_agent", "answer": 7, "id": 9})
    path = _write(tmp_path / "d.jsonl", [GOOD, chat, '{"prompt": "x", "agent": ', "", "[1]",
                                         json.dumps({"prompt": "p"}), GOOD])
    ds = PromptDataset.from_jsonl(path, skip_invalid=True)
    assert len(ds) == 3
    assert ds.skipped == 3 and ds.skipped_lines == [3, 5, 6]  # line 4 is blank: ignored, not an error
    assert ds[1].prompt == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert ds[1].answer == "7" and ds[1].id == "9"
    assert ds[2].id == "d.jsonl:7"  # default id: file and line


def test_iterator_batches_cover_each_epoch_once():
    data = list(range(10))
    it = PromptIterator(data, batch_size=4, seed=5)
    first = [x for _ in range(5) for x in next(it)]  # 20 items = exactly two epochs
    # Batch 3 ends epoch 0 with [8, 0] and is completed from epoch 1's order.
    assert first[:12] == [6, 5, 2, 4, 7, 1, 3, 9, 8, 0, 0, 8]
    assert sorted(first[:10]) == data and sorted(first[10:]) == data
    assert first[:10] != first[10:]  # reshuffled per epoch
    assert it.state_dict() == {"epoch": 1, "position": 10, "seed": 5, "num_rows": 10}
    again = PromptIterator(data, batch_size=4, seed=5)
    assert [x for _ in range(5) for x in next(again)] == first  # same seed, same order
    assert next(PromptIterator(data, batch_size=4, seed=5, shuffle=False)) == [0, 1, 2, 3]


def test_iterator_resume_matches_uninterrupted_run():
    data = [f"p{i}" for i in range(7)]
    straight = PromptIterator(data, batch_size=3, seed=11)
    expected = [next(straight) for _ in range(9)]

    a = PromptIterator(data, batch_size=3, seed=11)
    head = [next(a) for _ in range(4)]  # stops mid-epoch (12 of 14 rows into epoch 1)
    state = json.loads(json.dumps(a.state_dict()))  # as a checkpoint would store it
    assert state == {"epoch": 1, "position": 5, "seed": 11, "num_rows": 7}
    b = PromptIterator(data, batch_size=3, seed=0)  # the saved seed wins over the constructor's
    b.load_state_dict(state)
    assert head + [next(b) for _ in range(5)] == expected

    with pytest.raises(ValueError, match="saved for a dataset of 7 rows, this one has 6"):
        PromptIterator(data[:6], 3).load_state_dict(state)


# ---------------------------------------------------------------- verifiers

MATH_CASES = [
    # (response, reference, correct, extracted)
    ("The total is 1,000 apples.", "1000", True, "1,000"),
    ("So the answer is 1000", "1,000", True, "1000"),
    ("I think it is 12", "13", False, "12"),
    ("+5", "5", True, "+5"),
    ("It comes to 42.0", "42", True, "42.0"),
    ("result: 42.00", "42", True, "42.00"),
    ("-0", "0", True, "-0"),
    ("The value is -7.", "-7", True, "-7"),
    ("The value is 7.", "-7", False, "7"),
    ("3/4 of the cake", "0.75", True, "3/4"),
    ("0.75", "3/4", True, "0.75"),
    ("We get \\boxed{\\frac{3}{4}} in the end, not 5", "0.75", True, "3/4"),
    ("First 12 then \\boxed{258}. Check: 3 times", "258", True, "258"),
    ("48 + 57 = 105\n#### 105", "105", True, "105"),
    ("answer: 42, from 6 * 7", "42", True, "42"),
    ("The answer is 17 because 10 + 7 is 17, with 3 left", "17", True, "17"),
    ("9 - 5 = 4", "4", True, "4"),
    ("1,234,567", "1234567", True, "1,234,567"),
    ("I do not know.", "5", False, None),
    ("", "0", False, None),
]


@pytest.mark.parametrize("response,answer,correct,extracted", MATH_CASES)
def test_math_verifier(response, answer, correct, extracted):
    r = verify_math(response, answer)
    assert (r.correct, r.reward, r.extracted) == (correct, 1.0 if correct else 0.0, extracted)


def test_extract_answer_prefers_explicit_markers():
    assert extract_answer("\\boxed{7} and later 9") == "7"
    assert extract_answer("#### 3\nthen 4") == "3"
    assert extract_answer("Answer = -2; note 8") == "-2"
    assert extract_answer("no digits here") is None


@pytest.mark.parametrize("response,correct", [
    ("elppa", True), ("  'Elppa'. ", True), ('"ELPPA"', True), ("Answer: elppa", True),
    ("The reversed word is `elppa`.", True), ("apple", False), ("elpp a", False), ("", False),
])
def test_reverse_verifier(response, correct):
    r = verify_reverse(response, "elppa")
    assert (r.correct, r.reward) == (correct, 1.0 if correct else 0.0)


def test_registry_scores_by_task_and_rejects_unknown_tasks():
    assert score("addition", "It is 105", "105").reward == 1.0
    assert score("multiplication", "It is 259", "258").reward == 0.0
    assert score("reverse", "esroh", "esroh").reward == 1.0
    with pytest.raises(UnknownTaskError) as err:
        score("poetry", "roses", "red")
    assert str(err.value) == "no verifier for task 'poetry'; known tasks: addition, calculator, math, multiplication, reverse"

"""Episodes (hpc_rl/agentic): the environment contract and its registry, the limits
(turns, tokens, timeouts; truncation marked and scored by config), errors scored 0 and
counted, the calculator task and its tool, concurrency up to max_inflight. The policies are
real models: the tiny student or the tool-using teacher, through Hugging Face here and
through one shared vLLM engine in the slow tests."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_memory import in_process_fraction
import torch
from test_agentic_common import ChatterEnv, Recorder, check_token_exact, hf_logprobs, run

from hpc_rl.agentic.calculator import CalculatorEnv, CalculatorError, calculate
from hpc_rl.agentic.contract import Limits, SingleTurnEpisode, StepwiseEpisode
from hpc_rl.agentic.environments import build_environment, known_environments, register_environment
from hpc_rl.agentic.local import HFPolicy
from hpc_rl.agentic.runner import run_episode, run_episodes
from hpc_rl.data.tasks import GENERATORS, calculator


def _load(ref):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.rl.inputs import resolve_model_ref

    path = resolve_model_ref(ref)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), path


@pytest.fixture(scope="module")
def student():
    return _load("tiny:student")


@pytest.fixture(scope="module")
def teacher():
    return _load("tiny_agentic:teacher_calc")  # built on first use (about a minute here), then cached


def test_registry_builds_by_name_and_refuses_a_second_owner():
    assert {"calculator", "single_turn"} <= set(known_environments())
    assert isinstance(build_environment("calculator"), StepwiseEpisode)
    assert isinstance(build_environment("single_turn"), SingleTurnEpisode)
    with pytest.raises(KeyError, match="no agentic environment 'nope'"):
        build_environment("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_environment("calculator", lambda **cfg: SingleTurnEpisode())


def test_calculator_task_rows():
    rows = calculator(50, seed=3)
    assert rows == GENERATORS["calculator"](50, seed=3)
    for r in rows:
        a, b = [int(w.strip("?")) for w in r["prompt"].split()[2::2]]
        assert r["prompt"] == f"What is {a} times {b}?" and 10 <= a <= 99 and 10 <= b <= 99
        assert (r["answer"], r["agent"], r["task"]) == (str(a * b), "calc_agent", "calculator")


def test_calculator_computes_a_op_b_and_refuses_anything_else():
    assert [calculate(e) for e in ("37*58", " 37 x 58 ", "9-12", "+4+-3", "7/2", "8/4")] == \
        ["2146", "2146", "-3", "1", "7/2", "2"]
    for bad in ("__import__('os').system('true')", "2**100", "1+2+3", "37*58; 1", "abs(-3)", "", "3", "1e3*2",
                "1" * 13 + "*2", "8/0", 42, None):
        with pytest.raises(CalculatorError):
            calculate(bad)
    env = CalculatorEnv()
    run(env.reset({"prompt": "What is 37 times 58?", "answer": "2146"}))

    def call(name, arguments):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": name, "arguments": arguments}}]}

    out, done, reward, _ = run(env.step(call("calculator", '{"expression": "37*58"}')))
    assert (out, done, reward) == ([{"role": "tool", "content": "2146", "tool_call_id": "c0"}], False, 0.0)
    for name, args in (("calculator", '{"expression": "open(\'/etc/passwd\')"}'), ("shell", '{"cmd": "ls"}'),
                       ("calculator", '{"expression": "1+1", "x": 1}'), ("calculator", "not json")):
        (msg,), done, _, _ = run(env.step(call(name, args)))
        assert msg["content"].startswith("error:") and not done
    assert run(env.step({"role": "assistant", "content": " 2146", "tool_calls": []}))[1:] == (True, 1.0, True)
    assert run(env.step({"role": "assistant", "content": "2146.", "tool_calls": []}))[1:] == (True, 0.0, False)


def test_calculator_teacher_uses_the_tool(teacher):
    """The tool-using teacher, greedy through the episode code: the tool call parsed by vLLM's
    pythonic parser, the tool's answer read back; and a code-shaped call is not run."""
    model, tok, _ = teacher
    tasks = calculator(16, seed=777)
    batch = run(run_episodes(tasks, build_environment("calculator"), HFPolicy(model, tok), Limits(), tok, 4))
    m = batch.metrics()
    assert m["accuracy"] >= 0.9 and m["errors"] == 0 and m["changed_policy_tokens"] == 0, m
    rows, result = batch[0]
    a, b = tasks[0]["prompt"][8:-1].split(" times ")
    assert rows[0].text == f'[calculator(expression="{a}*{b}")]<|end|><|tool|>{int(a) * int(b)}<|end|>' \
                           f'<|assistant|>{int(a) * int(b)}<|end|>'
    assert rows[0].turns == 2 and result.info["turns"] == 2

    from hpc_rl.agentic.tools import parse_tool_calls, tool_parser

    parser = tool_parser("pythonic", tok)
    content, calls, malformed = parse_tool_calls(parser, '[calculator(expression=__import__("os"))]', 0)
    assert calls == [] and malformed  # a call with a non-literal argument is text, counted
    content, calls, malformed = parse_tool_calls(parser, '[calculator(expression="2*3")]', 1)
    assert calls == [{"id": "call_1_0", "type": "function",
                      "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}] and not malformed


def test_single_turn_adapter_is_todays_task(student):
    from hpc_rl.envs.registry import score
    from hpc_rl.models.assets import chat_prompt

    model, tok, _ = student
    tasks = GENERATORS["addition_1digit"](8, seed=5)
    batch = run(run_episodes(tasks, build_environment("single_turn"), HFPolicy(model, tok), Limits(), tok, 8))
    for task, (rows, result) in zip(tasks, batch):
        (row,) = rows
        assert row.prompt_ids == chat_prompt(tok, task["prompt"])  # the single-turn path's prompt
        assert row.loss_mask == [1] * len(row.response_ids) and row.turns == 1
        answer = tok.decode(row.response_ids, skip_special_tokens=True)
        assert result.reward == score("addition", answer, task["answer"]).reward


def test_max_turns_and_max_tokens_truncate_and_are_scored_by_config(student):
    model, tok, _ = student
    chatter = StepwiseEpisode(lambda: ChatterEnv(10))
    rows, result = run(run_episode({"prompt": "Hi"}, chatter, HFPolicy(model, tok), tok,
                                   Limits(max_turns=3, truncated_reward=-0.5)))
    assert (result.truncated, result.reward, result.info["truncated_by"], result.info["turns"]) == \
        (True, -0.5, "max_turns", 3)
    assert rows[0].truncated and rows[0].turns == 3
    rows, result = run(run_episode({"prompt": "Hi"}, chatter, HFPolicy(model, tok), tok,
                                   Limits(max_tokens=40, truncated_reward=-1.0)))
    assert (result.truncated, result.reward, result.info["truncated_by"]) == (True, -1.0, "max_tokens")
    assert len(rows[0].prompt_ids) + len(rows[0].response_ids) <= 40


class _HungEnv(ChatterEnv):
    async def step(self, msg):
        await asyncio.Event().wait()  # never set


class _SlowSyncEnv(ChatterEnv):
    def step(self, msg):  # a plain function: it runs in a thread, the event loop stays free
        time.sleep(2.0)
        return [], True, 1.0, True


class _HangsAfterOneTurn:
    async def run(self, task, chat):
        await chat([{"role": "user", "content": task["prompt"]}])
        await asyncio.sleep(3600)


def test_a_hung_environment_times_out(student):
    model, tok, _ = student
    policy = HFPolicy(model, tok)
    t0 = time.perf_counter()
    lim = Limits(turn_timeout_s=0.3, episode_timeout_s=None)
    _, hung = run(run_episode({"prompt": "Hi"}, StepwiseEpisode(_HungEnv), policy, tok, lim))
    _, slow = run(run_episode({"prompt": "Hi"}, StepwiseEpisode(_SlowSyncEnv), policy, tok, lim))
    rows, whole = run(run_episode({"prompt": "Hi"}, _HangsAfterOneTurn(), policy, tok,
                                  Limits(turn_timeout_s=None, episode_timeout_s=0.3, truncated_reward=-0.25)))
    assert hung.info["truncated_by"] == slow.info["truncated_by"] == "env_timeout"
    assert (whole.info["truncated_by"], whole.reward, whole.truncated) == ("episode_timeout", -0.25, True)
    assert len(rows) == 1 and rows[0].truncated  # the turn it did take is kept, marked
    assert time.perf_counter() - t0 < 2.5  # none waited for the hang (the sleeping thread ends on its own)


def test_an_episode_that_raises_scores_zero_and_is_counted(student):
    model, tok, _ = student

    class Flaky(ChatterEnv):
        async def step(self, msg):
            if self.task["prompt"] == "boom":
                raise RuntimeError("environment bug")
            return [], True, 1.0, True

        async def reset(self, task):
            self.task = task
            return await super().reset(task)

    tasks = [{"prompt": p} for p in ("a", "boom", "b", "c")]
    batch = run(run_episodes(tasks, StepwiseEpisode(Flaky), HFPolicy(model, tok), Limits(), tok, 2))
    assert [r.reward for _, r in batch] == [1.0, 0.0, 1.0, 1.0]
    assert batch[1][1].info["error"] == "RuntimeError: environment bug" and batch[1][1].correct is False
    assert batch.metrics()["errors"] == 1 and batch.metrics()["episodes"] == 4


def test_concurrency_reaches_max_inflight(student):
    model, tok, _ = student
    tasks = [{"prompt": f"Q{i}"} for i in range(10)]
    batch = run(run_episodes(tasks, StepwiseEpisode(lambda: ChatterEnv(3)), HFPolicy(model, tok), Limits(), tok, 3))
    assert batch.max_inflight == 3 and len(batch) == 10
    assert all(r.reward == 1.0 for _, r in batch)


# --- one vLLM engine (the teacher) for the rest of the module -------------------------------

@pytest.fixture(scope="module")
def engine(teacher):
    from hpc_rl.refit.vllm_engine import VLLMGenerator

    gen = VLLMGenerator(str(teacher[2]), precision="fp32", max_model_len=256, memory_fraction=in_process_fraction(), max_num_seqs=16)
    yield gen
    gen.close()


@pytest.mark.slow
def test_vllm_episodes_are_token_exact_and_agree_with_the_trainer(engine, teacher):
    """Sampled (temperature 1) multi-turn episodes on the engine, 8 at once: each sample's ids
    are the turns' prompts and generations verbatim, and a Hugging Face forward of the stored
    ids reproduces vLLM's logprobs on the policy's tokens (token_mult_prob_error <= 1.001)."""
    from hpc_rl.agentic.local import EnginePolicy
    from hpc_rl.algo.metrics import token_mult_prob_error

    model, tok, _ = teacher
    rec = Recorder(EnginePolicy(engine, temperature=1.0, seed=11))
    tasks = calculator(8, seed=31) + [{"prompt": f"Tell me about {w}."} for w in ("cats", "rain", "tea", "maps")]

    class Mixed:  # the calculator on its tasks, a 3-turn chat on the others
        async def run(self, task, chat):
            env = build_environment("calculator") if "answer" in task else StepwiseEpisode(lambda: ChatterEnv(3))
            return await env.run(task, chat)

    batch = run(run_episodes(tasks, Mixed(), rec, Limits(max_tokens_per_turn=48), tok, 8))
    rows = [row for rs, _ in batch for row in rs]
    assert len(rows) == 12 and batch.max_inflight == 8
    # sampled, the teacher still calls the tool and reads its answer on most tasks
    assert sum("<|tool|>" in r.text and r.turns == 2 for r in rows[:8]) >= 4
    assert [r.turns for r in rows[8:]] == [3] * 4
    lp_engine, lp_hf, mask = [], [], []
    for row in rows:
        mine = [c for c in rec.calls if c[0][:len(row.prompt_ids)] == row.prompt_ids]
        check_token_exact(row, mine)
        lp_engine += row.logprobs
        lp_hf += hf_logprobs(model, row)
        mask += row.loss_mask
    err = token_mult_prob_error(torch.tensor(lp_hf), torch.tensor(lp_engine), torch.tensor(mask, dtype=torch.bool))
    assert err <= 1.001, err
    assert batch.metrics()["changed_policy_tokens"] == 0 and batch.metrics()["errors"] == 0


@pytest.mark.slow
def test_vllm_engine_batches_concurrent_episodes(engine, teacher):
    from hpc_rl.agentic.local import EnginePolicy

    _, tok, _ = teacher
    policy = EnginePolicy(engine, temperature=0.0)
    batch = run(run_episodes(calculator(12, seed=99), build_environment("calculator"), policy, Limits(), tok, 4))
    assert batch.max_inflight == 4 and max(policy.batches) == 4  # four episodes' turns in one engine batch
    assert batch.metrics()["accuracy"] >= 0.9  # the teacher, greedy on vLLM

"""The generators' endpoint (#26, hpc_rl/serving): the per-job key, 401s (counted) for
requests without it, the routes' shapes and errors with a stand-in engine (fast), then one
real tiny vLLM engine serving through the loop: the token route agrees with the
generator's own sampler (ids, logprobs, weight versions), concurrent requests share the
engine's batches, the chat route renders the template and stays token-exact, and the key
reaches no file or log."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from engine_memory import in_process_fraction

from hpc_rl.runtime import signed_store
from hpc_rl.serving import (EndpointClient, EndpointError, RequestError, RequestQueue, TokenResult, endpoint_key, serve,
                            start_endpoint)

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]


def test_the_endpoint_key_is_an_hmac_of_the_job_key_and_not_the_job_key():
    env = {"HPC_RL_JOB_KEY": "ab" * 32}
    key = endpoint_key(env)
    assert key == hmac.new(("ab" * 32).encode(), b"hpc_rl generator endpoint", hashlib.sha256).hexdigest()
    assert len(key) == 64 and key != env["HPC_RL_JOB_KEY"]
    assert endpoint_key({"HPC_RL_JOB_KEY": "cd" * 32}) != key  # per job
    assert endpoint_key() == endpoint_key()  # this session's job key (conftest): every rank derives the same
    with pytest.raises(signed_store.MissingJobKey):
        endpoint_key({})


def _stub_submit(box=None):
    """A stand-in for the serving loop: answers at once with box["text"] as the generated
    text (token ids are its characters' codes), and records the requests."""
    seen, box = [], box if box is not None else {"text": "42"}

    def submit(req) -> Future:
        seen.append(req)
        fut: Future = Future()
        if req.prompt_token_ids == [999999]:
            fut.set_exception(RequestError("token id 999999 is out of vocabulary"))
        else:
            text = box["text"]
            ids = [ord(c) for c in text]
            fut.set_result(TokenResult(list(req.prompt_token_ids), ids, [-0.5] * len(ids), text, "stop", None, 3, 4))
        return fut

    return submit, seen


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    from hpc_rl.models.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    box = {"text": "42"}
    submit, seen = _stub_submit(box)
    key = endpoint_key()
    ep = start_endpoint("127.0.0.1", tok, submit, key, tool_parser="pythonic", model_name="tiny")
    yield {"ep": ep, "key": key, "tok": tok, "seen": seen, "box": box}
    ep.stop()


def _run(coro):
    return asyncio.run(coro)


async def _raw(url: str, method: str, path: str, headers=None, data=None):
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, headers=headers or {}, data=data) as r:
            return r.status, await r.json(content_type=None)


def test_requests_without_the_key_get_401_and_are_counted(stub):
    ep, key = stub["ep"], stub["key"]
    before = signed_store.REJECTED["endpoint"]
    cases = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": key}, {"Authorization": f"Bearer {key}x"},
             {"Authorization": f"bearer {key}"}, {"Authorization": "Bearer \u00e9\u00e9"}]
    for headers in cases:
        for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/tokens"), ("POST", "/v1/chat/completions"),
                             ("GET", "/no/such/route")]:
            status, body = _run(_raw(ep.url, method, path, headers, data=b'{"prompt_token_ids": [1]}'))
            assert status == 401, (headers, path)
            assert body["error"]["code"] == "invalid_api_key" and key not in str(body)
    assert signed_store.REJECTED["endpoint"] - before == 5 * len(cases)
    from hpc_rl.runtime.auth_stats import rank_report

    assert rank_report()["rejected_by_kind"]["endpoint"] >= 5 * len(cases)
    assert not stub["seen"], "a rejected request reached the engine"
    good = {"Authorization": f"Bearer {key}"}
    assert _run(_raw(ep.url, "GET", "/health", good)) == (200, {"status": "ok"})
    status, body = _run(_raw(ep.url, "GET", "/no/such/route", good))
    assert status == 404 and "error" in body


def test_bad_requests_get_400_and_the_server_keeps_serving(stub):
    ep, good = stub["ep"], {"Authorization": f"Bearer {stub['key']}"}
    bad = [("/v1/tokens", b"{not json"), ("/v1/tokens", b"[1, 2]"), ("/v1/tokens", b'{"prompt_token_ids": []}'),
           ("/v1/tokens", b'{"prompt_token_ids": [1, "a"]}'), ("/v1/tokens", b'{"prompt_token_ids": [1], "temperature": "hot"}'),
           ("/v1/tokens", b'{"prompt_token_ids": [1], "tempreature": 1}'), ("/v1/tokens", b'{"prompt_token_ids": [1], "stop": [1]}'),
           ("/v1/tokens", b'{"prompt_token_ids": [999999]}'),  # refused by the engine (RequestError)
           ("/v1/chat/completions", b'{"messages": "hi"}'),
           ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5}'),
           ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}'),
           ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'),
           ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}'),  # the template cannot render it
           ("/v1/completions", b'{"prompt": "1+1=", "logprobs": 3}'), ("/v1/completions", b'{"model": "x"}'),
           ("/v1/tokens", b"\xff\xfe")]
    for path, data in bad:
        status, body = _run(_raw(ep.url, "POST", path, good, data))
        assert status == 400, (path, data, status, body)
        assert body["error"]["message"], body
    assert _run(_raw(ep.url, "GET", "/health", good))[0] == 200


def test_routes_answer_in_openai_shapes_with_the_token_extras(stub):
    ep, tok = stub["ep"], stub["tok"]
    stub["box"]["text"] = "42"

    async def go():
        async with EndpointClient(ep.url, stub["key"], max_connections=4, timeout_s=30) as c:
            assert stub["key"] not in repr(c)
            t = await c.tokens([5, 6, 7], max_tokens=4, seed=1, stop=["\n"])
            chat = await c.chat([{"role": "user", "content": "2+2?"}], max_tokens=8, logprobs=True)
            cmpl = await c.completions("2+2=", max_tokens=8, logprobs=0)
            batch = await c.completions([[5, 6], [7, 8, 9]], max_tokens=8)
            models = await c.models()
            with pytest.raises(EndpointError) as err:
                await c.tokens([999999])
            return t, chat, cmpl, batch, models, err.value

    t, chat, cmpl, batch, models, err = _run(go())
    assert t == {"token_ids": [52, 50], "logprobs": [-0.5, -0.5], "weight_version_first": 3, "weight_version_last": 4,
                 "finish_reason": "stop"}
    req = stub["seen"][-1 - 5]  # the token request (chat, completions x3 and the refused one came after)
    assert (req.max_tokens, req.seed, req.stop) == (4, 1, ["\n"])
    assert err.status == 400 and "out of vocabulary" in err.message
    c0 = chat["choices"][0]
    assert chat["object"] == "chat.completion" and chat["model"] == "tiny"
    assert c0["message"] == {"role": "assistant", "content": "42"} and c0["finish_reason"] == "stop"
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False)
    assert chat["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    assert c0["token_ids"] == [52, 50] and c0["token_logprobs"] == [-0.5, -0.5]
    assert [x["logprob"] for x in c0["logprobs"]["content"]] == [-0.5, -0.5]
    assert chat["usage"] == {"prompt_tokens": len(chat["prompt_token_ids"]), "completion_tokens": 2,
                             "total_tokens": len(chat["prompt_token_ids"]) + 2}
    k0 = cmpl["choices"][0]
    assert cmpl["object"] == "text_completion" and k0["text"] == "42" and k0["prompt_token_ids"] == tok.encode("2+2=")
    assert k0["logprobs"]["token_logprobs"] == [-0.5, -0.5] and k0["logprobs"]["text_offset"] == [0, 1]
    assert [c["prompt_token_ids"] for c in batch["choices"]] == [[5, 6], [7, 8, 9]]
    assert models["data"][0]["id"] == "tiny"


def test_return_tokens_as_token_ids_names_each_logprob_by_its_id_as_nemo_gym_reads_it(stub):
    """NeMo Gym's vllm_model server (return_token_id_information) asks with logprobs=True,
    top_logprobs=0 and return_tokens_as_token_ids=True, then reads the generated ids from
    `logprobs.content[].token == "token_id:N"` and checks them against choice.token_ids."""
    ep = stub["ep"]
    stub["box"]["text"] = "42"

    async def go():
        async with EndpointClient(ep.url, stub["key"], max_connections=2) as c:
            gym = await c.chat([{"role": "user", "content": "2+2?"}], max_tokens=8, logprobs=True, top_logprobs=0,
                               return_tokens_as_token_ids=True)
            plain = await c.chat([{"role": "user", "content": "2+2?"}], max_tokens=8, logprobs=True)
            return gym, plain

    gym, plain = _run(go())
    g0 = gym["choices"][0]
    assert [x["token"] for x in g0["logprobs"]["content"]] == ["token_id:52", "token_id:50"]
    assert [int(x["token"].removeprefix("token_id:")) for x in g0["logprobs"]["content"]] == g0["token_ids"]
    assert [x["logprob"] for x in g0["logprobs"]["content"]] == [-0.5, -0.5]
    assert gym["prompt_token_ids"] == plain["prompt_token_ids"] and g0["message"]["content"] == "42"
    tok = stub["tok"]  # text pieces unless asked
    assert [x["token"] for x in plain["choices"][0]["logprobs"]["content"]] == [tok.decode([52]), tok.decode([50])]


def test_the_chat_route_parses_pythonic_tool_calls_with_vllms_parser(stub):
    ep = stub["ep"]
    stub["box"]["text"] = "[calc(expr='12*7')]"

    async def go():
        async with EndpointClient(ep.url, stub["key"], max_connections=2) as c:
            called = await c.chat([{"role": "user", "content": "12*7?"}], tools=TOOLS)
            plain = await c.chat([{"role": "user", "content": "12*7?"}], tools=TOOLS, tool_choice="none")
            no_tools = await c.chat([{"role": "user", "content": "12*7?"}])
            stub["box"]["text"] = "84"
            # the next turn: the assistant's tool call goes back with its text as content
            # (the tiny chat template renders content only), then the tool's answer
            turn = dict(called["choices"][0]["message"], content="[calc(expr='12*7')]")
            answer = await c.chat([{"role": "user", "content": "12*7?"}, turn, {"role": "tool", "content": "84"}], tools=TOOLS)
            with pytest.raises(EndpointError) as err:
                await c.chat([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required")
            return called, plain, no_tools, answer, err.value

    called, plain, no_tools, answer, err = _run(go())
    choice = called["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"] == {"name": "calc", "arguments": '{"expr": "12*7"}'}
    assert choice["token_ids"] == [ord(c) for c in "[calc(expr='12*7')]"]  # the policy's tokens, whatever the parse
    for other in (plain, no_tools):
        assert other["choices"][0]["message"] == {"role": "assistant", "content": "[calc(expr='12*7')]"}
    assert answer["choices"][0]["message"]["content"] == "84"
    assert stub["tok"].decode(answer["prompt_token_ids"]).endswith("<|assistant|>[calc(expr='12*7')]<|end|><|tool|>84<|end|><|assistant|>")
    assert err.status == 400


def test_an_endpoint_without_a_tool_parser_refuses_tools(stub):
    submit, _ = _stub_submit()
    ep = start_endpoint("127.0.0.1", stub["tok"], submit, "k" * 64)
    try:
        status, body = _run(_raw(ep.url, "POST", "/v1/chat/completions", {"Authorization": "Bearer " + "k" * 64},
                                 b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                                 b'"function": {"name": "calc"}}]}'))
        assert status == 400 and "tool parser" in body["error"]["message"]
    finally:
        ep.stop()
    with pytest.raises(ValueError, match="unknown tool parser"):
        start_endpoint("127.0.0.1", stub["tok"], submit, "k" * 64, tool_parser="no_such_parser")


# --- one real tiny engine for the rest ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from hpc_rl.models.assets import ModelSpec, save_untrained
    from hpc_rl.refit.vllm_engine import VLLMGenerator

    root = tmp_path_factory.mktemp("serving")
    gen = VLLMGenerator(str(save_untrained(root / "tiny", ModelSpec())), precision="fp32", max_model_len=128,
                        memory_fraction=in_process_fraction(), max_num_seqs=64)
    requests, key = RequestQueue(), endpoint_key()
    ep = start_endpoint("127.0.0.1", gen.tokenizer, requests.submit, key, tool_parser="pythonic")
    yield {"gen": gen, "requests": requests, "ep": ep, "key": key, "root": root}
    ep.stop()
    gen.close()


def _serve_while(rig, episode, between_steps=None):
    """Run `episode(client)` in a thread of its own against the endpoint while this thread
    (the generator's, as in a generator rank) runs the serving loop until the episode ends."""
    out, done = {}, threading.Event()

    def client_side():
        async def main():
            async with EndpointClient(rig["ep"].url, rig["key"], max_connections=64, timeout_s=300) as c:
                return await episode(c)
        try:
            out["result"] = asyncio.run(main())
        except BaseException as exc:
            out["error"] = exc
        finally:
            done.set()

    t = threading.Thread(target=client_side)
    t.start()
    stats = serve(rig["gen"], rig["requests"], done.is_set, between_steps)
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"], stats


def _prompt_ids(gen, question: str):
    return gen.tokenizer.encode(gen.chat_prompts([question])[0], add_special_tokens=False)


@pytest.mark.slow
def test_the_token_route_agrees_with_the_generators_own_sampler(engine):
    gen = engine["gen"]
    prompts = gen.chat_prompts(["12+7=", "3*4="])
    seeded = gen.sample(prompts, temperature=1.0, max_tokens=12, seed=[5, 6])
    greedy = gen.sample(prompts[:1], temperature=0.0, max_tokens=12)

    async def episode(c):
        outs = [await c.tokens(r.prompt_ids, max_tokens=12, temperature=1.0, seed=s) for r, s in zip(seeded, [5, 6])]
        return outs + [await c.tokens(greedy[0].prompt_ids, max_tokens=12, temperature=0.0)]

    outs, stats = _serve_while(engine, episode)
    for row, out in zip(seeded + greedy, outs):
        assert out["token_ids"] == row.response_ids
        assert out["logprobs"] == pytest.approx(row.logprobs, abs=1e-5)
        assert out["weight_version_first"] == out["weight_version_last"] == 0
        assert out["finish_reason"] == ("length" if row.truncated else "stop")
    assert (stats.requests, stats.finished, stats.failed) == (3, 3, 0)


@pytest.mark.slow
def test_a_weight_version_change_mid_request_shows_in_first_and_last(engine):
    # what an in-flight refit does to the engine's labels, without the refit: after the
    # third scheduler step the tokens are labelled version 1
    gen, steps = engine["gen"], [0]

    def between_steps():
        steps[0] += 1
        if steps[0] == 3:
            gen._core().set_weight_version("1")

    async def episode(c):
        return await c.tokens(_prompt_ids(gen, "1+1="), max_tokens=10, ignore_eos=True, seed=1)

    try:
        out, _ = _serve_while(engine, episode, between_steps)
    finally:
        gen._core().set_weight_version("0")
    assert len(out["token_ids"]) == 10 and out["finish_reason"] == "length"
    assert (out["weight_version_first"], out["weight_version_last"]) == (0, 1)


@pytest.mark.slow
def test_concurrent_requests_share_the_engines_batches(engine):
    gen = engine["gen"]
    # the engine core runs in this process on CPU (in_process_core): its scheduler's running
    # list is the batch each step ran
    scheduler = getattr(getattr(gen.llm.llm_engine.engine_core, "engine_core", None), "scheduler", None)
    running = []

    def between_steps():
        if scheduler is not None:
            running.append(len(scheduler.running))

    async def episode(c):
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.tokens(_prompt_ids(gen, f"{i}+{i}="), max_tokens=16, ignore_eos=True, seed=i)
                                      for i in range(32)))
        return outs, time.perf_counter() - t0

    (outs, seconds), stats = _serve_while(engine, episode, between_steps)
    assert all(len(o["token_ids"]) == 16 and len(o["logprobs"]) == 16 for o in outs)
    assert (stats.requests, stats.finished) == (32, 32)
    print(f"32 requests x 16 tokens: {seconds:.2f} s, {stats.steps} steps, max batch {stats.max_batch}, "
          f"max running {max(running, default=0)}")
    assert stats.max_batch > 1
    assert stats.steps < 32 * 16 // 2, "the requests ran (nearly) one at a time"
    if scheduler is not None:
        assert max(running) > 1


@pytest.mark.slow
def test_the_chat_route_renders_the_template_and_matches_the_sampler(engine):
    gen = engine["gen"]
    row = gen.sample(gen.chat_prompts(["12+7="]), temperature=1.0, max_tokens=12, seed=[3])[0]

    async def episode(c):
        chat = await c.chat([{"role": "user", "content": "12+7="}], tools=TOOLS, max_tokens=12, seed=3, temperature=1.0)
        with pytest.raises(EndpointError) as err:  # longer than the engine's 128-token context
            await c.tokens([10] * 200, max_tokens=4)
        return chat, err.value, await c.tokens([10, 11, 12], max_tokens=2)

    chat, err, after = _serve_while(engine, episode)[0]
    c0 = chat["choices"][0]
    assert chat["prompt_token_ids"] == row.prompt_ids
    assert c0["token_ids"] == row.response_ids and c0["token_logprobs"] == pytest.approx(row.logprobs, abs=1e-5)
    # a random model writes no pythonic call: the parser leaves its text as the content
    assert c0["message"] == {"role": "assistant", "content": row.text} and c0["finish_reason"] in ("stop", "length")
    assert err.status == 400 and len(after["token_ids"]) >= 1  # the refused request did not stop the loop


@pytest.mark.slow
def test_the_key_reaches_no_file_and_no_log(engine, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    key, gen = engine["key"], engine["gen"]

    async def episode(c):
        await c.chat([{"role": "user", "content": "2+2="}], max_tokens=4)
        async with EndpointClient(engine["ep"].url, "wrong", max_connections=1) as bad:
            with pytest.raises(EndpointError):
                await bad.tokens([1, 2])
        with pytest.raises(EndpointError):
            await c.tokens([1], temperature=-3.0)
        return True

    _serve_while(engine, episode)
    out = capfd.readouterr()
    assert key not in out.out + out.err + caplog.text
    files = [p for p in Path(engine["root"]).rglob("*") if p.is_file()]
    assert files and not [p for p in files if key.encode() in p.read_bytes()]
    assert key not in repr(engine["ep"])
    del gen


@pytest.mark.slow
def test_a_client_that_gives_up_frees_the_engine(engine):
    # the request would run 100 steps of 20 ms or more; the client waits 0.5 s, disconnects,
    # and the loop aborts the request in the engine rather than generating it for nobody
    gen = engine["gen"]

    async def episode(c):
        await c.tokens(_prompt_ids(gen, "1+1="), max_tokens=2)  # a fresh engine's first steps are slow
        with pytest.raises(asyncio.TimeoutError):
            await c.tokens(_prompt_ids(gen, "1+1="), max_tokens=100, ignore_eos=True, timeout_s=0.5)
        return True

    _, stats = _serve_while(engine, episode, lambda: time.sleep(0.02))
    assert (stats.requests, stats.cancelled, stats.finished) == (2, 1, 1)
    assert stats.steps < 60, stats

"""The generator's HTTP endpoint: OpenAI-compatible chat and completions plus a token route,
served from a daemon thread with its own event loop, every route behind the job's
endpoint key (serving/key.py).

Why our own small aiohttp server and not vLLM's api_server: vLLM's server drives an
AsyncLLM engine of its own, while the generator drives one synchronous engine for its
sampling and its in-flight refits (refit/vllm_engine.py); a second engine would double the
model's memory. So this thread only parses, renders chats to token ids, and hands
TokenRequests to the engine's serving loop (serving/loop.py) through `submit`; the loop,
in the generator's main thread, batches them continuously. What fits from vLLM's serving
code is used: its OpenAI protocol models validate the requests, its tool parsers read the
tool calls, its message post-processing prepares assistant tool calls for the template.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from aiohttp import web

from hpc_rl.runtime.signed_store import reject

from .loop import RequestError, TokenRequest, TokenResult

log = logging.getLogger("hpc_rl.serving")
REJECT_LABEL = "endpoint"  # the auth counters' kind (runtime/auth_stats.py) for requests without the key
CHAT_FIELDS = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
               "stop_token_ids", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs", "n", "stream",
               "ignore_eos", "min_tokens", "return_token_ids", "return_tokens_as_token_ids", "user", "add_generation_prompt",
               "chat_template_kwargs"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                     "logprobs", "n", "stream", "ignore_eos", "min_tokens", "return_token_ids", "user"}
TOKEN_FIELDS = {"prompt_token_ids": list, "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
                "stop": list, "stop_token_ids": list, "min_tokens": int, "ignore_eos": bool}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.code = status, code


def _error(status: int, message: str, code: Optional[str] = None) -> web.Response:
    """OpenAI's error shape."""
    kind = {401: "invalid_request_error", 404: "not_found_error"}.get(status, "invalid_request_error" if status < 500 else
                                                                     "internal_server_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code or status}}, status=status)


@dataclass
class Endpoint:
    """A running endpoint: where it listens, and how to stop it."""

    host: str
    port: int
    _loop: asyncio.AbstractEventLoop = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)


def tool_parser_class(name: str):
    """vLLM's tool parser registered as `name` (e.g. "pythonic", "hermes", "llama3_json").
    Only the parsers that read a finished output's text: the engine-based ones need vLLM's
    own serving stack."""
    from vllm.parser.engine.adapters import ParserEngineToolAdapter
    from vllm.tool_parsers import ToolParserManager

    try:
        cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; vLLM has {ToolParserManager.list_registered()}") from None
    if issubclass(cls, ParserEngineToolAdapter):
        raise ValueError(f"tool parser {name!r} is engine-based (it needs vLLM's own server); choose a text parser")
    return cls


def start_endpoint(host: str, tokenizer, submit: Callable[[TokenRequest], Any], key: str, tool_parser: Optional[str] = None,
                   model_name: str = "hpc_rl", max_body_bytes: int = 64 << 20, start_timeout_s: float = 30.0) -> Endpoint:
    """Serve on `host`, an ephemeral port, from a daemon thread. `submit(TokenRequest)` returns
    a concurrent.futures.Future resolved with a TokenResult (RequestQueue.submit). `key`: the
    bearer token every route requires (endpoint_key()). `tool_parser`: vLLM's parser name."""
    if not key:
        raise ValueError("the endpoint needs a key")
    parser_cls = tool_parser_class(tool_parser) if tool_parser else None
    # vLLM's protocol imports are slow: here, not in the first request's handler
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    api = _Api(tokenizer, submit, parser_cls, model_name, ChatCompletionRequest, CompletionRequest)
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def authorize(request: web.Request, handler):
        # before routing and before the body is read; constant-time, one counter for all routes
        given = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, expected):
            reject(REJECT_LABEL)
            return _error(401, "a valid API key is required (Authorization: Bearer <key>)", "invalid_api_key")
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(exc.status, str(exc), exc.code)
        except RequestError as exc:  # the engine refused the request
            return _error(400, str(exc))
        except web.HTTPException as exc:  # unknown route, wrong method, body too large
            return _error(exc.status, exc.reason)
        except Exception as exc:  # never the server thread's end: the request gets a 500
            log.exception("endpoint: %s %s failed", request.method, request.path)
            return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    ready, box = threading.Event(), {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            app = web.Application(middlewares=[authorize], client_max_size=max_body_bytes)
            app.add_routes([web.post("/v1/tokens", api.tokens), web.post("/v1/completions", api.completions),
                            web.post("/v1/chat/completions", api.chat), web.get("/v1/models", api.models),
                            web.get("/health", api.health)])
            # no access log: request lines are noise at rollout rates (and headers stay out of logs).
            # handler_cancellation: a client that gives up (an episode's turn timeout) cancels
            # its handler, hence its request's future, and the serving loop aborts the request
            # in the engine instead of generating its tokens for nobody.
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0, handler_cancellation=True)
            loop.run_until_complete(runner.setup())
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            loop.run_until_complete(web.SockSite(runner, sock, backlog=1024).start())
            box.update(port=sock.getsockname()[1], loop=loop)
        except BaseException as exc:
            box["error"] = exc
            ready.set()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    thread = threading.Thread(target=run, name="hpc_rl-endpoint", daemon=True)
    thread.start()
    if not ready.wait(start_timeout_s):
        raise RuntimeError(f"the endpoint did not start on {host} within {start_timeout_s} s")
    if "error" in box:
        raise RuntimeError(f"the endpoint could not listen on {host}: {box['error']!r}") from box["error"]
    return Endpoint(host, box["port"], box["loop"], thread)


async def _body(request: web.Request) -> Dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _is(value, typ) -> bool:
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, typ) and (typ is bool or not isinstance(value, bool))


def token_request(body: Dict[str, Any]) -> TokenRequest:
    """The token route's body, checked by hand: it is ours, so unknown fields are errors."""
    unknown = sorted(set(body) - set(TOKEN_FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; the token route takes {sorted(TOKEN_FIELDS)}")
    ids = body.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or not all(_is(t, int) and t >= 0 for t in ids):
        raise BadRequest("prompt_token_ids must be a non-empty list of token ids (integers >= 0)")
    if isinstance(body.get("stop"), str):
        body = dict(body, stop=[body["stop"]])
    kwargs: Dict[str, Any] = {}
    for name, typ in TOKEN_FIELDS.items():
        value = body.get(name)
        if name == "prompt_token_ids" or value is None:
            continue
        if not _is(value, typ):
            raise BadRequest(f"{name} must be {'a number' if typ is float else 'an ' + typ.__name__}, not {value!r}")
        if name == "stop" and not all(isinstance(s, str) for s in value):
            raise BadRequest("stop must be a string or a list of strings")
        if name == "stop_token_ids" and not all(_is(t, int) for t in value):
            raise BadRequest("stop_token_ids must be a list of integers")
        kwargs[name] = float(value) if typ is float else value
    return TokenRequest(list(ids), **kwargs)


class _Api:
    """The routes' handlers (they run in the endpoint's event loop)."""

    def __init__(self, tokenizer, submit, parser_cls, model_name: str, chat_cls, completion_cls):
        self.tokenizer, self.submit, self.parser_cls, self.model_name = tokenizer, submit, parser_cls, model_name
        self.chat_cls, self.completion_cls = chat_cls, completion_cls
        self.created = int(time.time())

    async def _run(self, req: TokenRequest) -> TokenResult:
        return await asyncio.wrap_future(self.submit(req))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                              "owned_by": "hpc_rl"}]})

    async def tokens(self, request: web.Request) -> web.Response:
        res = await self._run(token_request(await _body(request)))
        return web.json_response(res.token_route())

    def _validate(self, cls, body: Dict[str, Any], allowed: set):
        """vLLM's protocol model of the request, or 400. Fields we do not implement are
        refused when set to anything but their default (never silently ignored); fields
        the protocol does not know are ignored, as vLLM's own server does."""
        from pydantic import ValidationError
        from vllm.exceptions import VLLMValidationError

        try:
            req = cls.model_validate(body)
        except ValidationError as exc:
            raise BadRequest("invalid request: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                             for e in exc.errors()[:5])) from None
        except (ValueError, VLLMValidationError) as exc:  # vLLM's validators raise its own error class
            raise BadRequest(str(exc)) from None
        bad = [name for name in sorted(req.model_fields_set - allowed) if name in type(req).model_fields
               and getattr(req, name) != type(req).model_fields[name].get_default(call_default_factory=True)]
        if bad:
            raise BadRequest(f"not supported by this endpoint: {bad}")
        if req.n not in (None, 1) or req.stream:
            raise BadRequest("this endpoint serves n=1 without streaming")
        return req

    def _sampling(self, req, ids: List[int], max_tokens: Optional[int]) -> TokenRequest:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        # OpenAI's defaults (temperature 1, top_p 1), not a checkpoint's generation config:
        # rollouts sample the policy's own distribution unless the caller says otherwise
        return TokenRequest(ids, max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                            seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []), min_tokens=req.min_tokens,
                            ignore_eos=req.ignore_eos)

    @staticmethod
    def _extras(res: TokenResult) -> Dict[str, Any]:
        """Beyond OpenAI's shape, in every choice: what a client needs to stay token-exact
        (vLLM's `token_ids`, as with its return_token_ids) and to train on the sample."""
        return {"token_ids": res.token_ids, "token_logprobs": res.logprobs, "weight_version_first": res.weight_version_first,
                "weight_version_last": res.weight_version_last}

    @staticmethod
    def _usage(results: List[TokenResult]) -> Dict[str, int]:
        p, c = sum(len(r.prompt_token_ids) for r in results), sum(len(r.token_ids) for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def render(self, messages: List[Dict[str, Any]], tools=None, template_kwargs=None) -> List[int]:
        """The chat's prompt ids: the tokenizer's chat template with the generation prompt,
        then the rendered text tokenized without special tokens added (as vLLM does)."""
        from vllm.renderers.chat_utils import _postprocess_messages

        msgs = []
        for m in messages:
            m = dict(m)
            if isinstance(m.get("content"), list):  # OpenAI's content parts: text only here
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in m["content"]):
                    raise BadRequest("only text content parts are supported")
                m["content"] = "\n".join(p.get("text", "") for p in m["content"])
            msgs.append(m)
        try:
            _postprocess_messages(msgs)  # vLLM's: assistant tool-call arguments as dicts, as HF templates expect
            text = self.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False,
                                                      **(template_kwargs or {}))
        except Exception as exc:
            raise BadRequest(f"the chat template could not render the messages: {type(exc).__name__}: {exc}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def parse_tools(self, text: str, req) -> tuple:
        """(content, tool calls as OpenAI dicts) by vLLM's tool parser; one parser per
        request, as vLLM does (parsers keep state)."""
        info = self.parser_cls(self.tokenizer, req.tools).extract_tool_calls(text, req)
        if not info.tools_called:
            return text, []
        calls = [tc.model_dump(mode="json") for tc in info.tool_calls]
        return info.content, calls[:1] if req.parallel_tool_calls is False else calls

    async def chat(self, request: web.Request) -> web.Response:
        body = await _body(request)
        req = self._validate(self.chat_cls, body, CHAT_FIELDS)
        if req.top_logprobs:
            raise BadRequest("top_logprobs is not supported: the engine reports the sampled token's logprob only")
        choice = req.tool_choice
        if req.tools and choice not in (None, "auto", "none"):
            raise BadRequest('tool_choice "required" and named tools are not supported (they need structured outputs); use "auto"')
        parse = bool(req.tools) and choice != "none"
        if parse and self.parser_cls is None:
            raise BadRequest("tools need a tool parser, and this endpoint has none configured")
        ids = self.render(body["messages"], body.get("tools"), req.chat_template_kwargs)
        # max_tokens from the body: vLLM's model warns on reading its deprecated field
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else body.get("max_tokens")
        res = await self._run(self._sampling(req, ids, limit))
        content, calls = self.parse_tools(res.text, req) if parse else (res.text, [])
        message: Dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        # return_tokens_as_token_ids (vLLM's; NeMo Gym's vllm_model sends it): each logprob entry
        # names its token as "token_id:N", so a client reads the ids without re-tokenizing text
        pieces = ([f"token_id:{t}" for t in res.token_ids] if req.return_tokens_as_token_ids
                  else self._pieces(res.token_ids))
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(pieces, res.logprobs)]} if req.logprobs else None
        out = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": "tool_calls" if calls else res.finish_reason,
               "stop_reason": res.stop_reason, **self._extras(res)}
        return web.json_response({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": [out], "usage": self._usage([res]),
                                  "prompt_token_ids": res.prompt_token_ids})

    def _pieces(self, ids: List[int]) -> List[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    async def completions(self, request: web.Request) -> web.Response:
        req = self._validate(self.completion_cls, await _body(request), COMPLETION_FIELDS)
        if req.logprobs not in (None, 0):
            raise BadRequest("logprobs above 0 are not supported: the engine reports the sampled token's logprob only")
        p = req.prompt
        if p is None or p == [] or p == "":
            raise BadRequest("prompt is required")
        prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        ids = [self.tokenizer.encode(q) if isinstance(q, str) else list(q) for q in prompts]
        results = await asyncio.gather(*(self._run(self._sampling(req, i, req.max_tokens)) for i in ids))
        choices = []
        for k, res in enumerate(results):
            logprobs = None
            if req.logprobs is not None:
                pieces = self._pieces(res.token_ids)
                offsets = [0, *itertools.accumulate(len(s) for s in pieces)][:len(pieces)]
                logprobs = {"tokens": pieces, "token_logprobs": res.logprobs, "top_logprobs": None, "text_offset": offsets}
            choices.append({"index": k, "text": res.text, "logprobs": logprobs, "finish_reason": res.finish_reason,
                            "stop_reason": res.stop_reason, "prompt_token_ids": res.prompt_token_ids, **self._extras(res)})
        return web.json_response({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": choices, "usage": self._usage(list(results))})

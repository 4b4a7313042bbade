"""NeMo Gym's servers for one environment, under Gym's own interpreter (gym_bridge.py is the
env rank's side: the proxy and the episodes).

`gym env start` runs Gym's head server, the resources server, its agent and Gym's vllm_model
model server, each from the interpreter's own environment (no per-server uv venvs), the
model server pointed at the rank's proxy by a 0600 config file in a 0700 directory (the
proxy's key never on a command line). With private_network the interpreter runs under
`bwrap --unshare-net`: Gym's servers and Ray have no port on the node, and a forwarder inside
the namespace relays two unix sockets of that directory (proxy.sock outward, gym.sock
inward). The processes die with the env rank: a parent-death
signal on the interpreter, the rank's process group, and with tests/gym_python.sh's
interpreter a bubblewrap pid namespace that dies with it (--die-with-parent).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
DIR_ROOT, DIR_PREFIX = "/tmp", "hpc_rl_gym_"  # a rank's 0700 directory (the sandbox shares /tmp)
log = logging.getLogger("hpc_rl.agentic.gym")
READY_LINE = "servers ready!"  # `gym env start` prints "All N / N servers ready! ..." once every server answers
SERVER_KINDS = ("resources_servers", "responses_api_agents", "responses_api_models", "environment_servers")

# Run by the Gym interpreter: every Gym server runs from that interpreter's own environment
# (one install, no per-server uv venvs: `+skip_venv_if_present` finds a .venv link per
# server under `+uv_venv_dir`), then Gym's CLI. Also the preflight (argv[1] == "check").
LAUNCH = r"""
import json, os, sys
from pathlib import Path
import nemo_gym
spec = json.loads(sys.argv[1]) if sys.argv[1] != "check" else json.loads(sys.argv[2])
roots = [Path(d) for d in spec["search_dirs"]] + [Path(nemo_gym.PARENT_DIR)]
found = {k: sorted({s.name for r in roots if (r / k).is_dir() for s in (r / k).iterdir() if s.is_dir()})
         for k in %(kinds)r}
if sys.argv[1] == "check":
    rs = spec["resources_server"]
    cfg = [r / "resources_servers" / rs / "configs" / (rs + ".yaml") for r in roots]
    print(json.dumps({"prefix": sys.prefix, "gym": nemo_gym.__version__ if hasattr(nemo_gym, "__version__") else "",
                      "resources_servers": found["resources_servers"], "config": [str(c) for c in cfg if c.exists()]}))
    sys.exit(0)
venvs = Path(spec["venvs"])
for kind, names in found.items():
    for name in names:
        link = venvs / kind / name / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(sys.prefix)
argv = list(spec["argv"])
if spec.get("bridge"):
    # a private network namespace: Gym's model calls leave it through a unix socket to the
    # rank's proxy, the rank's calls enter it through another (to the port its Host names)
    import asyncio, re, socket, threading
    bridge = Path(spec["bridge"])

    async def pipe(r, w):
        try:
            while True:
                data = await r.read(65536)
                if not data:
                    break
                w.write(data)
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def outward(r, w):
        pr, pw = await asyncio.open_unix_connection(str(bridge / "proxy.sock"))
        await asyncio.gather(pipe(r, pw), pipe(pr, w))

    async def inward(r, w):
        head = await r.readuntil(b"\r\n\r\n")
        port = int(re.search(rb"(?im)^host:[^\r\n]*:(\d+)\s*$", head).group(1))
        tr, tw = await asyncio.open_connection("127.0.0.1", port)
        tw.write(head)
        await asyncio.gather(pipe(r, tw), pipe(tr, w))

    loop = asyncio.new_event_loop()
    out_srv = loop.run_until_complete(asyncio.start_server(outward, "127.0.0.1", 0))
    loop.run_until_complete(asyncio.start_unix_server(inward, str(bridge / "gym.sock")))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    argv.append("++policy_base_url=http://127.0.0.1:%d/v1" % out_srv.sockets[0].getsockname()[1])
from nemo_gym.cli.main import main
sys.argv = ["gym", *argv]
main()
""".replace("%(kinds)r", repr(SERVER_KINDS))


def interpreter(python: str) -> List[str]:
    """The configured interpreter as argv (a command may carry arguments; relative to the repo)."""
    parts = python.split()
    p = Path(parts[0])
    return [str(p if p.is_absolute() else REPO / p), *parts[1:]]


def search_dirs(dirs) -> List[str]:
    return [str(Path(d) if Path(d).is_absolute() else REPO / d) for d in dirs]


def gym_env() -> Dict[str, str]:
    """The environment Gym's processes get: the rank's, without the job's key or our Python."""
    env = {k: v for k, v in os.environ.items() if k not in ("HPC_RL_JOB_KEY", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    return env


def _start_time(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid,
    it names the process even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap_stale_dirs(root: str = None) -> List[str]:
    """Remove this user's Gym directories whose owning rank is gone (SIGKILLed, so its atexit
    never ran); a directory whose owner is alive, or not yet written, is left alone. Returns
    the directories removed."""
    gone = []
    for d in Path(root or DIR_ROOT).glob(DIR_PREFIX + "*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            pid, start = (d / "owner").read_text().split()
            if _start_time(int(pid)) == start:
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(str(d))
    return gone


class GymServers:
    """`gym env start` for one environment, under the Gym interpreter, pointed at the proxy."""

    def __init__(self, python: str, resources_server: str, agent: Optional[str], dirs: List[str], args: List[str],
                 proxy, start_timeout_s: float = 600.0, private_network: bool = True):
        # A killed rank (no atexit) left its directory: the next rank on the node removes it
        reaped = reap_stale_dirs()
        if reaped:
            log.info("removed %d Gym directories of ranks that are gone: %s", len(reaped), reaped)
        self.dir = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=DIR_ROOT)  # 0700; the sandbox shares /tmp
        (Path(self.dir) / "owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        # Ray's session files go there too (RAY_TMPDIR), not into the node's /tmp/ray.
        # The rank's normal exit stops Gym and removes the directory (its config file holds the
        # proxy's key, dead with the rank's process, but the directory is litter)
        atexit.register(self.close)
        # private_network: Gym in a network namespace of its own (bubblewrap), reached only
        # through unix sockets in that 0700 directory; else Gym's servers on 127.0.0.1
        self.sock = f"{self.dir}/gym.sock" if private_network else None
        if private_network:
            proxy.serve_unix(f"{self.dir}/proxy.sock")
        cfg = Path(self.dir) / "hpc_rl.yaml"
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:  # JSON is YAML: Gym's --config reads it
            json.dump({"policy_base_url": proxy.url, "policy_api_key": proxy.key, "policy_model_name": proxy.model_name}, f)
        with socket.socket() as s:  # Gym's head server takes a fixed port (11000): one free now
            s.bind(("127.0.0.1", 0))
            head = s.getsockname()[1]
        self.head = f"http://127.0.0.1:{head}"
        argv = ["env", "start", "--resources-server", resources_server, "--model-type", "vllm_model", "--config", str(cfg),
                *[x for d in dirs for x in ("--search-dir", d)], "+skip_venv_if_present=true",
                f"+uv_venv_dir={self.dir}/venvs", "+model_endpoint_readiness_timeout_seconds=0",
                f"+head_server.port={head}",
                # Gym's training mode: the model server asks for token ids and log-probs and its agent
                # passes them on in its output items (a command-line override: vllm_model.yaml, read
                # after our config file, sets it false)
                "++policy_model.responses_api_models.vllm_model.return_token_id_information=true", *args]
        spec = json.dumps({"search_dirs": dirs, "venvs": f"{self.dir}/venvs", "argv": argv,
                           "bridge": self.dir if private_network else None})
        netns = ["bwrap", "--dev-bind", "/", "/", "--unshare-net", "--die-with-parent", "--"] if private_network else []
        self.tail: List[str] = []
        ready, started = threading.Event(), threading.Event()
        self._box: Dict[str, Any] = {}
        threading.Thread(target=self._run, args=([*netns, *interpreter(python), "-c", LAUNCH, spec], ready, started), daemon=True,
                         name="hpc_rl-gym").start()
        started.wait(60)
        if "error" in self._box:
            raise RuntimeError(f"the Gym interpreter did not start: {self._box['error']}")
        ready.wait(start_timeout_s)
        if not self._box.get("ready"):
            self.close()
            raise RuntimeError(f"NeMo Gym did not start {resources_server} within {start_timeout_s} s:\n"
                               + "\n".join(self.tail[-30:]))
        self.agent_url = self._agent(agent)

    def _run(self, argv, ready, started) -> None:
        """Start Gym, then read its output. In a thread that lives as long as Gym: the
        parent-death signal follows the thread that started the process. Gym's servers run in
        the rank's process group (the rank's supervisor kills them with its leftovers) and, with
        tests/gym_python.sh's wrapper, in a pid namespace that dies with it (bwrap --die-with-parent)."""
        def dies_with_parent():
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env=dict(gym_env(), RAY_TMPDIR=f"{self.dir}/ray"), cwd=self.dir, text=True, bufsize=1, preexec_fn=dies_with_parent)
        except OSError as exc:
            self._box["error"] = exc
            started.set()
            return
        started.set()
        for line in self.proc.stdout:
            self.tail = (self.tail + [line.rstrip()])[-200:]
            if READY_LINE in line and not ready.is_set():
                self._box["ready"] = True
                ready.set()
        self.tail.append(f"(gym exited, rc {self.proc.wait()})")
        ready.set()

    def _agent(self, agent: Optional[str]) -> str:
        servers = json.loads(self.get(f"{self.head}/server_instances"))
        agents = [s for s in servers if s.get("server_type") == "responses_api_agents"]
        chosen = [s for s in agents if agent in (None, s.get("process_name"))]
        if len(chosen) != 1:
            self.close()
            raise RuntimeError(f"env.agentic.gym.agent={agent!r}: Gym runs agents {[s.get('process_name') for s in agents]}; "
                               "name one of them")
        return chosen[0]["url"]

    def get(self, url: str) -> bytes:
        """GET one of Gym's servers: through the namespace's unix socket when Gym has one."""
        import http.client
        import urllib.parse

        u = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        if self.sock:
            conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.sock.settimeout(30)
            conn.sock.connect(self.sock)
        try:
            conn.request("GET", u.path or "/")
            return conn.getresponse().read()
        finally:
            conn.close()

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Gym's own shutdown (its servers, its Ray cluster)
            try:
                proc.wait(15)  # then the kill: its pid namespace (and the parent-death signals) take the rest
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

"""NeMo Gym's servers for one environment, under Gym's own interpreter (gym_bridge.py is the
env rank's side: the proxy and the episodes).

`gym env start` runs Gym's head server, the resources server, its agent and Gym's vllm_model
model server, each from the interpreter's own environment (no per-server uv venvs), the
model server pointed at the rank's proxy by a 0600 config file in a 0700 directory (the
proxy's key never on a command line). The interpreter runs in its jail (`jailed`,
hpc_rl/envs/jail.py): its own pid, mount and user namespaces, that directory its only
writable place, no secret in any process it can see. With private_network (the default) it
has its own network too: Gym's servers and Ray have no port on the node, and relays inside
the namespace (unix_bridge.py) connect two unix sockets of that directory (proxy.sock
outward, gym.sock inward). The processes die with the env rank: a parent-death signal on
the jail, the rank's process group, and the jail's pid namespace (--die-with-parent).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

from hpc_rl.envs.jail import Jail, JailDir, interpreter_paths

REPO = Path(__file__).resolve().parents[2]
DIR_PREFIX = "hpc_rl_gym_"  # a rank's 0700 jail directory under /tmp (jail.JailDir)
log = logging.getLogger("hpc_rl.agentic.gym")
READY_LINE = "servers ready!"  # `gym env start` prints "All N / N servers ready! ..." once every server answers
RO_BIND = "GYM_PY_RO_BIND"  # the directories a sandboxing Gym interpreter binds read-only (tests/gym_python.sh)
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
    # rank's proxy, the rank's calls enter it through another (unix_bridge, prepended)
    port = serve_relays(outward=str(Path(spec["bridge"]) / "proxy.sock"), inward=str(Path(spec["bridge"]) / "gym.sock"))
    argv.append("++policy_base_url=http://127.0.0.1:%d/v1" % port)
from nemo_gym.cli.main import main
sys.argv = ["gym", *argv]
main()
""".replace("%(kinds)r", repr(SERVER_KINDS))
LAUNCH = Path(__file__).with_name("unix_bridge.py").read_text() + LAUNCH


def interpreter(python: str) -> List[str]:
    """The configured interpreter as argv (a command may carry arguments; relative to the repo)."""
    parts = python.split()
    p = Path(parts[0])
    return [str(p if p.is_absolute() else REPO / p), *parts[1:]]


def search_dirs(dirs) -> List[str]:
    return [str(Path(d) if Path(d).is_absolute() else REPO / d) for d in dirs]


def jailed(python: str, dirs: List[str], home: str, private_network: bool = True) -> List[str]:
    """The command line that runs the Gym interpreter in its jail (hpc_rl/envs/jail.py): a pid,
    mount and user namespace of its own, the interpreter and the search directories read-only,
    `home` (the rank's 0700 directory) its only writable place, an environment from the allow
    list (no HPC_RL_JOB_KEY, no credentials), and with private_network its own network."""
    argv = interpreter(python)
    # GYM_PY_RO_BIND: an interpreter that is itself a sandbox (tests/gym_python.sh's) binds the
    # directories the config names, read-only at their own paths: a server in any directory
    # runs with no bind or mkdir of the user's (an interpreter that is not one ignores it)
    jail = Jail(home, [*interpreter_paths(argv[0]), *dirs], network=not private_network, nested=True,
                env={"RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": f"{home}/ray", RO_BIND: ":".join(dirs)},
                path=f"{Path(argv[0]).parent}:/usr/local/bin:/usr/bin:/bin")
    return jail.argv(argv)


class GymServers:
    """`gym env start` for one environment, under the Gym interpreter, pointed at the proxy."""

    def __init__(self, python: str, resources_server: str, agent: Optional[str], dirs: List[str], args: List[str],
                 proxy, start_timeout_s: float = 600.0, private_network: bool = True):
        # A killed rank (no atexit) left its directory: JailDir has the next rank on the node remove it
        self.jail_dir = JailDir(DIR_PREFIX)
        self.dir = self.jail_dir.path
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
        self.tail: List[str] = []
        ready, started = threading.Event(), threading.Event()
        self._box: Dict[str, Any] = {}
        threading.Thread(target=self._run, args=([*jailed(python, dirs, self.dir, private_network), "-c", LAUNCH, spec], ready, started), daemon=True,
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
        the rank's process group (the rank's supervisor kills them with its leftovers) and in the
        jail's pid namespace, which dies with it (bwrap --die-with-parent)."""
        def dies_with_parent():
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd=self.dir, text=True,
                                         bufsize=1, preexec_fn=dies_with_parent)
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
        self.jail_dir.close()

"""The jail an environment library runs in (NeMo Gym's servers, the verifiers worker), and the
system view it shares with the code sandbox (sandbox.py).

An environment is code the run did not write: it may try to read the job's secret
(HPC_RL_JOB_KEY lives in the environment of every rank, its supervisor and the batch shell,
and /proc/PID/environ of a same-uid process is readable), the user's home, the run directory
and the training data, or to reach the job's store. In the jail (bubblewrap):

- pid namespace and a fresh /proc: it sees only its own processes, none of which holds the
  secret (its environment is built from an allow list, `clean_env`);
- mount namespace: the system directories read-only (`system_view`: /usr and the merged-usr
  links, the /etc files a Python or a shell needs, not /etc as a whole), the paths its
  library needs read-only (its interpreter's prefix, the directories its .pth files name,
  the package directories the config names, the tokenizer), and one writable 0700 directory
  of its own (`JailDir`); /tmp and /run are empty tmpfs; no home, no run directory, no
  checkpoints, no data;
- user namespace with no capabilities (a root caller's jail runs as nobody inside), so a
  read-only bind cannot be remounted writable;
- network namespace unless `network`: only its own loopback; it reaches the rank through
  unix sockets in its directory (the library's proxy), never the store or the generators.

`nested` keeps user namespaces available inside (tests/gym_python.sh's interpreter is itself
a bubblewrap); else they are disabled. `HPC_RL_JAILED=1` is set inside, so such a wrapper binds
the jail's /proc instead of mounting one (a nested user namespace may not mount proc over a
/proc bubblewrap has partly covered).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

NOBODY = 65534
JAILED = "HPC_RL_JAILED"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# /etc entries a Python, a shell and TLS need. Not /etc as a whole: it holds host keys,
# /etc/shadow and the munge key, readable to a same-uid (or root-mapped) process.
ETC_ENTRIES = ("passwd", "group", "nsswitch.conf", "hosts", "host.conf", "resolv.conf", "gai.conf", "protocols",
               "services", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "mime.types",
               "os-release", "debian_version", "alternatives", "ssl/certs", "ssl/openssl.cnf", "ca-certificates",
               "ca-certificates.conf", "pki/tls/certs", "python3", "python3.11", "python3.12", "python3.13",
               "bash.bashrc", "profile", "shells", "magic", "mailcap")
# the caller's variables a library may have (locale and terminal); everything else is dropped,
# credentials (W&B, MLflow, HF tokens, the job's secret) with it
ENV_ALLOW = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def unavailable(bwrap: str = "bwrap") -> Optional[str]:
    """Why no jail can be made on this node (None: bubblewrap is there)."""
    if shutil.which(bwrap) is None:
        return ("environment libraries run in a bubblewrap jail (hpc_rl/envs/jail.py) and this node has no "
                f"{bwrap!r}: install bubblewrap 0.8 or newer (apt-get install bubblewrap; `make setup` does)")
    return None


def system_view() -> List[str]:
    """bubblewrap arguments: the system directories read-only (merged-usr links as links) and
    the /etc entries above that exist."""
    args: List[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for name in ETC_ENTRIES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


def clean_env(extra: Optional[Dict[str, str]] = None, home: str = "/tmp", path: str = SYSTEM_PATH) -> Dict[str, str]:
    """An environment from the allow list: locale and terminal from the caller, the rest set."""
    env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
    env.update(PATH=path, HOME=home, TMPDIR="/tmp", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra or {})
    return env


def interpreter_paths(python: str) -> List[str]:
    """What an interpreter needs to run: its prefix (the directory above its bin/), the prefix
    of what it links to (a venv's base Python), and the directories its site-packages' .pth
    files name (an environment package installed with a path entry) and the package directories
    of its editable installs (`editable_dirs`). Read as text: a .pth
    line that is code (`import ...`) is not run here."""
    out: List[str] = []
    for p in (Path(python), Path(python).resolve()):
        prefix = p.parent.parent
        if str(prefix) not in out:
            out.append(str(prefix))
    for prefix in list(out):
        for pth in Path(prefix).glob("lib/python3*/site-packages/*.pth"):
            try:
                lines = pth.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")) and Path(line).is_dir():
                    out.append(line)
    # the interpreter's own site-packages only (a venv's base Python's are not on its path)
    for finder in Path(out[0]).glob("lib/python3*/site-packages/__editable__*finder.py"):
        out += [d for d in editable_dirs(finder) if d not in out]
    return out


_MAPPING = re.compile(r"^MAPPING(?:\s*:[^=]*)?=\s*(\{.*\})\s*$", re.M)


def editable_dirs(finder: Path) -> List[str]:
    """The package directories an editable install's finder maps (setuptools writes
    `MAPPING = {'pkg': '/path/to/pkg'}` into `__editable___<name>_finder.py`; `pip install -e`
    of a package in any directory): read as a literal, never imported."""
    try:
        m = _MAPPING.search(finder.read_text(errors="replace"))
        mapping = ast.literal_eval(m.group(1)) if m else {}
    except (OSError, ValueError, SyntaxError):
        return []
    return [d for d in mapping.values() if isinstance(d, str) and Path(d).is_dir()] if isinstance(mapping, dict) else []


def covered(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@dataclass
class Jail:
    """bubblewrap arguments for one environment library's process tree."""

    home: str  # the writable 0700 directory (JailDir), bound at its own path; HOME and cwd
    read_only: Sequence[str] = ()  # host paths bound read-only at their own paths
    network: bool = False  # False: a network namespace of its own (loopback only)
    nested: bool = False  # the command runs bubblewrap itself: user namespaces stay available
    env: Dict[str, str] = field(default_factory=dict)  # on top of clean_env
    path: str = SYSTEM_PATH
    bwrap: str = "bwrap"

    def argv(self, cmd: Sequence[str]) -> List[str]:
        system = [d for d in SYSTEM_DIRS if os.path.isdir(d)]
        ro = []
        for p in dict.fromkeys(os.path.abspath(x) for x in self.read_only):
            if os.path.exists(p) and not covered(p, system):
                ro += ["--ro-bind", p, p]
        ids = ["--uid", str(NOBODY), "--gid", str(NOBODY)] if os.geteuid() == 0 else []
        env = clean_env(dict(self.env, **{JAILED: "1"}), home=self.home, path=self.path)
        return [self.bwrap, "--unshare-user", *ids, "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", *([] if self.network else ["--unshare-net"]),
                *([] if self.nested else ["--disable-userns"]), "--die-with-parent", "--cap-drop", "ALL",
                *system_view(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run",
                # the root's own tmpfs (the mount points above) read-only: /tmp, /run and home stay writable
                *ro, "--bind", self.home, self.home, "--remount-ro", "/", "--chdir", self.home, "--clearenv",
                *[a for k, v in env.items() for a in ("--setenv", k, v)], "--", *cmd]


class JailDir:
    """A jail's writable directory: 0700 under /tmp, owned by a rank (pid and start time in
    `owner`), removed by `close` or, after a SIGKILLed rank, by the next rank's `reap`."""

    ROOT = "/tmp"

    def __init__(self, prefix: str):
        self.prefix = prefix
        reap(prefix, self.ROOT)
        # 0700 and the rank's: the jail's processes keep the rank's uid on the host (nobody is
        # only their name inside the user namespace), so they write here and nowhere else
        self.path = tempfile.mkdtemp(prefix=prefix, dir=self.ROOT)
        (Path(self.path) / "owner").write_text(f"{os.getpid()} {start_time(os.getpid())}\n")

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def start_time(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid,
    it names the process even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap(prefix: str, root: str = JailDir.ROOT) -> List[str]:
    """Remove this user's jail directories of `prefix` whose owning rank is gone (SIGKILLed, so
    its cleanup never ran); a directory whose owner is alive, or not yet written, stays."""
    gone = []
    for d in Path(root).glob(prefix + "*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            pid, start = (d / "owner").read_text().split()
            if start_time(int(pid)) == start:
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(str(d))
    return gone

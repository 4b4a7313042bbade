"""The command lines an Apptainer or enroot sandbox would use for one tool call on a cluster
whose env nodes run containers rather than bubblewrap (`env.agentic.sandbox.kind`).

Rendered only: this version runs bubblewrap (sandbox.py) and validation refuses the other
kinds (config/validate_agentic.py), because neither runtime exists on the machines this
version is tested on. The lines are here so that what each kind would have to give (the
same as bwrap: no network, read-only root, a private /tmp, no inherited environment, the
marker that `reap_leftovers` looks for) is written down in one place, and docs/agentic.md
shows them. The rlimits, the process group, the parent-death signal and the output caps
are the caller's (Sandbox.run) and would be the same.
"""

from __future__ import annotations

from typing import List, Sequence

from .sandbox import MARK, Limits


def apptainer_argv(image: str, cmd: Sequence[str], marker: str, limits: Limits) -> List[str]:
    """`apptainer exec` of `cmd` in `image` (a SIF, read-only): --containall gives new pid and
    ipc namespaces, a private /tmp and no home; --cleanenv drops the caller's environment (the
    job's secret); --net --network none a network namespace with loopback only (allowed
    unprivileged); the tmpfs /tmp is capped by Apptainer's sessiondir size."""
    return ["apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--net", "--network", "none",
            "--no-mount", "cwd", "--pwd", "/tmp", "--env", f"{MARK}={marker}", "--env", "HOME=/tmp",
            "--env", "OMP_NUM_THREADS=1", image, "prlimit", f"--nproc={limits.nproc}", "--", *cmd]


def enroot_argv(container: str, cmd: Sequence[str], marker: str, limits: Limits) -> List[str]:
    """`enroot start` of `cmd` in `container` (made once per node by `enroot create`): enroot
    shares the host's network, so the call is wrapped in `unshare --net` inside a user
    namespace of its own (loopback only); --rw is left out (the root stays read-only) and a
    tmpfs is mounted on /tmp."""
    return ["unshare", "--user", "--map-current-user", "--net", "--", "enroot", "start", "--env", f"{MARK}={marker}",
            "--mount", "tmpfs:/tmp:tmpfs:size=%d" % limits.scratch_bytes, container,
            "prlimit", f"--nproc={limits.nproc}", "--", *cmd]


def render(kind: str, image: str, cmd: Sequence[str], marker: str = "TAG:PID.N", limits: Limits = Limits()) -> List[str]:
    """The command line of `kind` (apptainer or enroot) for one call; bwrap's is Sandbox.argv."""
    if kind == "apptainer":
        return apptainer_argv(image, cmd, marker, limits)
    if kind == "enroot":
        return enroot_argv(image, cmd, marker, limits)
    raise ValueError(f"no rendered command line for sandbox kind {kind!r} (bwrap's is Sandbox.argv)")

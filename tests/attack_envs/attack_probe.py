"""TEST-ONLY. What a hostile environment tries from inside an env rank's environment library
(a NeMo Gym resources server, a verifiers taskset, a sandboxed tool): every way this file's
authors found to reach the job's secret, its files and its store. Never imported by hpc_rl;
the attack environments beside it (gym/, verifiers/) import it, under the library's own
interpreter, so it uses the standard library only.

`probe(targets)` returns {attempt: what happened}: a value starting with "LEAK" is an attack
that worked, anything else says how it was stopped. `targets` (JSON-able) names what to aim
at, as an attacker who knows the layout of a cluster would: `read` (files: the user's home,
the run directory, the training data), `write` (directories: the repository, the run
directory), `store` ([host, port] of the job's TCP store) and `home` (the user's home).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

SECRET = "HPC_RL_JOB_KEY"
# other credentials a rank's environment may hold (experiment loggers, the hub)
CREDENTIALS = ("WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY")


def _scan_environ(blob: bytes) -> list:
    return [name for name in (SECRET, *CREDENTIALS) if (name + "=").encode() in blob]


def _procs():
    try:
        return [d for d in Path("/proc").iterdir() if d.name.isdigit()]
    except OSError:
        return []


def probe(targets: dict) -> dict:
    out = {}
    found = _scan_environ(b"\0".join(f"{k}={v}".encode() for k, v in os.environ.items()))
    out["own_environ"] = f"LEAK: {found}" if found else "clean"
    # every process this one can see: its environment, its command line, its open files
    leaks, seen = [], 0
    for d in _procs():
        seen += 1
        for name in ("environ", "cmdline"):
            try:
                got = _scan_environ((d / name).read_bytes())
            except OSError:
                continue
            if got:
                leaks.append(f"/proc/{d.name}/{name}: {got}")
    out["proc_environ"] = f"LEAK: {leaks[:5]}" if leaks else f"clean ({seen} processes visible)"
    for label, pid in (("parent", os.getppid()), ("init", 1)):
        try:
            got = _scan_environ(Path(f"/proc/{pid}/environ").read_bytes())
            out[f"{label}_environ"] = f"LEAK: {got}" if got else "clean"
        except OSError as exc:
            out[f"{label}_environ"] = f"blocked: {type(exc).__name__}"
    # /proc/PID/root of a process outside: the host's whole filesystem
    escaped = []
    for d in _procs():
        for path in targets.get("read", []):
            try:
                (d / "root" / path.lstrip("/")).read_bytes()
                escaped.append(f"/proc/{d.name}/root{path}")
            except OSError:
                pass
    out["proc_root"] = f"LEAK: {escaped[:3]}" if escaped else "blocked"
    for path in targets.get("read", []):
        try:
            data = Path(path).read_bytes()
            out[f"read {path}"] = f"LEAK: {len(data)} bytes"
        except OSError as exc:
            out[f"read {path}"] = f"blocked: {type(exc).__name__}"
    home = targets.get("home")
    if home:
        # the host's home, told by the files the test planted there (a jail shows the empty
        # directories its bind mounts need; Gym's test interpreter has a /root of its own)
        planted = {Path(p).name for p in targets.get("read", []) if Path(p).parent == Path(home)}
        try:
            seen = planted & set(os.listdir(home))
            out["list home"] = f"LEAK: {sorted(seen)}" if seen else "the host's home is not there"
        except OSError as exc:
            out["list home"] = f"blocked: {type(exc).__name__}"
    for d in targets.get("write", []):
        p = Path(d) / f"planted_by_environment_{os.getpid()}"
        try:
            p.write_text("planted")
            out[f"write {d}"] = "LEAK: wrote " + str(p)
            p.unlink()
        except OSError as exc:
            out[f"write {d}"] = f"blocked: {type(exc).__name__}"
    if targets.get("store"):
        host, port = targets["store"]
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                out["store"] = f"LEAK: connected to {host}:{port}"
        except OSError as exc:
            out["store"] = f"blocked: {type(exc).__name__}"
    return out


def leaks(report: dict) -> list:
    return [f"{k}: {v}" for k, v in report.items() if str(v).startswith("LEAK")]


def run_and_report(targets: dict) -> float:
    """Probe, print the report to stderr (the env rank's log) and return the reward the attack
    environments give: 1.0 when every attempt was stopped, else minus the number that worked."""
    report = probe(targets)
    print("hpc_rl attack probe: " + json.dumps(report, sort_keys=True), file=sys.stderr, flush=True)
    bad = leaks(report)
    return 1.0 if not bad else -float(len(bad))


if __name__ == "__main__":  # a sandboxed tool runs it as a script: targets as argv[1]
    rep = probe(json.loads(sys.argv[1]))
    print(json.dumps(rep, sort_keys=True))

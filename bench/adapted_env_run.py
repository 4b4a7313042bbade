"""Shared by bench/gym.py and bench/verifiers.py (issue 27): an adapted library's environment
run unchanged through GRPO for N steps, locally and, with --slurm, as a het job on the local
Slurm cluster, and the per-step figures of each run (wall time, episodes, errors, failures,
changed policy tokens, the engine-vs-trainer log-prob agreement, mean rewards) in one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(recipe: str, name: str, steps: int, extra: list, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "hpc_rl.launch", f"+recipe={recipe}", f"run.max_steps={steps}",
           f"run.dir={run_dir}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    wall = time.perf_counter() - t0
    out = {"launch": name, "command": " ".join(cmd[1:]), "rc": proc.returncode, "wall_s": round(wall, 1),
           "run_dir": str(run_dir)}
    if proc.returncode != 0 or not (run_dir / "metrics.jsonl").exists():
        out["tail"] = (proc.stdout + proc.stderr)[-3000:]
        return out
    return dict(out, **figures(run_dir))


def figures(run_dir: Path) -> dict:
    """Per-step figures of a finished run directory."""
    metrics = run_dir / "metrics.jsonl"
    out: dict = {}
    steps_out = []
    for line in metrics.read_text().splitlines():
        s = json.loads(line)
        if s.get("kind") != "step":
            continue
        a = s["agentic"]
        steps_out.append({"step": s["step"], "episodes": a["episodes"], "errors": a["errors"], "failed": a["failed"],
                          "changed_policy_tokens": a["changed_policy_tokens"], "turns": a["turns"],
                          "reward_mean": s.get("reward_mean"), "accuracy": s.get("accuracy"),
                          "token_mult_prob_error": s.get("token_mult_prob_error"),
                          "max_inflight_episodes": a["max_inflight_episodes"],
                          "env_s_per_policy_turn_mean": a.get("tool_latency_s_mean")})
    out["steps"] = steps_out
    out["errors_total"] = sum(s["errors"] for s in steps_out)
    out["changed_policy_tokens_total"] = sum(s["changed_policy_tokens"] for s in steps_out)
    return out


def main(recipe: str, out: Path, tag: str) -> None:
    """The bench's command line: `tag` names its run directories under runs/."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--local", action="store_true")
    ap.add_argument("--slurm", action="store_true")
    ap.add_argument("--out", type=Path, default=out)
    args = ap.parse_args()
    if not (args.local or args.slurm):
        args.local = args.slurm = True
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update(host=platform.node(), cpus=os.cpu_count(), recipe=recipe,
                  note="one 2-core machine shared with other work: wall times move with its load")
    runs = ROOT / "runs"
    if args.local:
        result["local"] = launch(recipe, "local", args.steps, [], runs / f"bench_{tag}_local-{stamp}")
        print(json.dumps({k: v for k, v in result["local"].items() if k != "steps"}), flush=True)
    if args.slurm:
        result["slurm"] = launch(recipe, "slurm", args.steps, ["cluster=local_slurm", "launcher=slurm", "launcher.wait=true"],
                                 runs / f"bench_{tag}_slurm-{stamp}")
        print(json.dumps({k: v for k, v in result["slurm"].items() if k != "steps"}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


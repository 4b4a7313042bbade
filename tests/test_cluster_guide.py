"""docs/cluster-guide.md ("Take it to your cluster") stays true: its command blocks marked
`<!-- guide-test -->` run, in order, in one bash session on the local Slurm cluster; every
other command block says why it cannot run here (`<!-- guide-skip: <reason> -->`)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "cluster-guide.md"
# A marker comment on the line right before a ```bash fence; the rest of the comment is the
# block's tag (guide-test) or its reason (guide-skip).
BLOCK = re.compile(r"<!-- guide-(test|skip)(?::\s*(.*?))?\s*-->\n```bash\n(.*?)\n```", re.S)
FENCE = re.compile(r"^```bash$", re.M)
NEEDS_ACCOUNTING = "needs-accounting"


def blocks() -> List[Tuple[str, str, str]]:
    """(kind, tag or reason, commands) of every marked bash block, in page order."""
    return [(kind, note or "", body) for kind, note, body in BLOCK.findall(GUIDE.read_text())]


def test_every_command_block_is_run_or_says_why_not():
    text = GUIDE.read_text()
    found = blocks()
    assert len(found) == len(FENCE.findall(text)), "a ```bash block of the guide has neither guide-test nor guide-skip"
    assert all(note for kind, note, _ in found if kind == "skip"), "a guide-skip block must say why"
    run = [body for kind, _, body in found if kind == "test"]
    # the steps the guide promises to rehearse: profile, checkpoints, dry run, submit, watch
    for needle in ("cluster/mysite.yaml", "--batch-plan", "launcher=dry_run", "launcher=slurm", "hpc_rl.slurm.watch"):
        assert any(needle in body for body in run), f"no tested block runs {needle}"


def _accounting() -> bool:
    try:
        return subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slurm
@pytest.mark.slow
def test_the_guide_runs_on_the_local_cluster(local_slurm, tmp_path):
    skip_accounting = not _accounting()
    script = ["set -euo pipefail", "set -x"]
    for kind, tag, body in blocks():
        if kind == "test" and not (tag == NEEDS_ACCOUNTING and skip_accounting):
            script.append(body)
    site = tmp_path / "site"
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=REPO, capture_output=True, text=True, timeout=540,
                          env=local_slurm.env(SITE=str(site), HPC_RL=str(REPO)))
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the guide's commands failed (rc={proc.returncode}, {took:.0f}s):\n{out[-6000:]}"
    # the profile was read, the checkpoints checked, the wiring check ran and finished
    assert "comm_check on mysite" in out and "tiny_mopd on mysite" in out
    assert "planned into" in out
    assert (site / "runs" / "comm_check" / "job.json").exists()
    assert "COMPLETED" in out, out[-4000:]
    if not skip_accounting:
        assert re.search(r"^\d+\+0\s+hpc_rl-comm_check\S*\s+COMPLETED\s+0:0", proc.stdout, re.M), proc.stdout[-3000:]
    print(f"the guide's tested commands took {took:.1f}s")

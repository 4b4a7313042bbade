"""Refit into a live vLLM CPU engine: after the trainer steps, the engine's sampling
logprobs are stale; after the refit they equal the trainer's recomputation (fp32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_refit_makes_vllm_agree_with_the_trainer(tmp_path):
    out = tmp_path / "agree.json"
    # a separate process: vLLM spawns its engine workers and wants a __main__ guard
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "logprob_agreement.py"), "--precisions", "fp32",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["before_refit"]["token_mult_prob_error"] > 1.05, "the trainer's step should make vLLM's weights stale"
    assert r["after_refit"]["token_mult_prob_error"] <= 1.001
    assert r["after_refit"]["tokens"] >= 100
    assert proc.returncode == 0

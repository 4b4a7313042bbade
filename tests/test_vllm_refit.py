"""Refit into a live vLLM CPU engine: after the trainer steps, the engine's sampling
logprobs are stale; after the refit they equal the trainer's recomputation (fp32), for an
engine of tensor parallel 1 and one of tensor parallel 2 (two vLLM workers, each loading
only its slices)."""

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
                           "--tp", "1,2", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    by_tp = {r["vllm_tensor_parallel"]: r for r in doc["results"]}
    assert sorted(by_tp) == [1, 2]
    for tp, r in by_tp.items():
        assert r["before_refit"]["token_mult_prob_error"] > 1.05, f"TP{tp}: the trainer's step should make vLLM's weights stale"
        assert r["after_refit"]["token_mult_prob_error"] <= 1.001, f"TP{tp}: {r['after_refit']}"
        assert r["after_refit"]["tokens"] >= 100
    # TP 2: the two workers received the split tensors once between them, the replicated
    # ones (norms) once each; never the whole model twice
    whole, replicated = by_tp[1]["engine_bytes_received"], doc["replicated_bytes"]
    assert whole == doc["model_bytes"]
    assert by_tp[2]["engine_bytes_received"] == whole + replicated
    assert proc.returncode == 0

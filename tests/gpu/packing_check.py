"""GPU check of sequence packing (issue 44), run by tests/gpu/packing_check.sh when a device is
lent: packed rows against padded rows on CUDA for a dense Llama (attention: variable-length
flash attention when flash-attn is installed, else SDPA with the packed block-diagonal mask)
and a hybrid Nemotron-H (Mamba: mamba-ssm's `seq_idx` when mamba-ssm and causal-conv1d are
installed, else the per-sample torch path), the train step's loss and gradients included.
The CPU twin is tests/test_packing.py (the same backend code; SDPA mask, per-sample Mamba).

    python tests/gpu/packing_check.py --out bench/results/packing_cuda.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU twin's batch and loss

from test_packing import SPECS, _grad_gap, _step_grads, rl_batch  # noqa: E402

from hpc_rl.models import mamba_segments  # noqa: E402
from hpc_rl.models.assets import save_untrained  # noqa: E402
from hpc_rl.models.fsdp2 import FSDP2Backend  # noqa: E402


# fp32 on GPU: TF32 is off by default for matmuls in torch, so the CPU twin's bounds hold. bf16 (the
# flash-attn runs): each value is ~10 roundings of 2^-8 (3.9e-3) through 2-4 layers, so log-probs
# within 6e-2; the loss averages ~1000 tokens' errors of either sign (1e-2); gradients 5e-2 relative.
BOUNDS = {"fp32": {"lp": 2e-5, "loss": 2e-5, "grad_rel": 1e-4}, "bf16": {"lp": 6e-2, "loss": 1e-2, "grad_rel": 5e-2}}


def within(r: dict) -> bool:
    b = BOUNDS[precision_of(r["attn_implementation"])]
    return r["lp_gap"] <= b["lp"] and r["loss_gap"] <= b["loss"] and r["grad_gap"] <= b["grad_rel"]


def precision_of(attn_impl: str) -> str:
    return "bf16" if attn_impl == "flash_attention_2" else "fp32"


def compare(ckpt: str, attn_impl: str, seq_idx: bool) -> dict:
    ids, attn = rl_batch(rows=9, width=200, seed=1)

    def build(**kw):
        # the product's key (trainer.attn_implementation); flash-attn computes in 16-bit only
        # (validate_packing.py refuses fp32 with it), so that kernel's runs compare bf16 to bf16
        b = FSDP2Backend(ckpt, precision=precision_of(attn_impl), train=True, device="cuda",
                         attn_implementation=attn_impl, **kw)
        if kw.get("packing"):  # the mixers' path chosen explicitly (install is idempotent per model)
            for m in b.model.modules():
                if mamba_segments.is_mamba_mixer(m) and hasattr(m.forward, "__wrapped__"):
                    m.forward = m.forward.__wrapped__
            mamba_segments.install(b.model, use_seq_idx=seq_idx)
        return b

    padded, packed = build(), build(packing=True, micro_batch_tokens=400, logprob_batch_tokens=400)
    mask = attn.bool()
    lp_gap = float((padded.logprobs(ids, attn).cpu() - packed.logprobs(ids, attn).cpu())[mask].abs().max())
    (o1, g1), (o2, g2) = _step_grads(padded, ids, attn, 3), _step_grads(packed, ids, attn)
    return {"attn_implementation": attn_impl, "mamba_seq_idx": seq_idx, "lp_gap": lp_gap,
            "loss_gap": abs(o1["loss"] - o2["loss"]), "grad_gap": _grad_gap(g1, g2),
            "packed_micro_batches": o2["micro_batches"], "padding_share_padded": o1["padding_share"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/packing_cuda.json")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    flash = importlib.util.find_spec("flash_attn") is not None
    kernels = mamba_segments.kernels_take_seq_idx()
    runs = []
    for family in ("llama", "nemotron_h"):
        ckpt = str(save_untrained(root / family, SPECS[family], seed=0))
        impls = ["sdpa"] + (["flash_attention_2"] if flash else [])
        for impl in impls:
            modes = [False] + ([True] if family == "nemotron_h" and kernels else [])
            for seq_idx in modes:
                r = {"family": family, **compare(ckpt, impl, seq_idx)}
                print(r, flush=True)
                runs.append(r)
    out = {"bench": "packing_cuda", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "flash_attn_installed": flash, "mamba_kernels_installed": kernels, "runs": runs,
           "bounds": BOUNDS, "passed": all(within(r) for r in runs)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("passed" if out["passed"] else "FAILED", a.out)


if __name__ == "__main__":
    main()

"""Tiny Llama (Qwen3-MoE, dense Nemotron-H) models built and briefly trained on this CPU, cached on disk.

A student that has seen a little of every task, and one teacher per task that has seen
a lot of its own: the smallest setting in which multi-teacher distillation has something
to do (each teacher is better than the student on its task, and only on its task).
Everything is deterministic for a spec, so the cache key is the spec's hash; a build
goes to a temporary directory renamed into place when complete.

    python -m hpc_rl.models.assets            # build (or find) the assets, print where
    python -m hpc_rl.models.assets moe        # the mixture-of-experts set (MOE_ASSETS)
    python -m hpc_rl.models.assets nemotron   # the dense hybrid Nemotron-H set (NEMOTRON_H_ASSETS)
    python -m hpc_rl.models.assets nemotron_moe  # the MoE hybrid Nemotron-H set (NEMOTRON_H_MOE_ASSETS)
    python -m hpc_rl.models.assets agentic    # the tool-using calculator teacher (AGENTIC_ASSETS)

This module is the sets and their builds, above what it builds with: the specs, builders and
training (models/asset_models.py), the MTP layer (models/families/nemotron_h/mtp.py) and the agentic teacher
(agentic/teacher.py), none of which imports it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from .asset_cache import Assets, cached_build, default_root  # noqa: F401 (re-exported)
from .asset_models import (AGENTIC_ASSETS, ASSET_VERSION, MOE_ASSETS, NEMOTRON_H_ASSETS,  # noqa: F401 (re-exported)
                           NEMOTRON_H_MOE_TRAINED, AgenticAssetSpec, AssetSpec, ModelSpec, MoeModelSpec,
                           NemotronHModelSpec, NemotronHMoeModelSpec, TrainSpec, _batch, build_base, chat_prompt,
                           encode_sft, greedy_accuracy, new_model, save_untrained, sft, train_steps)
from .families.nemotron_h.mtp import WithMtpSpec, build_with_mtp

# The MoE hybrid Nemotron-H set as referenced (tiny_nemotron_moe:<name>): each checkpoint of
# NEMOTRON_H_MOE_TRAINED (asset_models.py) with one MTP layer
NEMOTRON_H_MOE_ASSETS = WithMtpSpec(NEMOTRON_H_MOE_TRAINED)
# model references `tiny:<name>`, `tiny_moe:<name>`, `tiny_nemotron:<name>`, `tiny_nemotron_moe:<name>`,
# `tiny_agentic:teacher_calc`
ASSET_SETS = {"tiny": AssetSpec(), "tiny_moe": MOE_ASSETS, "tiny_nemotron": NEMOTRON_H_ASSETS,
              "tiny_nemotron_moe": NEMOTRON_H_MOE_ASSETS, "tiny_agentic": AGENTIC_ASSETS}


def build_assets(spec=AssetSpec(), root: Optional[Path] = None, log: Callable[[str], None] = print) -> Assets:
    """Find the cached assets for `spec`, or build them (about a minute on 2 cores)."""
    if isinstance(spec, AgenticAssetSpec):
        from hpc_rl.agentic.teacher import build_agentic_assets

        return build_agentic_assets(spec, root, log)
    if isinstance(spec, WithMtpSpec):
        return build_with_mtp(spec, root, log)
    return build_base(spec, root, log)


def resolve_model_ref(ref: str) -> str:
    """`tiny:<name>` (or `tiny_moe:<name>`, ...) -> the built asset's directory; anything else is
    returned as given."""
    kind, sep, name = ref.partition(":")
    if not sep or kind not in ASSET_SETS:
        return ref
    assets = build_assets(ASSET_SETS[kind], log=lambda line: print(line, flush=True))
    if name not in assets.paths:
        raise KeyError(f"{ref!r}: no tiny model named {name!r}; built: {sorted(f'{kind}:{n}' for n in assets.paths)}")
    return str(assets[name])


if __name__ == "__main__":
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    which = {"moe": "tiny_moe", "nemotron": "tiny_nemotron", "nemotron_moe": "tiny_nemotron_moe",
             "agentic": "tiny_agentic"}.get(
        sys.argv[1] if sys.argv[1:] else "", "tiny")
    assets = build_assets(ASSET_SETS[which])
    print(json.dumps({"root": str(assets.root), **assets.manifest["models"]}, indent=2))
    if which == "tiny_agentic":  # the repository's record of the build, with the student's baseline
        from hpc_rl.agentic.teacher import student_baseline

        out = Path(__file__).resolve().parents[2] / "bench" / "results" / "tiny_agentic_assets_manifest.json"
        doc = {"asset_dir": assets.root.name, **assets.manifest,
               "student_baseline": student_baseline(resolve_model_ref("tiny:student"))}
        out.write_text(json.dumps(doc, indent=2) + "\n")
    sys.exit(0)

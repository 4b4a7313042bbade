"""One multi-token-prediction (MTP) layer added to a saved Nemotron-H checkpoint.

Nemotron 3 checkpoints carry MTP layers that transformers' `NemotronHForCausalLM` drops on load
(`_keys_to_ignore_on_load_unexpected = ["mtp.*"]`) and that vLLM's main Nemotron-H model drops
too (its weights mapper sends the `mtp` prefix to None); only vLLM's speculative draft model
(`nemotron_h_mtp.py`, `--speculative-config '{"method": "nemotron_h_mtp"}'`) reads them. The
trainer therefore never holds them and the HF export carries them over from the input
checkpoint (hpc_rl/ckpt/carry.py). This module writes such a layer, randomly initialised, into
a tiny checkpoint, so that the assets and tests have one to carry.

Names and config keys, as NVIDIA's checkpoints and vLLM 0.32's `NemotronHMultiTokenPredictor`
have them: `num_nextn_predict_layers: 1` and `mtp_hybrid_override_pattern` (e.g. "*E", one
letter per sublayer; transformers 5 writes the same as `mtp_layers_block_type`). One MTP layer is
`len(pattern)` sublayers `mtp.layers.<i>.`: each a Nemotron-H block (`norm.weight`, `mixer.*`
named as the main model's blocks of that kind, experts one tensor per expert); the first also
has `enorm.weight`, `hnorm.weight` [H] and `eh_proj.weight` [H, 2H] (the fusion of the token's
embedding with the previous hidden state), the last `final_layernorm.weight` [H].
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # torch is imported where it is used (the launcher imports this module)
    import torch


MTP_PREFIX = "mtp.layers."
# vLLM 0.32's NemotronHMultiTokenPredictor builds attention (*) and MoE (E) sublayers only
# ("Pattern char ... not implemented" for the others)
VLLM_MTP_LETTERS = "*E"
_LETTER_TO_TYPE = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# transformers 5 holds a MoE sublayer's experts fused [E, ...]; checkpoints one tensor per expert
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>up_proj|down_proj)$")


def default_pattern(config: dict) -> str:
    """Nemotron 3's MTP layer is attention then MoE ("*E"); a dense model has no MoE sizes to
    build its E from, so its MTP layer is one attention sublayer ("*")."""
    types = config.get("layers_block_type") or [_LETTER_TO_TYPE[c] for c in config.get("hybrid_override_pattern", "")]
    return "*E" if "moe" in types else "*"


def _block_shapes(checkpoint: Path, pattern: str) -> Dict[str, Tuple[Tuple[int, ...], bool]]:
    """name -> (shape, kept in fp32) of transformers' own Nemotron-H blocks of the pattern's
    kinds (on the meta device: shapes only), in checkpoint names."""
    import torch

    from transformers import AutoConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHPreTrainedModel

    cfg = copy.deepcopy(AutoConfig.from_pretrained(checkpoint))
    cfg.layers_block_type = [_LETTER_TO_TYPE[c] for c in pattern]
    fp32 = tuple(NemotronHPreTrainedModel._keep_in_fp32_modules_strict)  # the router's bias
    out: Dict[str, Tuple[Tuple[int, ...], bool]] = {}
    with torch.device("meta"):
        blocks = [NemotronHBlock(cfg, layer_idx=i) for i in range(len(pattern))]
    for i, block in enumerate(blocks):
        for name, t in block.state_dict().items():
            full = f"{MTP_PREFIX}{i}.{name}"
            m = _FUSED_EXPERTS.match(full)
            if m:  # [E, out, in] -> E tensors `experts.<e>.<kind>.weight` [out, in], as save_pretrained writes
                for e in range(t.shape[0]):
                    out[f"{m.group('prefix')}.{e}.{m.group('kind')}.weight"] = (tuple(t.shape[1:]), False)
            else:
                out[full] = (tuple(t.shape), any(k in name for k in fp32))
    hidden, last = cfg.hidden_size, len(pattern) - 1
    out.update({f"{MTP_PREFIX}0.enorm.weight": ((hidden,), False), f"{MTP_PREFIX}0.hnorm.weight": ((hidden,), False),
                f"{MTP_PREFIX}0.eh_proj.weight": ((hidden, 2 * hidden), False),
                f"{MTP_PREFIX}{last}.final_layernorm.weight": ((hidden,), False)})
    return out


def mtp_tensors(checkpoint: Path, pattern: str, seed: int, dtype: torch.dtype,
                init_std: float = 0.02) -> Dict[str, torch.Tensor]:
    """One MTP layer of `pattern` for the checkpoint's shapes, random from `seed`: matrices
    N(0, init_std), norm weights 1 + N(0, 0.1), biases N(0, init_std); every tensor differs, so
    a test that compares them bit for bit cannot pass on a swapped or re-initialised one."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, keep_fp32) in sorted(_block_shapes(checkpoint, pattern).items()):
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        t = 1.0 + 0.1 * t if name.endswith(("norm.weight", "layernorm.weight")) else init_std * t
        out[name] = t if keep_fp32 else t.to(dtype)
    return out


def add_mtp_layer(checkpoint, seed: int = 0, pattern: Optional[str] = None) -> List[str]:
    """Add one randomly initialised MTP layer to a saved Nemotron-H checkpoint directory (its
    safetensors and config.json, in place); returns the names added. `pattern`: the sublayers,
    from `VLLM_MTP_LETTERS` (default: `default_pattern`). The tensors take the checkpoint's
    dtype (the router's bias stays fp32, as transformers keeps it)."""
    import torch

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = Path(checkpoint)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "nemotron_h":
        raise ValueError(f"{path}: model_type {config.get('model_type')!r}; MTP layers here are Nemotron-H's")
    pattern = pattern or default_pattern(config)
    if not pattern or set(pattern) - set(VLLM_MTP_LETTERS):
        raise ValueError(f"MTP pattern {pattern!r}: vLLM's Nemotron-H MTP builds only {list(VLLM_MTP_LETTERS)} sublayers")
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    with safe_open(str(path / files[0]), "pt") as f:
        names = list(f.keys())
        dtype = f.get_slice(names[0]).get_dtype()
    if any(n.startswith("mtp.") for n in names) or config.get("num_nextn_predict_layers"):
        raise ValueError(f"{path} already has MTP layers")
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[dtype]
    tensors = mtp_tensors(path, pattern, seed, dtype)

    if index.exists():  # a sharded checkpoint: the layer in a file of its own, named in the index
        doc = json.loads(index.read_text())
        save_file(tensors, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        doc["weight_map"].update({n: "model-mtp.safetensors" for n in tensors})
        doc.setdefault("metadata", {})["total_size"] = (doc.get("metadata", {}).get("total_size", 0)
                                                        + sum(t.numel() * t.element_size() for t in tensors.values()))
        index.write_text(json.dumps(doc, indent=2) + "\n")
    else:  # one file, which loaders read without an index: the layer joins it
        state = load_file(str(path / "model.safetensors"))
        save_file({**state, **tensors}, str(path / "model.safetensors"), metadata={"format": "pt"})
    # NVIDIA's key (vLLM reads it through transformers' config) and transformers 5's spelling of it
    config.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern=pattern,
                  mtp_layers_block_type=[_LETTER_TO_TYPE[c] for c in pattern])
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(tensors)


@dataclass(frozen=True)
class WithMtpSpec:
    """A trained set with one MTP layer added to every checkpoint (models/families/nemotron_h/mtp.py), as Nemotron 3
    checkpoints carry them: a derived set cached on its own, so adding the layer (seconds)
    never retrains the base set (an hour on 2 cores for the MoE hybrid)."""

    base: Any  # an asset_models.AssetSpec
    seed: int = 0

    def key(self) -> str:
        return f"{self.base.key()}-mtp1s{self.seed}"


def build_with_mtp(spec: WithMtpSpec, root: Optional[Path], log: Callable[[str], None]):
    """The assets of `spec` (assets.Assets): the base set's checkpoints, each with one MTP layer."""
    import shutil

    from hpc_rl.models.asset_cache import cached_build
    from hpc_rl.models.asset_models import build_base

    base = build_base(spec.base, root, log)

    def build(tmp: Path) -> dict:
        manifest = dict(base.manifest, mtp={"base": base.root.name, "layers": 1, "added": {}})
        for i, name in enumerate(base.manifest["models"]):
            shutil.copytree(base[name], tmp / name)
            manifest["mtp"]["added"][name] = len(add_mtp_layer(tmp / name, seed=spec.seed + i))
            log(f"[assets] {name}: one MTP layer added ({manifest['mtp']['added'][name]} tensors)")
        return manifest

    return cached_build(spec, root, build)

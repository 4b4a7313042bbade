"""The generic path: a decoder-only `*ForCausalLM` that no family folder describes, which
transformers loads (AutoModelForCausalLM) and vLLM serves.

- fsdp2: data parallel only. Tensor and context parallel need a family's plan (which modules
  are column or row parallel, how its attention splits); expert parallel needs its experts'
  layout: refused, with that reason (rl/inputs.py, config/support.py).
- vLLM: the refit sends every tensor whole, in Hugging Face names, to every engine worker and
  vLLM's own weight loader (`model.load_weights`) renames, fuses and slices it for its tensor
  parallel rank (refit/vllm_layout.py: `whole` layout); nothing is checked name by name against
  the engine's parameters (their names are vLLM's own for the model), vLLM's loader refuses
  what it cannot place.
- the memory model reads it as a dense decoder (estimates from config.json's usual keys).
- tests: a tiny random Ernie 4.5 (tiny.py), a model no family folder holds.

It is not in the registry's FAMILIES (those are first-class); `families.resolve` answers it for
a `*ForCausalLM` config no family owns, and `model.architecture=generic` names it."""

from __future__ import annotations

from ..spec import Family
from .tiny import GenericModelSpec

GENERIC = Family(name="generic", label="generic-path", architectures=(), context_parallel=False,
                 parallel_refusal="no family folder (hpc_rl/models/families/) describes this model, so it runs on the "
                                  "generic path: data parallel only; tensor and context parallel need a family's plan "
                                  "of which modules split how",
                 test_model=GenericModelSpec())

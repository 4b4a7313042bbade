"""The generator's vLLM options checked against the vLLM that will run them, before
submission: each generator.engine_args key must be a field of vLLM's EngineArgs, and
generator.kv_cache_dtype one of vLLM's cache dtypes (a typo would otherwise fail every
engine at start, after the allocation). Needs vLLM importable where the job is launched;
where it is not, the check says so and the engines' own start is the check."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import List, Optional, Tuple

from hpc_rl.config.errors import Violation


def vllm_choices() -> Optional[Tuple[List[str], List[str]]]:
    """(EngineArgs field names, cache dtypes) of the installed vLLM; None without vLLM."""
    try:
        from vllm.config.cache import CacheDType
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return [f.name for f in dataclasses.fields(EngineArgs)], list(typing.get_args(CacheDType))


def engine_option_problems(cfg) -> List[Violation]:
    g = cfg.generator
    if not g.engine_args and g.kv_cache_dtype == "auto":
        return []  # nothing beyond what the project sets: no need to import vLLM here
    choices = vllm_choices()
    if choices is None:
        print("hpc_rl: vLLM is not importable here: generator.engine_args and generator.kv_cache_dtype are checked "
              "when the engines start", flush=True)
        return []
    fields, dtypes = choices
    out = []
    for key in g.engine_args:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            out.append(Violation(f"generator.engine_args.{key}", g.engine_args[key],
                                 "is not an argument of vLLM's EngineArgs (vllm.engine.arg_utils)",
                                 (f"did you mean {close[0]!r}? " if close else "") + "use an EngineArgs field name"))
    if g.kv_cache_dtype not in dtypes:
        out.append(Violation("generator.kv_cache_dtype", g.kv_cache_dtype, "is not one of vLLM's KV cache dtypes",
                             f"set it to one of {dtypes}"))
    return out

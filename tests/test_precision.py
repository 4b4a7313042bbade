"""One precision map: the config's names, torch's dtypes and vLLM's dtype strings agree."""

from __future__ import annotations

import typing

import pytest
import torch

from hpc_rl.config.schema import Precision
from hpc_rl.precision import PRECISIONS, torch_dtype, vllm_dtype


def test_every_config_precision_maps_to_torch_and_vllm():
    assert set(PRECISIONS) == set(typing.get_args(Precision))
    assert [torch_dtype(p) for p in PRECISIONS] == [torch.float32, torch.bfloat16, torch.float16]
    assert [vllm_dtype(p) for p in PRECISIONS] == ["float32", "bfloat16", "float16"]
    with pytest.raises(ValueError, match="fp8"):
        vllm_dtype("fp8")

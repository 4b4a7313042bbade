"""TEST-ONLY stand-ins for Transformer Engine and mamba-ssm, so that megatron-core 0.16.1 can
BUILD its Nemotron-H model (MambaModel with the TE `mamba_stack_spec`) on a CPU machine and
tests can compare the names and shapes of its state dict with what
hpc_rl/models/families/nemotron_h/megatron_mapping.py writes (tests/megatron_names_nemotron_h.py).
Never imported by hpc_rl; nothing built with it runs a forward.

Why stand-ins: megatron-core's Mamba stack is Transformer Engine modules only, and without TE
it replaces `te` with a MagicMock (its layers then hold no parameters); its Mamba mixer refuses
to build without mamba-ssm. Both are CUDA packages that this machine cannot install.

What they hold: parameters with TE's names and tensor-parallel shapes (`weight`,
`layer_norm_weight`, `weight<i>` of a grouped linear; column-parallel layers split their
output rows, row-parallel ones their input columns, "duplicated" ones neither), and the gated
RMSNorm's `weight`. Any other TE or mamba-ssm name resolves to an inert placeholder.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch
from torch import nn

TE_VERSION = "2.20.0"  # the version the gpu extra pins


def _split(rows: int, cols: int, parallel_mode, tp_size: int):
    if parallel_mode == "column":
        return rows // tp_size, cols
    if parallel_mode == "row":
        return rows, cols // tp_size
    return rows, cols


class Linear(nn.Module):
    def __init__(self, in_features, out_features, *args, parallel_mode=None, tp_size=1, bias=True,
                 params_dtype=None, **kwargs):
        super().__init__()
        rows, cols = _split(out_features, in_features, parallel_mode, tp_size or 1)
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=params_dtype or torch.float32))
        if bias:
            self.bias = nn.Parameter(torch.zeros(rows, dtype=params_dtype or torch.float32))


class LayerNormLinear(Linear):
    def __init__(self, in_features, out_features, *args, normalization="LayerNorm", params_dtype=None, **kwargs):
        super().__init__(in_features, out_features, *args, params_dtype=params_dtype, **kwargs)
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=params_dtype or torch.float32))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, dtype=params_dtype or torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, *args, params_dtype=None, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.float32))


class LayerNorm(RMSNorm):
    def __init__(self, hidden_size, *args, params_dtype=None, **kwargs):
        super().__init__(hidden_size, params_dtype=params_dtype)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype or torch.float32))


class DotProductAttention(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


class GroupedLinear(nn.Module):
    def __init__(self, num_gemms, in_features, out_features, *args, parallel_mode=None, tp_size=1, bias=True,
                 params_dtype=None, **kwargs):
        super().__init__()
        rows, cols = _split(out_features, in_features, parallel_mode, tp_size or 1)
        for i in range(num_gemms):
            setattr(self, f"weight{i}", nn.Parameter(torch.zeros(rows, cols, dtype=params_dtype or torch.float32)))
            if bias:
                setattr(self, f"bias{i}", nn.Parameter(torch.zeros(rows, dtype=params_dtype or torch.float32)))


class GatedRMSNorm(nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: the mixer's norm over groups."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None, **kw):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))


def _inert(*args, **kwargs):
    raise NotImplementedError("TEST-ONLY stand-in: builds megatron-core's model for its names, runs nothing")


_REAL = {
    "transformer_engine": {"__version__": TE_VERSION},
    "transformer_engine.pytorch": {"Linear": Linear, "LayerNormLinear": LayerNormLinear, "RMSNorm": RMSNorm,
                                   "LayerNorm": LayerNorm, "DotProductAttention": DotProductAttention,
                                   "GroupedLinear": GroupedLinear, "__version__": TE_VERSION},
    "mamba_ssm": {"__version__": "2.3.2.post1"},
    "mamba_ssm.ops.triton.layernorm_gated": {"RMSNorm": GatedRMSNorm},
    "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": _inert,
                                          "mamba_split_conv1d_scan_combined": _inert},
    "mamba_ssm.ops.triton.selective_state_update": {"selective_state_update": _inert},
}


class _Placeholder(types.ModuleType):
    """A stand-in module: the names above are real; any other resolves to an inert class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():  # a submodule or function (te.pytorch.ops, fp8_autocast): a namespace
            value = _Placeholder(f"{self.__name__}.{name}")
        else:
            value = type(name, (nn.Module,), {"__init__": lambda self, *a, **k: nn.Module.__init__(self)})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    PREFIXES = ("transformer_engine", "mamba_ssm")

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.PREFIXES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []  # a package: its submodules import through this finder too
        for key, value in _REAL.get(spec.name, {}).items():
            setattr(module, key, value)
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    """Before megatron-core is imported: Transformer Engine and mamba-ssm resolve to these."""
    if any(m.split(".")[0] in _Finder.PREFIXES for m in sys.modules):
        raise RuntimeError("install() must run before transformer_engine / mamba_ssm are imported")
    sys.meta_path.insert(0, _Finder())

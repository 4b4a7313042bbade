"""Phi-3 (HF `Phi3ForCausalLM`: Phi-3 mini/medium, Phi-3.5-mini, Phi-4 and Phi-4-mini): a
Llama-style decoder whose checkpoints already fuse q/k/v (`self_attn.qkv_proj`) and gate/up
(`mlp.gate_up_proj`).

- fsdp2: data parallel; tensor parallel refused. The fused HF tensors hold [q; k; v] rows of
  unequal widths (grouped-query) and transformers' attention cuts them at the config's global
  widths (`num_attention_heads * head_dim`): a column split would hand a rank a contiguous
  chunk across the q/k/v boundaries, and a per-member split needs the rows interleaved per rank
  and the attention cutting at local widths, which this version does not write. Context
  parallel refused too: the checkpoints set a sliding window (Phi-3-mini: 2047) that the fsdp2
  context-parallel attention does not apply.
- vLLM (models/phi3.py): its Llama with packed_modules_mapping {qkv_proj: [qkv_proj],
  gate_up_proj: [gate_up_proj]}; the refit sends each rank its rows of every member
  (refit_layout.py).
- megatron: not converted.
- tests: a tiny random Phi-3 with grouped-query attention (tiny.py)."""

from __future__ import annotations

from ..spec import Family, RefitHooks
from . import refit_layout
from .tiny import Phi3ModelSpec

REFIT = RefitHooks(owns=refit_layout.owns, vllm_name=refit_layout.vllm_name, fused_member=refit_layout.fused_member,
                   pieces=refit_layout.pieces, local_shape=refit_layout.local_shape)

FAMILY = Family(name="phi3", label="Phi-3", architectures=("Phi3ForCausalLM",), context_parallel=False,
                parallel_refusal="its checkpoints fuse q/k/v and gate/up into one tensor each, which the fsdp2 "
                                 "backend's tensor-parallel plan does not split per member (transformers' attention "
                                 "cuts the fused output at global widths), and its sliding window is not applied by "
                                 "the fsdp2 context-parallel attention",
                refit=REFIT, test_model=Phi3ModelSpec(),
                # its own fused linears: peft adapts each whole (vLLM's Phi-3 LoRA layers are the same modules)
                lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))

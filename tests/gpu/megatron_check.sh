#!/usr/bin/env bash
# GPU check of the Megatron backend (issues #16, #25) on one GPU: a tiny Llama built here, the
# backend's bf16 log-probs against the Hugging Face model's, one train step, one NaN-loss step that
# must be skipped with the weights unchanged (issue 43; NOT RUN on a GPU yet), the memory savers
# (issue 44; NOT RUN on a GPU yet: a step with full recompute and one with the optimizer's CPU
# offload against a plain one, loss and update equality and peak memory in "memory_savers"; the
# offload needs Transformer Engine, else it is recorded as refused), then a refit
# into a vLLM engine on the same GPU with token_mult_prob_error <= 1.01 (bf16).
# Needs the `gpu` extra (megatron-core, vLLM CUDA; Transformer Engine optional: without it
# megatron-core's local layer specs are used). Fits in about 5 minutes on one H200.
# Then the same for a tiny dense Nemotron-H (MambaModel; needs Transformer Engine, mamba-ssm and
# causal-conv1d: the JSON names what is missing). The Nemotron-H half has NOT RUN: no machine
# with those packages was lent (the one H200 lent had none of them and no vLLM).
# Writes bench/results/megatron_gpu.json and megatron_gpu_nemotron_h.json.
# Run from anywhere:  bash tests/gpu/megatron_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -W ignore -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
# without vLLM the check still runs its first stages; the JSON names the stage it stopped at
python -W ignore -c "import vllm; print('vllm', vllm.__version__)" || echo "vllm: not installed (the refit stage will fail)"
python -W ignore -c "import transformer_engine; print('transformer-engine', transformer_engine.__version__)" || echo "transformer-engine: not installed (local layer specs)"
rc=0
timeout 270 python -m hpc_rl.models.megatron.gpu_check --out bench/results/megatron_gpu.json || rc=$?
python -W ignore -c "import mamba_ssm, causal_conv1d; print('mamba-ssm', mamba_ssm.__version__)" || echo "mamba-ssm / causal-conv1d: not installed (the Nemotron-H half will say so)"
timeout 270 python -m hpc_rl.models.megatron.gpu_check --model nemotron_h --out bench/results/megatron_gpu_nemotron_h.json || rc=$?
exit $rc

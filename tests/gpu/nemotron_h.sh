#!/usr/bin/env bash
# GPU check of Nemotron-H (issue #24), bf16: a random dense hybrid (M*M-, kernel-friendly shapes:
# hidden 256, attention head_dim 64, Mamba 8 heads x 32, 2 groups, state 64, chunk 128) built
# here in bf16; the trainer's backend (fsdp2, transformers' NemotronHForCausalLM running
# mamba-ssm's and causal-conv1d's CUDA kernels) perturbs every weight and refits them into a
# vLLM engine on the GPU(s): agreement after the refit and prefill vs decode <= 1.01 (the
# repo's bf16 goal), A/D finite, vLLM's conv_weights alias intact, and the original weights
# refit back give the fresh load's greedy tokens and A/D/conv1d (bench/nemotron_h_refit.py).
# The JSON records which implementation transformers' Mamba mixer ran; the PyTorch fallback
# fails the check. TP = min(GPUs, 2) (one engine task, vLLM's own workers).
# Needs the `gpu` extra, mamba-ssm and causal-conv1d included: they ship as sources only on
# PyPI and build against the installed torch with nvcc (CUDA toolkit), hence
#   pip install --no-build-isolation -e '.[gpu]'
# NOT RUN YET: written on a CPU-only machine (no GPU was lent); there only its Python parts
# were checked (bash -n, py_compile, and the same bench on CPU in fp32 via
# tests/test_nemotron_h_refit.py). Expected to fit in about 5 minutes on one H200.
# Writes bench/results/nemotron_h_refit_cuda.json. Run from anywhere:  bash tests/gpu/nemotron_h.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -W ignore -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
if ! python -W ignore -c "import mamba_ssm, causal_conv1d; print('mamba-ssm', mamba_ssm.__version__, 'causal-conv1d', causal_conv1d.__version__)"; then
  echo "mamba-ssm / causal-conv1d are not importable: install the gpu extra (pip install --no-build-isolation -e '.[gpu]'; needs nvcc)" >&2
  exit 2
fi
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
tp=$(( gpus >= 2 ? 2 : 1 ))
timeout 540 python bench/nemotron_h_refit.py --device cuda --precision bf16 --tp "$tp" \
  --checkpoint untrained:gpu --out bench/results/nemotron_h_refit_cuda.json

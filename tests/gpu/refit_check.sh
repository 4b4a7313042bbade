#!/usr/bin/env bash
# GPU check of the refit path: the reshard plan's walk between two processes (NCCL across
# GPUs, CUDA IPC when both share one GPU), with the bytes verified and GB/s printed next to
# one raw message of the same size on the same transport. Writes bench/results/refit_gpu.json.
# Fits in 5 minutes on one H200. Run from the repository root:  bash tests/gpu/refit_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 280 python -m hpc_rl.refit.gpu_check --gb "${REFIT_CHECK_GB:-2}" --timeout 120 --out bench/results/refit_gpu.json

#!/usr/bin/env bash
# GPU check of trainer parallelism: tp=2 (with and without sequence parallel) and dp=2
# (FSDP2), and dp=2 with trainer.cpu_offload (NOT RUN on a GPU yet: its peak memory is recorded
# beside plain dp=2's), on two GPUs over NCCL against the dp-only backend on one GPU, fp32:
# log-probs and the weights after one optimizer step within 1e-5. Writes bench/results/parallel_gpu.json.
# Needs 2 GPUs (with one it writes "ran": false). Fits in 3 minutes. From the repository root:
#   bash tests/gpu/parallel_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 280 python -m hpc_rl.models.parallel.gpu_check --out bench/results/parallel_gpu.json

#!/usr/bin/env bash
# GPU check of expert parallel (issues #13, #24): a tiny Qwen3-MoE and a tiny MoE Nemotron-H
# (non-gated experts, latent MoE; the second line of each pair) with ep=2 over NCCL (one GPU per
# rank) against dp-only FSDP2 on the same ranks and rows, fp32: log-probs before and after one
# optimizer step and the gathered weights within 1e-5, and each layout's step time.
# Needs 2 GPUs (NCCL refuses two ranks on one GPU); on one GPU it runs the CPU/gloo twin
# instead and says so. Writes bench/results/ep_equivalence_cuda.json (or _cpu.json).
# Not run yet: no GPU was lent while it was written. Run from the repository root:
#   bash tests/gpu/ep_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  timeout 280 python bench/ep_equivalence.py --device cuda --world 2 --ep 2
  timeout 280 python bench/ep_equivalence.py --device cuda --world 2 --ep 2 --model nemotron_h
  if [ "$gpus" -ge 4 ]; then  # two ep groups: the experts' gradients also meet over expert data parallel
    timeout 280 python bench/ep_equivalence.py --device cuda --world 4 --ep 2 --out bench/results/ep_equivalence_cuda_w4.json
  fi
else
  echo "only $gpus GPU(s): running the gloo twin on CPU (ep over NCCL needs one GPU per rank)"
  timeout 280 python bench/ep_equivalence.py --device cpu --world 2 --ep 2
fi

#!/usr/bin/env bash
# GPU check of sequence packing and the engine's CUDA graphs (issue #44), to run when a device is lent:
#  - variable-length attention: packed vs padded rows with flash-attn's varlen path (when installed)
#    and SDPA's block-diagonal mask, on a dense Llama;
#  - Mamba's sequence index: a hybrid Nemotron-H packed with mamba-ssm's seq_idx (when mamba-ssm and
#    causal-conv1d are installed) and with the per-sample path, against padded rows;
#  - CUDA graphs in the engine: tests/gpu/engine_graphs.sh.
# Log-probs, the train step's loss and gradients within the CPU twin's bounds (tests/test_packing.py).
# Writes bench/results/packing_cuda.json (and engine_graphs_cuda.json). About 4 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 300 python tests/gpu/packing_check.py --out bench/results/packing_cuda.json
python -c "import json,sys; d=json.load(open('bench/results/packing_cuda.json')); sys.exit(0 if d['passed'] else 1)"
bash tests/gpu/engine_graphs.sh

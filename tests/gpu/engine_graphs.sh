#!/usr/bin/env bash
# GPU check of the generator engine's CUDA graphs (issue #44): generator.enforce_eager unset must
# give vLLM a CUDA-graph mode other than NONE on a GPU, and decode faster than the eager build of
# the same engine (both built by engines/vllm.py from the project's own arguments).
# Needs the `gpu` extra (vLLM CUDA). About 2 minutes on one H200.
# Writes bench/results/engine_graphs_cuda.json. Run from anywhere:  bash tests/gpu/engine_graphs.sh
# The CPU twin (both eager there): python -m hpc_rl.engines.graphs_check
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 420 python -m hpc_rl.engines.graphs_check --out bench/results/engine_graphs_cuda.json
python - <<'PY'
import json
d = json.load(open("bench/results/engine_graphs_cuda.json"))
graphs, eager = d["runs"]
assert graphs["cudagraph_mode"] != "NONE" and not graphs["enforce_eager"], graphs
assert eager["enforce_eager"], eager
print("CUDA graphs:", graphs["cudagraph_mode"], "speedup over eager", d["graphs_speedup"])
PY

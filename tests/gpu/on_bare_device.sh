#!/usr/bin/env bash
# Runs GPU checks on a bare lent machine (the workplace's `device` tool: its own python3 and
# packages, no registry): installs the wheels carried in .whl/ (those its image lacks, e.g.
# megatron-core, omegaconf), makes `python` name python3, runs each named tests/gpu/*.sh in
# turn (a failing one does not stop the next), and copies the JSON they wrote to $OUT.
#   bash tests/gpu/on_bare_device.sh megatron_check refit_check
set -uo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v python >/dev/null || { mkdir -p /tmp/bin && ln -sf "$(command -v python3)" /tmp/bin/python && export PATH="/tmp/bin:$PATH"; }
export PYTHONUNBUFFERED=1
before=$(mktemp); touch "$before"
for check in "$@"; do
  echo "=== $check ($(date +%T))"
  t0=$SECONDS
  bash "tests/gpu/$check.sh"; echo "=== $check: rc $? in $((SECONDS - t0)) s"
done
[ -n "${OUT:-}" ] && find bench/results -name '*.json' -newer "$before" -exec cp {} "$OUT/" \;
ls -la "${OUT:-.}"

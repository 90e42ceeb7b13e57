#!/usr/bin/env bash
# scripts/gpu/abort_check.py on the device machine, after vLLM's install calls (../shared/gpu/vllm-h200):
# carry [".whl", "sits/v1"], run `OUT=$OUT bash scripts/gpu/abort_check.sh`. $OUT gets run.log and the engine's log.
set -u
OUT="${OUT:-/tmp/abort-check-out}"
. scripts/gpu/device_setup.sh
install_wheels .sits-mesh-wheels .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
timeout 400 python3 scripts/gpu/abort_check.py 2>&1 | tee "$OUT/run.log" | tail -20
rc=${PIPESTATUS[0]}
cp "$(ls -td /tmp/sits-abort-check-*/ | head -1)vllm-sits.log" "$OUT/" 2>/dev/null  # this run's, the newest
echo "rc $rc, total $(( $(date +%s) - START )) s"
exit "$rc"

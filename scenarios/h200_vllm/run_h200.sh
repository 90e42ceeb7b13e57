#!/usr/bin/env bash
# SITS on real vLLM on the H200 device machine, in one call after vLLM is installed there
# (../shared/gpu/vllm-h200: /tmp/site/env.sh exists). From the repository root, carrying `.whl`
# (scripts/gpu/build_wheelhouse.sh: the services' wheels, smg-grpc-servicer and redis-server) and
# the generated stubs in sits/v1:
#   OUT=dir scenarios/h200_vllm/run_h200.sh scenarios [run.py options]   # the scenarios, both modes
#   OUT=dir scenarios/h200_vllm/run_h200.sh overhead [overhead.py options] # plugin cost on decode
# $OUT gets <what>.tar.gz (raw results, logs) and run.log; `python -m scenarios.h200_vllm.report`
# turns the raw results into the figures, plots and traces (here or on any machine).
set -u
what=${1:?scenarios or overhead}; shift
OUT="${OUT:-/tmp/h200-vllm-out}"
. scripts/gpu/device_setup.sh
install_wheels .sits-wheels .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
{
  cat /proc/sys/kernel/random/boot_id
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  python3 -c 'import torch, grpc, google.protobuf as pb; print("torch", torch.__version__, "grpc", grpc.__version__, "protobuf", pb.__version__)'
  python3 -c 'import services.capture.main, services.decision.main, services.executor.main, services.validator.main, smg_grpc_servicer; print("services import")'
  echo "setup took $(( $(date +%s) - START )) s"
} 2>&1 | tee "$OUT/run.log"
case "$what" in
  scenarios) timeout "${SCENARIO_TIMEOUT_S:-560}" python3 -m scenarios.h200_vllm.run --out "$OUT/raw" \
               --redis-server /tmp/redis/bin/redis-server "$@" 2>&1 | tee -a "$OUT/run.log" ;;
  overhead) timeout "${SCENARIO_TIMEOUT_S:-560}" python3 -m scenarios.h200_vllm.overhead --out "$OUT/raw" "$@" \
               2>&1 | tee -a "$OUT/run.log" ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
# Whatever ran, its results and logs come back (the runner stops every process it started).
tar -C "$OUT" -czf "$OUT/$what.tar.gz" raw && rm -rf "$OUT/raw"
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/run.log"
ls -la "$OUT"

#!/usr/bin/env bash
# Everything capture needs from the H200, in one run (see traces/README.md):
#   1. the OOM hook test (host still raises; event carries the right bytes and stats; gRPC and spool paths),
#   2. four recorded traces for replay (plateau, linear_oom, sawtooth_frag, contention),
#   3. NVML sampling cost at 10 Hz and 100 Hz (NVML_SECONDS each, default 30).
# Usage (on the GPU machine, from the repository root, stubs in sits/v1 present): OUT=dir scripts/gpu/capture_h200.sh
# Results: $OUT/capture_oom_check.json, $OUT/capture_overhead_raw.json, $OUT/traces.tar.gz, $OUT/capture_h200.log
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/capture-h200}"
mkdir -p "$OUT/traces"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,mig.mode.current --format=csv
  python3 -c 'import google.protobuf, grpc, torch, pynvml; print("protobuf", google.protobuf.__version__, "grpc", grpc.__version__, "torch", torch.__version__)'
  echo "== oom hook check"
  timeout 90 python3 -m scripts.gpu.capture_oom_check
  for name in plateau linear_oom sawtooth_frag contention; do
    echo "== trace $name"
    TRACE_SECONDS="${TRACE_SECONDS:-15}" timeout 60 python3 -m scripts.gpu.capture_record_traces "$OUT/traces" "$name"
  done
  echo "== nvml overhead"
  timeout 120 python3 -m scripts.gpu.capture_nvml_overhead "$OUT/capture_overhead_raw.json" "${NVML_SECONDS:-30}"
  date -u +%Y-%m-%dT%H:%M:%SZ
} 2>&1 | tee "$OUT/capture_h200.log"
tar -C "$OUT" -czf "$OUT/traces.tar.gz" traces && rm -rf "$OUT/traces"
ls -la "$OUT"

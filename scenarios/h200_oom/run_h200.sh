#!/usr/bin/env bash
# The OOM-prevention scenario on the H200 machine, both runs in one call.
# From the repository root, with `.whl` (scripts/gpu/build_wheelhouse.sh) and the stubs in `sits/v1` carried:
#   OUT=dir scenarios/h200_oom/run_h200.sh [run.py options]
# Results in $OUT: without.json, with.json (raw), h200_oom_prevention.png, run.log, logs.tar.gz.
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/h200-oom-out}"
mkdir -p "$OUT"
START=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 3; }
export PYTHONPATH="/tmp/site:$PWD"
# redis-server from Debian's package; the binary decides what it is from its name, hence the copy.
mkdir -p /tmp/redis/bin /tmp/redis/lib
cp .whl/redis/usr/bin/redis-check-rdb /tmp/redis/bin/redis-server
for lib in $(ldd /tmp/redis/bin/redis-server | awk '/not found/ {print $1}'); do
  cp ".whl/redis/lib/$lib" /tmp/redis/lib/ && echo "carried $lib"
done
export H200_OOM_REDIS_LIB=/tmp/redis/lib
LD_LIBRARY_PATH=/tmp/redis/lib /tmp/redis/bin/redis-server --version || { echo "redis-server does not run"; exit 4; }
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  python3 -c 'import torch, grpc, google.protobuf as pb; print("torch", torch.__version__, "grpc", grpc.__version__, "protobuf", pb.__version__)'
  python3 -c 'import services.capture.main, services.decision.main, services.executor.main; print("services import")'
} 2>&1 | tee "$OUT/run.log"
python3 -c 'import services.executor.main, services.decision.main, services.capture.main' || { echo "services do not import"; exit 5; }
echo "setup took $(( $(date +%s) - START )) s" | tee -a "$OUT/run.log"
timeout "${SCENARIO_TIMEOUT_S:-420}" python3 -m scenarios.h200_oom.run --out "$OUT/raw" \
  --redis-server /tmp/redis/bin/redis-server "$@" 2>&1 | tee -a "$OUT/run.log"
cp "$OUT"/raw/without.json "$OUT"/raw/with.json "$OUT"/ 2>/dev/null
python3 -m scenarios.h200_oom.plot "$OUT" "$OUT/h200_oom_prevention.png" 2>&1 | tee -a "$OUT/run.log"
tar -C "$OUT/raw" -czf "$OUT/logs.tar.gz" logs && rm -rf "$OUT/raw"
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/run.log"
ls -la "$OUT"

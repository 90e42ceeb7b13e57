# Sourced (not run) by the device scripts, from the repository root on the device machine, after vLLM's
# install calls (../shared/gpu/vllm-h200): scenarios/h200_vllm/run_h200.sh, scripts/gpu/overload_gpu.sh,
# scripts/gpu/overload_http_gpu.sh. Sets up what they need: $OUT, vLLM's environment, `install_wheels`,
# a redis-server from the carried .whl/redis at /tmp/redis/bin/redis-server (H200_REDIS_LIB: the
# libraries the image lacks), `start_mesh_stack` (the overload benches' Envoy and Redis) and `machine_report`.
export PYTHONUNBUFFERED=1
OUT="${OUT:?set OUT before sourcing device_setup.sh}"
mkdir -p "$OUT"
START=$(date +%s)
[ -f /tmp/site/env.sh ] || { echo "vLLM is not installed under /tmp/site (run the install calls first)"; exit 3; }
. /tmp/site/env.sh

# install_wheels MARKER WHEEL...: into /tmp/site, once per machine (MARKER is a file under /tmp/site).
install_wheels() {
  local marker=/tmp/site/$1
  shift
  [ -f "$marker" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" \
    || { echo "wheel install failed"; exit 3; }
  touch "$marker"
}

mkdir -p /tmp/redis/bin /tmp/redis/lib
cp .whl/redis/usr/bin/redis-check-rdb /tmp/redis/bin/redis-server 2>/dev/null
for lib in $(ldd /tmp/redis/bin/redis-server | awk '/not found/ {print $1}'); do cp ".whl/redis/lib/$lib" /tmp/redis/lib/; done
export H200_REDIS_LIB=/tmp/redis/lib

# start_mesh_stack: Envoy (installed under /tmp/site from its wheel) on the PATH and the Redis the embedded
# stack expects on its default port, as on the development machines; Redis stops when the script exits.
start_mesh_stack() {
  export PYTHONPATH="/tmp/site:$PWD"
  mkdir -p /tmp/site/bin
  ln -sf /tmp/site/envoy/_bin/envoy /tmp/site/bin/envoy
  export PATH="/tmp/site/bin:$PATH"
  LD_LIBRARY_PATH="$H200_REDIS_LIB" /tmp/redis/bin/redis-server --bind 127.0.0.1 --port 6379 --save "" \
    --appendonly no --dir /tmp/redis >"$OUT/redis.log" 2>&1 &
  REDIS=$!
  trap 'kill $REDIS 2>/dev/null' EXIT
}

# machine_report: the head of an overload run's log; a boot_id that differs from the last call's is a fresh machine
# (its /tmp is empty). After start_mesh_stack, which puts Envoy on the PATH.
machine_report() {
  cat /proc/sys/kernel/random/boot_id
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  envoy --version | head -2
}

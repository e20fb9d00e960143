# llmc: every target exits non-zero on any error, so deployment pipelines can call them.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
OUT ?= out
EXPORT_DIR ?= $(OUT)/export
ENGINE_DIR ?= $(OUT)/engine-$(BACKEND)$(if $(filter-out none,$(QUANT)),-$(QUANT))
BACKEND ?= ort
QUANT ?= none
DTYPE ?= float32
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
BUILD_ARGS ?=
BENCH_ARGS ?= --compare-torch --plot $(OUT)/bench.png
HOST ?= 127.0.0.1
PORT ?= 8000
TARGET ?= docker
PACKAGE_DIR ?= $(OUT)/package-$(TARGET)
PACKAGE_ARGS ?=
REPLICAS ?= 2
RAY_ARGS ?=

.PHONY: help install compiler browser demo export build run verify test lint bench serve package serve-ray clean

help:
	@echo "make demo                 install, export + build the default model, answer a chat prompt"
	@echo "make test                 install and run the test suite"
	@echo "make export MODEL=... OUT=...   make build BACKEND=ort QUANT=none   make run PROMPT=..."
	@echo "make build QUANT=int4      the default build is the fastest one this CPU runs (BUILD_ARGS for others)"
	@echo "make package TARGET=docker|triton|kserve|ray   deployable artifacts of ENGINE_DIR in PACKAGE_DIR"
	@echo "make serve-ray REPLICAS=2  Ray Serve: an OpenAI-compatible ingress and REPLICAS engine replicas"

KERNELS := $(wildcard llmc/engines/kernels/*.c llmc/engines/kernels/*.h)

# installing builds llmc's C operators into the package (setup.py): a C compiler is needed then, never after
$(BIN)/llmc: pyproject.toml setup.py | compiler
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a bare requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[export,serve,bench,dev,ray,kserve]'
	touch $(BIN)/llmc $(VENV)/.ops-built

# the operator library again when its sources change (an editable install does not rebuild it by itself)
$(VENV)/.ops-built: $(KERNELS) | $(BIN)/llmc
	$(BIN)/pip install -q --no-deps -e .
	touch $@

install: $(BIN)/llmc $(VENV)/.ops-built

demo: install
	$(BIN)/llmc export $(MODEL) -o $(EXPORT_DIR) --force
	$(BIN)/llmc build $(EXPORT_DIR) --backend $(BACKEND) -o $(ENGINE_DIR) --force
	$(BIN)/llmc run $(ENGINE_DIR) "$(PROMPT)"

export: install
	$(BIN)/llmc export $(MODEL) -o $(EXPORT_DIR) --dtype $(DTYPE) --force

build: install
	$(BIN)/llmc build $(EXPORT_DIR) --backend $(BACKEND) --quant $(QUANT) -o $(ENGINE_DIR) --force $(BUILD_ARGS)

run: install
	$(BIN)/llmc run $(ENGINE_DIR) "$(PROMPT)"

verify: install
	$(BIN)/llmc verify $(ENGINE_DIR)

# llmc's operators are compiled when the package is installed (a deployment of a built wheel needs no compiler).
compiler:
	@command -v "$${CC:-cc}" >/dev/null || command -v gcc >/dev/null || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -q gcc >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q gcc >/dev/null; }; \
	  else echo "make: a C compiler is needed (llmc's own operators and their tests): install gcc" >&2; exit 1; fi; }

# the chat page's browser test drives Debian's chromium with its driver (Selenium; no browser download)
browser:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || { $$SUDO apt-get update -q >/dev/null && \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null; } || { \
	  echo "make: the chat page's test needs chromium and chromium-driver: install them" >&2; exit 1; }; }

test: install browser
	$(BIN)/ruff check llmc tests
	$(BIN)/mypy llmc
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	$(BIN)/llmc bench $(ENGINE_DIR) --batch-sizes 1,8 --prompt-len 128 --new-tokens 128 --contexts 512,2048 \
		$(BENCH_ARGS)

serve: install
	$(BIN)/llmc serve $(ENGINE_DIR) --host $(HOST) --port $(PORT)

package: install
	$(BIN)/llmc package $(ENGINE_DIR) --target $(TARGET) -o $(PACKAGE_DIR) --force $(PACKAGE_ARGS)

serve-ray: install
	$(BIN)/llmc deploy ray $(ENGINE_DIR) --replicas $(REPLICAS) --host $(HOST) --port $(PORT) $(RAY_ARGS)

lint: install
	$(BIN)/ruff check llmc tests
	$(BIN)/mypy llmc

clean:
	rm -rf $(OUT)

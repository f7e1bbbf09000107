# Two entry points that work from a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-gpu bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: an open range would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/zeropp train

test: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit tests/dist

# on a machine with a CUDA device and a CUDA build of torch
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

bench: $(STAMP)
	# DS_BUILD_OPS=0: DeepSpeed (the bench extra) installs without compiling CUDA ops and keeps the pinned torch.
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/bench_quant.py
	# the side-by-side cluster benchmark (~30-40 min; needs root for network namespaces, else ledger-only)
	$(BIN)/zeropp bench

clean:
	rm -rf $(VENV) build src/*.egg-info

# Two commands do all the set-up on a fresh machine:
#   make demo   shatters the bundled trained model (examples/stdlib-moe) to Q4 and FP8, verifies and runs it
#   make test   runs the test suite
# TORCH picks the torch build: the default is the CPU wheel CI uses; `make setup TORCH=torch` takes any.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NATIVE := $(shell find native -type f) CMakeLists.txt pyproject.toml

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q "scikit-build-core>=0.10" "nanobind>=2.4"
	$(BIN)/pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

demo: setup
	$(BIN)/python examples/quickstart.py

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/pip install -q -e ".[bench]" --no-build-isolation
	$(BIN)/python benchmarks/quant_error.py
	$(BIN)/python benchmarks/convert_bench.py
	$(BIN)/python benchmarks/kernel_bench.py
	$(BIN)/python benchmarks/reader_bench.py
	$(BIN)/python benchmarks/e2e_bench.py
	$(BIN)/python benchmarks/quality_bench.py
	$(BIN)/python benchmarks/routing_bench.py

clean:
	rm -rf $(VENV) build demo

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

.PHONY: setup demo test test-asan test-native test-arm bench clean

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

# The native core under AddressSanitizer and UndefinedBehaviorSanitizer (build/asan), loaded in place of the
# installed module (tests/conftest.py) by the tests that reach native code. Python itself is not
# instrumented: the sanitizer runtimes are preloaded, and leak reports (Python's own) are off.
ASAN_BUILD := build/asan
ASAN_TESTS := tests/test_kernels.py tests/test_attention.py tests/test_ring.py tests/test_native_format.py \
	tests/test_decode_layer.py tests/test_hybrid.py tests/test_engine.py tests/test_backbone_modes.py \
	tests/test_golden_qwen3_moe.py tests/test_kv_cache.py tests/test_device_tier.py tests/test_faults.py \
	tests/test_quant.py tests/test_mixed_precision.py
test-asan: setup
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Release -DMOSAIC_SANITIZE=ON \
		-DPython_EXECUTABLE=$(abspath $(BIN)/python) > $(ASAN_BUILD).log 2>&1 || { tail -40 $(ASAN_BUILD).log; false; }
	cmake --build $(ASAN_BUILD) --target _native -j 2 >> $(ASAN_BUILD).log 2>&1 || { tail -40 $(ASAN_BUILD).log; false; }
	MOSAIC_NATIVE_MODULE=$$(ls $(abspath $(ASAN_BUILD))/_native*.so) \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 $(BIN)/python -m pytest -q -p no:cacheprovider $(ASAN_TESTS)

# The native core alone (no Python): native/tests/selftest.cpp holds every kernel of the build's ISAs to
# the scalar reference, built with AddressSanitizer and UndefinedBehaviorSanitizer. test-native runs it on
# this machine; test-arm cross-compiles it for AArch64 (Debian's g++-aarch64-linux-gnu) and runs it under
# qemu-user (qemu-aarch64), once as the default CPU (NEON + dot product) and once as a Cortex-A53 (no dot
# product); LeakSanitizer cannot run under qemu. qemu checks correctness, not speed.
test-native:
	mkdir -p build
	cmake -S . -B build/selftest -DCMAKE_BUILD_TYPE=Release -DMOSAIC_PYTHON=OFF -DMOSAIC_SELFTEST=ON \
		-DMOSAIC_SANITIZE=ON > build/selftest.log 2>&1 || { tail -40 build/selftest.log; false; }
	cmake --build build/selftest --target selftest -j 2 >> build/selftest.log 2>&1 || { tail -40 build/selftest.log; false; }
	build/selftest/selftest
	MOSAIC_ISA=scalar build/selftest/selftest

QEMU_ARM := ASAN_OPTIONS=detect_leaks=0 qemu-aarch64 -L /usr/aarch64-linux-gnu
test-arm:
	mkdir -p build
	cmake -S . -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
		-DMOSAIC_PYTHON=OFF -DMOSAIC_SELFTEST=ON -DMOSAIC_SANITIZE=ON > build/aarch64.log 2>&1 \
		|| { tail -40 build/aarch64.log; false; }
	cmake --build build/aarch64 --target selftest -j 2 >> build/aarch64.log 2>&1 || { tail -40 build/aarch64.log; false; }
	$(QEMU_ARM) build/aarch64/selftest  # qemu's "max" CPU: NEON, the dot product and i8mm
	$(QEMU_ARM) -cpu neoverse-n1 build/aarch64/selftest  # the dot product without i8mm
	$(QEMU_ARM) -cpu cortex-a53 build/aarch64/selftest  # neither

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

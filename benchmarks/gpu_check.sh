#!/usr/bin/env bash
# The one prepared check for a machine with a CUDA GPU (under 8 minutes): build the native module against
# the machine's own torch, run the device-tier tests (CUDA ones included), then the GPU benchmark.
#   bash benchmarks/gpu_check.sh            # from the repository root; prints a summary at the end
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-/tmp}/gpu_check.log
: > "$LOG"
step() { echo "== $*" | tee -a "$LOG"; }

step "build ($($PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"
$PY -m pip install --no-build-isolation --no-deps -q -e . >> "$LOG" 2>&1 || { echo "build failed"; tail -30 "$LOG"; exit 1; }
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" | tee -a "$LOG"

step "tests: device tier (host stand-in) and CUDA"
timeout 240 $PY -m pytest -q -x tests/test_gpu_tier.py tests/test_device_tier.py 2>&1 | tee -a "$LOG" | tail -15
tests=${PIPESTATUS[0]}

step "benchmark: decode vs experts resident, policies side by side"
timeout 300 $PY benchmarks/gpu_bench.py --layers 4 --warm 48 --tokens 32 2>&1 | tee -a "$LOG" | tail -15
bench=${PIPESTATUS[0]}

step "summary: tests exit $tests, benchmark exit $bench (log: $LOG)"
exit $(( tests != 0 || bench != 0 ))

#!/usr/bin/env bash
# One prepared check for the GPU machine (Python 3.12, JAX 0.11.2 + CUDA, no network).
# Installs the project, runs the Pallas kernel tests (exponent and word mode) un-interpreted on
# the GPU, then the kernel throughput benchmark (both modes) and (if present)
# benchmarks/gather_bench.py. Every step has a timeout and the timeouts sum to 470 s, so the
# whole script ends in under 8 minutes. Exits non-zero if the kernel tests fail.
#
#   bash benchmarks/gpu_check.sh            # writes under ${OUT:-results/gpu}
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
step() { echo; echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

# The real backend, not the CPU that tests/conftest.py defaults to (it uses setdefault).
export JAX_PLATFORMS="${CIERA_CHECK_PLATFORMS:-cuda}"  # override only for a dry run off-GPU
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1

step "install (no network: no deps, no build isolation)"
if ! timeout 60 python -m pip install --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1; then
  echo "pip install -e . failed (see $OUT/pip.log); falling back to PYTHONPATH" | tee -a "$LOG"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step "nvidia-smi"
timeout 15 nvidia-smi 2>&1 | tee -a "$LOG"

step "jax devices"
timeout 45 python -c "import jax; print(jax.__version__, jax.default_backend(), jax.devices())" 2>&1 | tee -a "$LOG"

# --noconftest: tests/conftest.py asks for 8 emulated CPU devices; the kernel tests need one
# device and must see the GPU.
step "pytest kernel tests (Pallas kernels compiled by Triton, not interpreted)"
timeout 150 python -m pytest tests/test_kernels.py tests/test_word_kernels.py -q \
  --noconftest -p no:cacheprovider --durations=10 \
  --junitxml="$OUT/test_kernels.xml" 2>&1 | tee "$OUT/test_kernels.log" | tail -40 | tee -a "$LOG"
TEST_RC=${PIPESTATUS[0]}
echo "kernel tests exit code: $TEST_RC" | tee -a "$LOG"

step "kernel throughput (exponent + word mode, xla + pallas vs copy, 16..256 MB)"
timeout 120 python benchmarks/kernel_throughput.py --out "$OUT/kernel_throughput.json" \
  --sizes-mb 16 64 256 --variants 4096x8 16384x8 2>&1 \
  | tee -a "$LOG"
echo "kernel benchmark exit code: ${PIPESTATUS[0]}" | tee -a "$LOG"

if [[ -f benchmarks/gather_bench.py ]]; then
  step "benchmarks/gather_bench.py"
  if timeout 20 python benchmarks/gather_bench.py --help 2>/dev/null | grep -q -- "--out"; then
    GATHER_ARGS=(--out "$OUT/gather_bench.json")
  else
    GATHER_ARGS=()
  fi
  timeout 60 python benchmarks/gather_bench.py "${GATHER_ARGS[@]}" 2>&1 | tee -a "$LOG"
  echo "gather benchmark exit code: ${PIPESTATUS[0]}" | tee -a "$LOG"
else
  step "benchmarks/gather_bench.py absent: skipped"
fi

step "done: kernel tests exit code $TEST_RC; outputs in $OUT"
exit "$TEST_RC"

#!/usr/bin/env bash
# One prepared check for the GPU machine (one H200, Python 3.12, JAX 0.11.x + CUDA, no network).
# Installs the project (no deps, no build isolation), then, writing everything under $OUT:
#   1. the kernel exactness tests (exponent, word, fused decode+checksum) compiled for real on
#      BOTH Pallas backends (Mosaic GPU and Triton: the tests are parametrized over them and
#      run un-interpreted when the default backend is a GPU), and the escape kernels (pack,
#      exponent and word fills: Triton only) against the jnp loops;
#   2. kernel_throughput: every kernel vs a copy of the same bytes in HBM, 16-256 MB, incl.
#      the receiver's decode+checksum unfused vs fused, the escapes (jnp loops vs Triton
#      kernels), and a block-size sweep;
#   3. a one-GPU gather_bench (the codec's overhead per gathered byte: 1 device, so the
#      "all-gather" is a copy and everything else is codec);
#   3b. gather_profile: the same gather's kernels under JAX's profiler (launches, kernel time,
#      the wall time no kernel covers), exponent and word caches and plain;
#   4. gpu_crossover: each mode's codec as a measured fraction of a copy (encode + decode at
#      their counted bytes, from step 2) and the cost model's crossover bandwidth at that
#      fraction against NVLink 4, NDR 400/200, RoCE 100 and 25 GbE (docs/results.md,
#      "Real-socket crossovers"). The links themselves need two or more GPUs: not measured here;
#   5. gpu_train_check.sh: `ciera train --devices 1`, plain twice and four compressed modes,
#      params bitwise equal to plain's (its own header says what it checks).
# Writes 8 files (what the device returns at most). On an H100: 157 s for steps 1-4 and about
# 2 minutes for step 5 (2026-12-05). Exits non-zero if the kernel tests or the train check fail.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh      # default OUT: results/gpu
#   CIERA_CHECK_PLATFORMS=cpu CIERA_CHECK_QUICK=1 bash benchmarks/gpu_check.sh   # CPU dry run
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
QUICK="${CIERA_CHECK_QUICK:-}"  # dry run: one small size, few reps, no block sweep

step "install: pip install --no-deps -e . (no network: no build isolation)"
if [[ -n "$QUICK" ]]; then
  echo "dry run: install skipped (PYTHONPATH)" | tee -a "$LOG"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif ! timeout 45 python -m pip install --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
  echo "pip install -e . failed (its output above); falling back to PYTHONPATH" | tee -a "$LOG"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step "nvidia-smi"
timeout 10 nvidia-smi 2>&1 | tee -a "$LOG"

step "jax, devices, what impl=auto/pallas pick here"
timeout 30 python -c "
import jax
from ciera_jax import kernels as K
d = jax.devices()[0]
print('jax', jax.__version__, jax.default_backend(), d.device_kind,
      'cc', getattr(d, 'compute_capability', None), 'backends', K.available_backends())
print('auto ->', K.resolve('auto'), '| pallas ->', K.resolve('pallas'))
" 2>&1 | tee -a "$LOG"

# --noconftest: tests/conftest.py asks for 8 emulated CPU devices; these tests need one device
# and must see the GPU. -W: JAX >= 0.11 warns that the Triton backend is deprecated (expected).
step "kernel exactness tests, Mosaic GPU and Triton compiled (not interpreted)"
if [[ -n "$QUICK" ]]; then TESTS=(tests/test_checksum_kernel.py); else
  TESTS=(tests/test_kernels.py tests/test_word_kernels.py tests/test_checksum_kernel.py
         tests/test_escape_kernels.py); fi
timeout 170 python -m pytest "${TESTS[@]}" -q -rs --noconftest -p no:cacheprovider \
  -W "ignore:The Pallas Triton backend is deprecated:DeprecationWarning" --durations=10 \
  2>&1 | tee "$OUT/test_kernels.log" | tail -40 | tee -a "$LOG"
TEST_RC=${PIPESTATUS[0]}
echo "kernel tests exit code: $TEST_RC" | tee -a "$LOG"

step "kernel throughput vs HBM copy (exponent + word mode, decode+checksum unfused vs fused)"
if [[ -n "$QUICK" ]]; then KT=(--sizes-mb 1 --reps 2 --dtypes bf16); else
  KT=(--sizes-mb 16 64 256 --reps 20 --blocks 1024 16384); fi
timeout 130 python benchmarks/kernel_throughput.py --out "$OUT/kernel_throughput.json" \
  "${KT[@]}" 2>&1 | tee -a "$LOG"
echo "kernel benchmark exit code: ${PIPESTATUS[0]}" | tee -a "$LOG"

step "one-GPU gather_bench (codec overhead per gathered byte)"
if [[ -n "$QUICK" ]]; then GB=(--experts 1 --churn 0 --reps 2); else
  GB=(--experts 4 16 --churn 0 0.001 0.01 --reps 5); fi
timeout 80 python benchmarks/gather_bench.py --devices 1 "${GB[@]}" \
  --out "$OUT/gather_bench.json" 2>&1 | tee -a "$LOG"
echo "gather benchmark exit code: ${PIPESTATUS[0]}" | tee -a "$LOG"

step "where the one-GPU gather's time goes: its kernels under JAX's profiler"
if [[ -n "$QUICK" ]]; then GP=(--devices 1 --events host --shape 4 2048 1024 --reps 2); else
  GP=(--reps 5); fi
timeout 60 python benchmarks/gather_profile.py "${GP[@]}" --out "$OUT/gather_profile.json" \
  2>&1 | tee -a "$LOG"
echo "gather profile exit code: ${PIPESTATUS[0]}" | tee -a "$LOG"

step "summary: Pallas kernels vs copy (targets on H200: decode >= 0.7, encode >= 0.5)"
timeout 15 python - "$OUT/kernel_throughput.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
rows = json.load(open(sys.argv[1]))["results"]["rows"]
for r in rows:
    if r["op"] != "copy" and (r["mb"] >= 16 or len(rows) < 40):
        print(f"{r['dtype']:>5} {r['mb']:>6g} MB {r['impl']:>14} {r['op']:>16} "
              f"{r['gbps']:8.1f} GB/s  {r['ratio']:5.2f} x copy")
PY

step "crossover at the measured codec fraction (cost model; the links are not measured here)"
timeout 20 python benchmarks/gpu_crossover.py --kernels "$OUT/kernel_throughput.json" \
  --out "$OUT/gpu_crossover.json" 2>&1 | tee -a "$LOG"
echo "crossover exit code: ${PIPESTATUS[0]}" | tee -a "$LOG"

step "the training step on one GPU, every mode against plain (gpu_train_check.sh)"
OUT="$OUT" bash benchmarks/gpu_train_check.sh 2>&1 | tail -12 | tee -a "$LOG"
TRAIN_RC=${PIPESTATUS[0]}

step "done: kernel tests exit code $TEST_RC, train check $TRAIN_RC; outputs in $OUT"
[[ $TEST_RC -ne 0 ]] && exit "$TEST_RC"
exit "$TRAIN_RC"

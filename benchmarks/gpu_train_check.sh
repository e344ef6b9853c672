#!/usr/bin/env bash
# One prepared check of the whole training step on one GPU (no network, JAX 0.11.x + CUDA):
# `ciera train --devices 1` twice plain and in four compressed modes, the same seed and data.
# With one device the gathers move no bytes, so this checks that every mode's step compiles and
# runs on a GPU (Pallas kernels, escapes, caches, fused attention inside the real step) and ends
# with params bitwise equal to plain's; the step times show the codec's cost, not a saving.
# - --compile-beside off: the compressed program runs from step 2 (compiled beside, a 30-step
#   run of `small` ended before it was taken: every step ran the stand-in, 2026-12-05).
# - XLA's deterministic ops: bitwise equal params need the same arithmetic in both programs
#   (scatter-add's atomics and autotuned GEMMs may differ between compiles); the second plain
#   run shows whether plain agrees with itself.
# Writes two files under $OUT (the device returns 8 at most; gpu_check.sh writes 6):
# train_check.log (every run's output) and train_check.json (the table, each run's metrics
# rows summarized). Exits non-zero when a run fails or a sha256 differs. About 2 minutes on an
# H100; the step timeouts sum to 6 minutes.
#
#   OUT=/tmp/out bash benchmarks/gpu_train_check.sh
#   CIERA_CHECK_PLATFORMS=cpu CIERA_CHECK_QUICK=1 bash benchmarks/gpu_train_check.sh  # dry run
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
LOG="$OUT/train_check.log"
: > "$LOG"
export JAX_PLATFORMS="${CIERA_CHECK_PLATFORMS:-cuda}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
[[ "$JAX_PLATFORMS" == cuda ]] && export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
if [[ -n "${CIERA_CHECK_QUICK:-}" ]]; then CONFIG=tiny STEPS=4; else CONFIG=small STEPS=30; fi

# run from the checkout (python -m from its root), installed or not
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

declare -A RUNS=(
  [plain]="--gather plain"
  [plain_again]="--gather plain"
  [defaults]="--gather ciera"
  [word_all]="--gather ciera --plan all --cache word"
  [exponent_all]="--gather ciera --plan all --cache exponent"
  [word_regather]="--gather ciera --plan all --cache word --word-backward regather"
)
TMP="$(mktemp -d)"
RC=0
NAMES=(plain plain_again defaults word_all exponent_all word_regather)
for name in "${NAMES[@]}"; do
  echo "=== $name: ciera train --config $CONFIG --devices 1 --steps $STEPS ${RUNS[$name]} ($(date +%T))" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout 50 python -m ciera_jax.cli.main train --config "$CONFIG" --devices 1 --steps "$STEPS" \
    ${RUNS[$name]} --compile-beside off ${CIERA_TRAIN_EXTRA:-} \
    --metrics-out "$TMP/$name.jsonl" >"$TMP/$name.log" 2>&1
  rc=$?
  cat "$TMP/$name.log" >>"$LOG"
  echo "exit code: $rc" | tee -a "$LOG"
  [[ $rc -ne 0 ]] && RC=1
done

timeout 20 python - "$OUT" "$TMP" "${NAMES[@]}" <<'PY' 2>&1 | tee -a "$LOG"
import json, pathlib, re, statistics, sys
out, tmp = map(pathlib.Path, sys.argv[1:3])
table, plain_sha = [], None
for name in sys.argv[3:]:  # the runs in order, plain first
    path, log = tmp / f"{name}.jsonl", tmp / f"{name}.log"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    steps = [r for r in rows if "step" in r]
    found = re.search(r"params_sha256=([0-9a-f]+)", log.read_text()) if log.exists() else None
    sha = found[1] if found else None
    plain_sha = sha if name == "plain" else plain_sha
    steady = [r["step_time_s"] for r in steps[len(steps) // 2:]]
    table.append({"run": name, "steps": len(steps), "params_sha256": sha,
                  "equal_to_plain": sha is not None and sha == plain_sha,
                  "first_step_s": steps[0]["step_time_s"] if steps else None,
                  "steady_step_s": statistics.median(steady) if steady else None,
                  "wire_over_plain": (sum(r["sent_bytes"] for r in steps)
                                      / max(1, sum(r["plain_bytes"] for r in steps)))})
print(f"{'run':>14} {'steps':>5} {'first s':>8} {'steady ms':>9} {'wire':>6}  params = plain")
for t in table:
    f = lambda v, fmt: format(v, fmt) if v is not None else "-"
    print(f"{t['run']:>14} {t['steps']:>5} {f(t['first_step_s'], '8.2f')} "
          f"{f(t['steady_step_s'] and 1e3 * t['steady_step_s'], '9.1f')} "
          f"{t['wire_over_plain']:6.3f}  {t['equal_to_plain']}")
(out / "train_check.json").write_text(json.dumps(table, indent=1))
sys.exit(0 if all(t["equal_to_plain"] for t in table) else 1)
PY
[[ ${PIPESTATUS[0]} -ne 0 ]] && RC=1
echo "=== done: exit code $RC ($(date +%T))" | tee -a "$LOG"
exit "$RC"

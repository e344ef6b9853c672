"""Exponent-stability study: how many bf16 exponents change per step, per tensor kind.

Trains ``tiny`` and/or ``small`` with a realistic schedule (linear warm-up, peak LR, cosine
decay) under FSDP with the CIERA gather, and records per step and per tensor kind (attention,
router, expert up/gate/down, embedding, head) the fraction of bf16 exponents that changed, the
fraction of whole bf16 words that changed, and the wire ratio CIERA achieved. Writes JSON, a
PNG (change rate vs step, log scale, one line per kind, LR on a second axis), and a measured
trace in the simulator's format (``--trace-out``), and reports how long the warm-up lasts and
the steady-state rates.

    python benchmarks/exponent_stability.py                      # ~10-20 min on 2 CPU cores
    python benchmarks/exponent_stability.py --configs small --steps 5000   # bigger machines
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

STEADY_FRACTION = 0.5  # steady state: the last half of the run
WARMUP_FACTOR = 2.0  # warm-up ends when the change rate stays within 2x of steady state


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=None,
                   help="steps per config (default: tiny 1000, small 300)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5%%)")
    p.add_argument("--trace-every", type=int, default=5, help="per-kind rates every N steps")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/exponent_stability.json")
    p.add_argument("--png", default="results/exponent_stability.png")
    p.add_argument("--trace-out", default="results/measured_trace.json",
                   help="steady-state rates per kind, in the simulator's trace format")
    return p.parse_args(argv)


DEFAULT_STEPS = {"tiny": 1000, "small": 300}


def run_config(name: str, args, workdir: Path) -> dict:
    from models import train as train_mod

    steps = args.steps or DEFAULT_STEPS.get(name, 1000)
    warmup = args.warmup if args.warmup is not None else max(10, steps // 20)
    # plan "all": every gathered tensor goes through CIERA, so every kind's changes are counted
    tc = train_mod.TrainConfig(config=name, gather="ciera", lr=args.lr, warmup_steps=warmup,
                               schedule_steps=steps, plan="all")
    metrics = workdir / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    t0 = time.perf_counter()
    result = train_mod.train(tc, steps=steps, seed=args.seed, metrics_out=str(metrics),
                             trace_every=args.trace_every, log_every=max(1, steps // 20))
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    schedule = train_mod.make_schedule(tc)
    return summarize(name, rows, [float(schedule(r["step"] - 1)) for r in rows], tc, wall,
                     result)


def summarize(name, rows, lrs, tc, wall, result) -> dict:
    steps = [r["step"] for r in rows]
    exp = [r["exp_changed_frac"] for r in rows]
    words = [r["word_changed_frac"] for r in rows]
    wire = [r["sent_bytes"] / max(r["plain_bytes"], 1) for r in rows]
    kind_rows = [r for r in rows if "exp_change_by_kind" in r]
    kinds = sorted({k for r in kind_rows for k in r["exp_change_by_kind"]})
    by_kind = {k: {"steps": [r["step"] for r in kind_rows if k in r["exp_change_by_kind"]],
                   "exp": [r["exp_change_by_kind"][k] for r in kind_rows
                           if k in r["exp_change_by_kind"]],
                   "word": [r["word_change_by_kind"].get(k, math.nan) for r in kind_rows
                            if k in r["exp_change_by_kind"]]} for k in kinds}
    tail = slice(int(len(rows) * (1 - STEADY_FRACTION)), None)
    steady_exp = _mean(exp[tail])
    steady_kind = {k: _mean(v["exp"][int(len(v["exp"]) * (1 - STEADY_FRACTION)):])
                   for k, v in by_kind.items()}
    return {
        "config": name, "steps": len(rows), "lr_peak": tc.lr, "warmup_steps": tc.warmup_steps,
        "wall_s": wall, "params_sha256": getattr(result, "params_sha256", None),
        "warmup_ends_at_step": _warmup_end(steps, exp, steady_exp),
        "steady_state": {"exp_changed_frac": steady_exp,
                         "word_changed_frac": _mean(words[tail]),
                         "wire_ratio": _mean(wire[tail]),
                         "exp_change_by_kind": steady_kind},
        "first_steps": {"exp_changed_frac": exp[1:11], "wire_ratio": wire[:11]},
        "series": {"step": steps, "lr": lrs, "exp_changed_frac": exp,
                   "word_changed_frac": words, "wire_ratio": wire, "by_kind": by_kind},
    }


def _mean(xs) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else math.nan


def _warmup_end(steps, rates, steady) -> int | None:
    """First step after which the change rate (step 1, the priming gather, excluded) stays
    within ``WARMUP_FACTOR`` of the steady state."""
    limit = WARMUP_FACTOR * steady
    end = None
    for s, r in zip(reversed(steps[1:]), reversed(rates[1:])):
        if r > limit:
            break
        end = s
    return end


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        s = res["series"]
        for kind, v in sorted(s["by_kind"].items()):
            ax.plot(v["steps"], [max(x, 1e-7) for x in v["exp"]], label=kind, lw=1)
        ax.plot(s["step"][1:], [max(x, 1e-7) for x in s["word_changed_frac"][1:]], "k:",
                lw=1, label="whole bf16 words (all)")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("fraction of bf16 exponents changed per step")
        ax.set_title(f"{res['config']}: steady exp change {res['steady_state']['exp_changed_frac']:.2e}"
                     f", wire {res['steady_state']['wire_ratio']:.3f}")
        if res["warmup_ends_at_step"]:
            ax.axvline(res["warmup_ends_at_step"], color="grey", ls="--", lw=0.8)
        lr_ax = ax.twinx()
        lr_ax.plot(s["step"], s["lr"], color="grey", alpha=0.5, lw=1.5)
        lr_ax.set_ylabel("learning rate", color="grey")
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write_trace(results: list[dict], path: Path) -> None:
    """Steady-state rates per kind of the largest config run, for ``ciera simulate --trace``."""
    res = results[-1]
    rates = {k: v for k, v in res["steady_state"]["exp_change_by_kind"].items() if v == v}
    trace = {"format": "ciera-exp-trace/1", "placeholder": False,
             "note": f"measured by benchmarks/exponent_stability.py: {res['config']}, "
                     f"{res['steps']} steps, peak lr {res['lr_peak']}, mean of the last "
                     f"{int(STEADY_FRACTION * 100)}% of steps",
             "change_rate_by_kind": rates, "default": max(rates.values(), default=1e-3)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    from ciera_jax.devices import setup_devices

    setup_devices(args.devices)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = [run_config(name, args, out.parent) for name in args.configs]
    print(f"\n{'config':>7} {'steps':>6} {'warm-up ends':>12} {'steady exp chg':>14} "
          f"{'steady word chg':>15} {'steady wire':>11}  per kind (steady exp chg)")
    for r in results:
        st = r["steady_state"]
        kinds = ", ".join(f"{k} {v:.1e}" for k, v in st["exp_change_by_kind"].items())
        print(f"{r['config']:>7} {r['steps']:>6} {str(r['warmup_ends_at_step']):>12} "
              f"{st['exp_changed_frac']:>14.2e} {st['word_changed_frac']:>15.3f} "
              f"{st['wire_ratio']:>11.3f}  {kinds}")
    out.write_text(json.dumps({"results": results}, indent=1) + "\n")
    plot(results, Path(args.png))
    write_trace(results, Path(args.trace_out))
    print(f"wrote {out}, {args.png}, {args.trace_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

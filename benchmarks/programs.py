"""What fixed rungs cost a run: programs compiled, first step, steady step and wire, side by side.

Runs ``ciera train`` (a fresh process each, so nothing compiled is shared) for ``--gather
plain``, the defaults and ``--cache exponent`` (``--runs``; ``defaults+slow`` and
``exponent+slow`` add ``--program-patience 2e-5``, a compile priced like about one plain step
of tiny's bytes; ``no-exits`` adds ``--overflow-rungs 0``: every overflow a plain gather;
``beside`` and ``exponent+beside`` add ``--compile-beside on``: the first steps run the
priming program while the policy's compiles in a thread), one after another per round, and
reads each run's JSONL: the first step (compile + priming; in wall seconds and in the
process's CPU seconds, every thread: the steadier figure on a shared machine), alone and from
the run's start (the header's start-up: data, trainer, state, and the encode program's
compile, which starts beside the state's making: what a user waits for), every program the
run compiled (count, seconds, recompiles; a program compiled beside the steps counts its own
seconds, waited for by none), the steps that ran a stand-in, the median step after
``--settle`` steps (the steady step: steps that neither compiled nor ran beside a compile),
the median of those without an overflow (the codec's own cost, without the exits' and the
fallbacks'), the wire over the run and its last quarter (padding up to the programs' rungs
and overflows counted), and the params hash (all equal).

    python benchmarks/programs.py [--config tiny] [--steps 200] [--plan P] [--rounds 1]
                                  [--runs ...] [--out PATH]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from common import parser, write_results  # benchmarks/common.py, beside this script

# "+slow": a compile priced like about one plain step of tiny's bytes (as on a slow link, or a
# cheap compile): how many programs the demand's drift buys, and what they save
SLOW = ["--program-patience", "2e-5"]
RUNS = {"plain": ["--gather", "plain"], "defaults": [], "exponent": ["--cache", "exponent"],
        "defaults+slow": SLOW, "exponent+slow": ["--cache", "exponent", *SLOW],
        "no-exits": ["--overflow-rungs", "0"], "beside": ["--compile-beside", "on"],
        "exponent+beside": ["--cache", "exponent", "--compile-beside", "on"]}


def parse_args(argv=None):
    p = parser(__doc__, "programs")
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--plan", help="which tensors compress (ciera train --plan; default: its)")
    p.add_argument("--settle", type=int, default=20,
                   help="steps left out of the steady step's median (warm-up)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--runs", nargs="+", default=list(RUNS)[:3], choices=list(RUNS))
    return p.parse_args(argv)


def one_run(name: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "ciera_jax.cli.main", "train", "--config", args.config,
           "--steps", str(args.steps), "--log-every", "0", "--metrics-out", out, *RUNS[name],
           *(["--plan", args.plan] if args.plan else [])]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.stderr.write(res.stderr[-3000:])
        raise SystemExit(f"programs: the {name} run failed")
    lines = [json.loads(line) for line in open(out)]
    header, rows = lines[0]["header"], lines[1:]
    sha = next(line.split("=", 1)[1] for line in res.stdout.splitlines()
               if line.startswith("params_sha256="))
    compiles = [c for r in rows for c in (r["compile_s"], r.get("beside_compile_s", 0.0)) if c]
    stand_ins = [r["step"] for r in rows if r.get("stand_in")]
    settled = [r for r in rows[args.settle:]
               if not r["compile_s"] and r["step"] > max(stand_ins, default=0)]
    steady = [r["step_time_s"] for r in settled]
    # the steady steps whose demand fit their program's rungs (no overflow: no exit, no
    # fallback), apart from the rest: what the codec costs, and what overflows add to it
    clean = [r["step_time_s"] for r in settled if not r["overflows"]]
    q = rows[len(rows) - len(rows) // 4:]
    return dict(
        run=name, sha256=sha, first_step_s=rows[0]["step_time_s"],
        first_step_cpu_s=rows[0]["step_cpu_s"],
        # from the run's start: the encode program's compile starts before the first step
        to_first_step_s=header["startup_s"] + rows[0]["step_time_s"],
        to_first_step_cpu_s=header["startup_cpu_s"] + rows[0]["step_cpu_s"],
        programs=len(compiles),
        compile_s=sum(compiles), compiles=compiles, steady_step_s=statistics.median(steady),
        clean_step_s=statistics.median(clean) if clean else float("nan"),
        clean_steps=len(clean), overflow_steps=len(steady) - len(clean),
        wire=sum(r["sent_bytes"] for r in rows) / sum(r["plain_bytes"] for r in rows),
        wire_last_quarter=sum(r["sent_bytes"] for r in q) / sum(r["plain_bytes"] for r in q),
        overflows=sum(r["overflows"] for r in rows),
        program_steps=[r["step"] for r in rows if r["compile_s"] or r.get("beside_compile_s")],
        stand_in_steps=len(stand_ins))


def by_round(runs: list[dict], plains: list[dict], key: str) -> list[float]:
    """``key`` of each round's run over the same round's plain run."""
    return [r[key] / p[key] for r, p in zip(runs, plains)]


def ratios_line(ratios: list[float]) -> str:
    """``1.08, 1.03, 1.10 (1.08)``: each round's, then their median; ``-`` for a round with
    no such step (a run whose every steady step overflowed has no clean one)."""
    if all(math.isnan(x) for x in ratios):
        return "-"
    return (", ".join("-" if math.isnan(x) else f"{x:.2f}" for x in ratios)
            + f" ({statistics.median(x for x in ratios if not math.isnan(x)):.2f})")


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {n: [] for n in args.runs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in args.runs:
                results[name].append(one_run(name, args, tmp))
                x = results[name][-1]
                print(f"repeat {r + 1}: {name:<14} first step {x['first_step_s']:6.1f} s "
                      f"({x['first_step_cpu_s']:.1f} CPU s; from the start "
                      f"{x['to_first_step_s']:.1f} s, {x['to_first_step_cpu_s']:.1f} CPU s), "
                      f"{x['programs']} programs {x['compile_s']:6.1f} s ("
                      f"{x['stand_in_steps']} steps ran a stand-in), steady "
                      f"{x['steady_step_s']:.3f} s ({x['clean_steps']} steps without an "
                      f"overflow: {x['clean_step_s']:.3f} s), wire {x['wire']:.3f} / last "
                      f"quarter {x['wire_last_quarter']:.3f}", flush=True)
    keys = ("first_step_s", "first_step_cpu_s", "to_first_step_s", "to_first_step_cpu_s",
            "compile_s", "steady_step_s")
    med = {n: {k: statistics.median(x[k] for x in rs) for k in keys}
           for n, rs in results.items()}
    base = med.get("plain")
    print(f"\n{args.config}, {args.steps} steps, median of {args.rounds} round(s), load average "
          f"{os.getloadavg()[0]:.1f}; x plain: the plain run's (compile: its one program)")
    print(f"{'run':<15}{'first s':>9}{'x':>6}{'CPU s':>7}{'x':>6}{'from start':>11}{'x':>6}"
          f"{'CPU s':>7}{'x':>6}{'programs':>9}"
          f"{'compile s':>10}{'x':>6}{'steady s':>9}{'x':>6}{'wire':>7}{'last 1/4':>9}"
          f"{'overflows':>10}{'stand-ins':>10}  compiled (or taken) at steps")
    rows = []
    for name, rs in results.items():
        m, last = med[name], rs[-1]
        ratio = {k: m[k] / base[k] if base else float("nan") for k in m}
        rows.append(dict(run=name, **m, **{f"{k}_vs_plain": v for k, v in ratio.items()},
                         rounds=rs))
        print(f"{name:<15}{m['first_step_s']:>9.1f}{ratio['first_step_s']:>6.2f}"
              f"{m['first_step_cpu_s']:>7.1f}{ratio['first_step_cpu_s']:>6.2f}"
              f"{m['to_first_step_s']:>11.1f}{ratio['to_first_step_s']:>6.2f}"
              f"{m['to_first_step_cpu_s']:>7.1f}{ratio['to_first_step_cpu_s']:>6.2f}"
              f"{last['programs']:>9}{m['compile_s']:>10.1f}{ratio['compile_s']:>6.2f}"
              f"{m['steady_step_s']:>9.3f}{ratio['steady_step_s']:>6.2f}{last['wire']:>7.3f}"
              f"{last['wire_last_quarter']:>9.3f}{last['overflows']:>10}"
              f"{last['stand_in_steps']:>10}  "
              f"{last['program_steps']}")
    if base and args.rounds > 1:  # each round's ratio against its own plain run: a load that
        print("x plain round by round (each against its round's plain run), median:")  # drifts
        for row in rows:  # between rounds moves these less than it moves the medians' ratio
            if row["run"] == "plain":
                continue
            row["by_round_vs_plain"] = {k: by_round(results[row["run"]], results["plain"], k)
                                        for k in ("first_step_s", "steady_step_s",
                                                  "clean_step_s")}
            print(f"  {row['run']:<15}" + "; ".join(
                f"{k.removesuffix('_s').replace('_', ' ')} " + ratios_line(v)
                for k, v in row["by_round_vs_plain"].items()))
    hashes = {x["sha256"] for rs in results.values() for x in rs}
    print(f"params_sha256: {'all equal' if len(hashes) == 1 else 'DIFFER'} "
          f"({sorted(hashes)[0][:16]}...)")
    write_results(args.out, {"config": args.config, "plan": args.plan, "steps": args.steps,
                             "rows": rows, "load_average": os.getloadavg()})
    return 0 if len(hashes) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())

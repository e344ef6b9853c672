"""Compile time of the train step, plain vs CIERA's two cache modes, and the compiled program.

For each mode it builds the ``ciera train`` trainer (``ciera_models.train``; default ``tiny`` with
``--plan all``: every gathered tensor compressed), then times, in a fresh process per mode (so
no mode reuses another's compiled pieces) and in interleaved rounds (plain, exponent, word,
plain, ...: every mode sees the same machine load):

* ``lower+compile``: ``jax.jit(step).lower(...).compile()`` of the steady program alone (every
  compressed gather's rung fixed at the steady-state demand: ``Trainer.at_rungs``), in wall
  seconds and in the process's CPU seconds (every compile thread; the steadier figure on a
  loaded machine);
* ``first step``: building the trainer, making the state and compiling and running the first
  step (the steady program, whose fallback primes the fresh caches) as ``ciera train`` does
  (the encode program compiles from the start, beside the state's making): what a user waits
  for before the first progress line, data loading aside.

It prints both with their ratio to plain (median over rounds), the optimized HLO's size, its
fusions (XLA:CPU's kernels, which its code generation follows; exact, where the seconds drift
with the machine) against plain's, and how many all-gathers sit inside conditional branches
against all of them (CIERA's main transfers must not: only escape prefixes and the plain
fallback may). Then, per compressed mode, the ``--sources`` library functions its compiled
step has the most fusions from beyond plain's (``ciera_jax.runtime.hlo.fusion_sources``: a
fusion counts at the innermost frame of its stack inside ``ciera_jax``): where the step's
size goes. With ``--ir-sources N``, each mode compiles its step once more with XLA's dump on and
reports the optimized LLVM IR of its kernels (``hlo.cpu_kernel_ir``), which is what XLA:CPU's
compile time follows (LLVM unrolls a small kernel's fixed-size loops, so fusions are a poor
proxy), and per compressed mode the N functions with the most IR beyond plain's, at the
innermost frame, and at every frame of the stack in the codec's layers (``hlo.ir_sources``: a
codec function with its callees).

    python benchmarks/compile_time.py [--config tiny] [--plan all] [--rounds 2] [--sources 8]
                                      [--ir-sources N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ciera_jax.runtime import hlo
from common import parser, write_results  # benchmarks/common.py, beside this script

MODES = ("plain", "exponent", "word")
CODEC_LAYERS = ("collective/", "codec/", "kernels/")  # where a mode's own IR is made


def parse_args(argv=None):
    p = parser(__doc__, "compile_time")
    p.add_argument("--config", default="tiny", help="model config")
    p.add_argument("--plan", default="all", help="which tensors compress (ciera train --plan)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per mode")
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    p.add_argument("--sources", type=int, default=8,
                   help="per compressed mode, the functions with the most extra fusions")
    p.add_argument("--ir-sources", type=int, default=0, metavar="N",
                   help="per compressed mode, the functions with the most extra LLVM IR (one "
                        "more compile per mode, dumped)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # one mode, in-process
    return p.parse_args(argv)


def branch_gathers(text: str) -> tuple[int, int]:
    """(all-gathers inside conditional branches, all all-gathers) of an optimized HLO text."""
    comps = hlo.computations(text)
    inside = hlo.inside_branches(comps)
    return (sum(len(hlo.all_gathers(t)) for c, t in comps.items() if c in inside),
            sum(len(hlo.all_gathers(t)) for t in comps.values()))


def kernel_ir(lowered) -> dict:
    """The step's kernels' optimized LLVM IR, from one more compile with XLA's dump on: in all,
    and by library function (innermost frame; every frame: ``ir_inclusive``)."""
    with tempfile.TemporaryDirectory() as d:
        # the dump option also makes JAX compile again rather than hand back the timed program
        lowered.compile(compiler_options={"xla_dump_to": d})
        text, kernels = hlo.cpu_kernel_ir(d)
    return dict(ir_bytes=sum(kernels.values()), ir_kernels=len(kernels),
                ir_sources=dict(hlo.ir_sources(text, kernels)),
                ir_inclusive=dict(hlo.ir_sources(text, kernels, inclusive=True)))


def worker(args) -> dict:
    """One mode, in this process: time lower+compile, then the first step on a new trainer."""
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(args.devices)
    import jax

    from ciera_jax.runtime.devices import make_mesh
    from ciera_models.train.data import load_dataset
    from ciera_models.train import TrainConfig, build_trainer

    gather, cache = ("plain", "exponent") if args.worker == "plain" else ("ciera", args.worker)
    tc = TrainConfig(config=args.config, gather=gather, cache=cache, plan=args.plan,
                     schedule_steps=4)
    mesh = make_mesh(args.devices)
    t0 = time.perf_counter()
    tr = build_trainer(tc, mesh)
    state = tr.prepare(tr.init_state(0))
    batch = tr.batch(load_dataset(None, tr.tc.model.vocab_size, tr.tc.length), 0, 0)
    build_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    # the steady program: every compressed gather's rung fixed at the steady-state demand
    lowered = jax.jit(tr.step_fn).lower(*tr.at_rungs(
        (state.params, state.caches, state.opt_state, state.ahead, batch), "steady"))
    compiled = lowered.compile()
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    text = compiled.as_text()
    inside, total = branch_gathers(text)
    fusions = hlo.fusion_sources(text)
    ir = kernel_ir(lowered) if args.ir_sources else None
    jax.clear_caches()
    build_trainer.cache_clear()  # a new trainer: nothing traced or compiled above is reused
    t0 = time.perf_counter()
    tr = build_trainer(tc, mesh)
    tr.start_encode_compile()  # as `ciera train` starts it: beside the state's making
    state = tr.init_state(0)
    state, _ = tr.step(state, batch)  # what `ciera train` runs first: compile + priming
    jax.block_until_ready(state.params)
    first_s = time.perf_counter() - t0
    return dict(mode=args.worker, build_s=build_s, compile_s=compile_s,
                compile_cpu_s=compile_cpu_s, first_step_s=first_s,
                hlo_bytes=len(text), gathers_in_branches=inside, gathers=total,
                fusions=sum(fusions.values()), fusion_sources=dict(fusions),
                **(ir or {}))


def print_ir(rows: list[dict], top: int) -> None:
    """Each mode's kernels' LLVM IR against plain's, and where a compressed mode's extra IR
    comes from."""
    plain = rows[0]
    print("\noptimized LLVM IR of the step's kernels (the last round's): " + ", ".join(
        f"{r['mode']} {r['ir_bytes'] / 1e6:.2f} MB in {r['ir_kernels']} "
        f"({r['ir_bytes'] / plain['ir_bytes']:.2f}x)" for r in rows))
    for row in rows[1:]:
        for key, how in (("ir_sources", "innermost frame"),
                         ("ir_inclusive", "every frame, the codec's layers")):
            extra = {k: n - plain[key].get(k, 0) for k, n in row[key].items()
                     if key == "ir_sources" or k.startswith(CODEC_LAYERS)}
            print(f"{row['mode']}: the most IR beyond plain's, KB ({how})")
            for k, n in sorted(extra.items(), key=lambda kv: -kv[1])[:top]:
                print(f"{n / 1e3:>9.1f}  {k}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    runs = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--worker", mode, "--config", args.config,
                   "--plan", args.plan, "--devices", str(args.devices), "--out", "",
                   "--ir-sources", str(args.ir_sources)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            if out.returncode:
                sys.stderr.write(out.stderr[-3000:])
                raise SystemExit(f"compile_time: the {mode} worker failed")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            x = runs[mode][-1]
            print(f"repeat {r + 1}: {mode:<9} compile {x['compile_s']:6.1f} s "
                  f"({x['compile_cpu_s']:.1f} CPU s), first step {x['first_step_s']:6.1f} s",
                  flush=True)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in
               ("compile_s", "compile_cpu_s", "first_step_s")} for m in MODES}
    print(f"\n{args.config}, --plan {args.plan}, {args.devices} emulated devices, median of "
          f"{args.rounds} interleaved rounds (load average {os.getloadavg()[0]:.1f})")
    print(f"{'mode':<10}{'compile s':>10}{'x plain':>9}{'CPU s':>8}{'x plain':>9}"
          f"{'first step s':>14}{'x plain':>9}{'HLO MB':>8}{'fusions':>9}{'x plain':>9}"
          f"{'gathers in branches':>21}")
    rows = []
    for m in MODES:
        last = runs[m][-1]
        row = dict(mode=m, **med[m], compile_vs_plain=med[m]["compile_s"] / med["plain"]["compile_s"],
                   compile_cpu_vs_plain=med[m]["compile_cpu_s"] / med["plain"]["compile_cpu_s"],
                   first_step_vs_plain=med[m]["first_step_s"] / med["plain"]["first_step_s"],
                   hlo_bytes=last["hlo_bytes"], gathers_in_branches=last["gathers_in_branches"],
                   gathers=last["gathers"], fusions=last["fusions"],
                   fusions_vs_plain=last["fusions"] / runs["plain"][-1]["fusions"],
                   fusion_sources=last["fusion_sources"], rounds=runs[m],
                   **{k: last[k] for k in ("ir_bytes", "ir_kernels", "ir_sources",
                                           "ir_inclusive") if k in last})
        rows.append(row)
        print(f"{m:<10}{row['compile_s']:>10.1f}{row['compile_vs_plain']:>9.2f}"
              f"{row['compile_cpu_s']:>8.1f}{row['compile_cpu_vs_plain']:>9.2f}"
              f"{row['first_step_s']:>14.1f}{row['first_step_vs_plain']:>9.2f}"
              f"{row['hlo_bytes'] / 1e6:>8.2f}{row['fusions']:>9}{row['fusions_vs_plain']:>9.2f}"
              f"{row['gathers_in_branches']:>12} of {row['gathers']}")
    plain = rows[0]["fusion_sources"]
    for row in rows[1:]:
        extra = {k: n - plain.get(k, 0) for k, n in row["fusion_sources"].items()}
        top = sorted(extra.items(), key=lambda kv: -kv[1])[:args.sources]
        print(f"\n{row['mode']}: {row['fusions']} fusions against plain's {rows[0]['fusions']}; "
              f"the most extra from")
        for k, n in top:
            print(f"{n:>6}  {k}")
    if args.ir_sources:
        print_ir(rows, args.ir_sources)
    write_results(args.out, dict(config=args.config, plan=args.plan, devices=args.devices,
                                 rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

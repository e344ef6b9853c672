"""What the rung policy's programs send on a recorded run: padding and fallbacks counted.

Replays :class:`ciera_jax.loop.rungs.RungPolicy` on the per-step, per-tensor-layer
escape counts ``weight_stability.py --counts-out`` recorded (default: ``small``, 300 steps):
word mode at the default code width, one program per rung vector, each tensor (its layers
stacked) at one rung per program, as ``ciera train`` compiles them. Prints, per price (the
link of a cost-model profile, a compile's seconds, ``--program-patience``, ``--max-programs``),
the programs bought and when, and the wire as a share of plain's over the whole run, its second
half (the steady state) and its last quarter, beside the ideal (every tensor-layer at its own
rung every step, no compile counted). Approximations: each tensor is its own unit (the trainer
joins a layer's small tensors into a bucket), and the 4-byte agreement is left out, as
``weight_stability.py`` does.

    python benchmarks/policy_replay.py [--counts PATH] [--compile-s 30] [--out PATH]
"""

from __future__ import annotations

import re

import numpy as np

from ciera_jax.codec.wire import WordWire
from ciera_jax.planning import links
from ciera_jax.loop.rungs import (EXIT_SHARE, RungPolicy, exits_for,
                                  seconds_per_byte)
from common import RESULTS, parser, write_results  # benchmarks/common.py, beside this script

# (label, profile, patience, max_programs, overflow rungs, the tensors that compile them): the
# defaults on CPU and GPU links, then without overflow rungs and cheaper compiles (a compile
# priced like a few plain steps of small's bytes), then fewer overflow rungs. Which tensors
# compile them: EXIT_SHARE, the trainer's rule (``rungs.exits_for``) on the tensors as
# this replay takes them, each alone (the 3 expert tensors); LAYERS, every layer tensor: the
# unit the trainer makes of them where a layer is one bucket (small and tiny on 8 devices),
# which then carries over 90% of the word bytes and compiles them.
LAYERS = "layers"
PRICES = [("defaults, cpu-emulated link", "cpu-emulated", 1.0, 8, 3, EXIT_SHARE),
          ("defaults, h100-nvlink link", "h100-nvlink", 1.0, 8, 3, EXIT_SHARE),
          ("defaults, a layer one bucket", "cpu-emulated", 1.0, 8, 3, LAYERS),
          ("--overflow-rungs 0", "cpu-emulated", 1.0, 8, 0, EXIT_SHARE),
          ("--overflow-rungs 0, patience 5e-4", "cpu-emulated", 5e-4, 8, 0, EXIT_SHARE),
          ("--overflow-rungs 0, patience 1e-4", "cpu-emulated", 1e-4, 8, 0, EXIT_SHARE),
          ("... 1e-4, 32 programs", "cpu-emulated", 1e-4, 32, 0, EXIT_SHARE),
          ("... 2e-5, 32 programs", "cpu-emulated", 2e-5, 32, 0, EXIT_SHARE),
          ("--overflow-rungs 1", "cpu-emulated", 1.0, 8, 1, EXIT_SHARE),
          ("--overflow-rungs 2", "cpu-emulated", 1.0, 8, 2, EXIT_SHARE),
          ("--overflow-rungs 1, a layer one bucket", "cpu-emulated", 1.0, 8, 1, LAYERS),
          ("--overflow-rungs 2, a layer one bucket", "cpu-emulated", 1.0, 8, 2, LAYERS),
          ("--overflow-rungs 3, every tensor", "cpu-emulated", 1.0, 8, 3, 0.0)]


def row_exits(wires: dict, layers: dict, exits: int, units) -> dict:
    """``{tensor: overflow rungs}`` for a row of :data:`PRICES`."""
    if units == LAYERS:
        return {k: exits if k.startswith("layers/") else 0 for k in wires}
    return exits_for(wires, layers, exits, units)


def parse_args(argv=None):
    p = parser(__doc__, "policy_replay")
    p.add_argument("--counts", default=str(RESULTS / "weight_stability_counts.npz"),
                   help="weight_stability.py --counts-out file")
    p.add_argument("--compile-s", type=float, default=30.0, help="seconds per compile")
    return p.parse_args(argv)


def demands(path: str) -> tuple[dict, list]:
    """``(wires, needs)``: each tensor's WordWire (one layer) and, per recorded step, the rung
    each of its layers needs (``wire.rungs``: above the top; an array of one per layer)."""
    z = np.load(path)
    cols = list(z["cols"])
    counts = z["counts"]
    tensor = [re.sub(r"/\d+/", "/", str(k)) for k in z["layer_keys"]]
    rows = {t: [i for i, x in enumerate(tensor) if x == t] for t in sorted(set(tensor))}
    wires = {t: WordWire(int(counts[0, rows[t][0], cols.index("n_local")]), 2) for t in rows}

    def needed(step):
        out = {}
        for t, wire in wires.items():
            got = [wire.rung(int(counts[step, i, cols.index("esc3")]),
                             int(counts[step, i, cols.index("raw")])) for i in rows[t]]
            out[t] = np.array([wire.rungs if g is None else g for g in got])
        return out

    return wires, [needed(s) for s in range(counts.shape[0])]


def replay(wires: dict, needs: list, seconds_per_byte_: float, compile_s: float,
           **policy) -> dict:
    """The policy's choices over ``needs``; wire shares of plain for the run, its second half
    and its last quarter, sent and ideal."""
    p = RungPolicy(wires, seconds_per_byte_, **policy)  # exits: exits_for's, per tensor
    sent, plain, ideal, bought = [], [], [], []
    for i, need in enumerate(needs):
        rungs, new = p.choose(need, steps_left=len(needs) - i)
        if new:
            p.compiled(compile_s)
            bought.append(i + 1)
        sent.append(p.cost(rungs, need))
        plain.append(p.plain_cost(need))
        ideal.append(p.cost(p.best_for([need]), need))
    sent, plain, ideal = (np.array(a, np.float64) for a in (sent, plain, ideal))
    parts = {"run": slice(None), "steady": slice(len(sent) // 2, None),
             "late": slice(len(sent) - len(sent) // 4, None)}
    return {"programs": len(bought), "bought_at": bought,
            **{k: float(sent[s].sum() / plain[s].sum()) for k, s in parts.items()},
            **{f"ideal_{k}": float(ideal[s].sum() / plain[s].sum()) for k, s in parts.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    wires, needs = demands(args.counts)
    print(f"{args.counts}: {len(needs)} steps, {len(wires)} tensors; "
          f"a compile {args.compile_s:g} s")
    print(f"{'price':<40}{'programs':>9}{'run':>7}{'steady':>8}{'late':>7}  bought at steps")
    rows = []
    layers = {k: len(v) for k, v in needs[0].items()}
    for label, profile, patience, max_programs, exits, units in PRICES:
        spb = seconds_per_byte(links.get_link(profile), 8)
        per_tensor = row_exits(wires, layers, exits, units)
        r = replay(wires, needs, spb, args.compile_s, patience=patience,
                   max_programs=max_programs, exits=per_tensor)
        rows.append({"price": label, "profile": profile, "patience": patience,
                     "max_programs": max_programs, "overflow_rungs": exits,
                     "exits_on": units,
                     "tensors_with_exits": sorted(k for k, e in per_tensor.items() if e), **r})
        print(f"{label:<40}{r['programs']:>9}{r['run']:>7.3f}{r['steady']:>8.3f}{r['late']:>7.3f}"
              f"  {r['bought_at'][:10]}")
    r = rows[0]
    print(f"{'ideal (a rung per layer-step)':<40}{'-':>9}{r['ideal_run']:>7.3f}"
          f"{r['ideal_steady']:>8.3f}{r['ideal_late']:>7.3f}")
    write_results(args.out, {"counts": args.counts, "compile_s": args.compile_s, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

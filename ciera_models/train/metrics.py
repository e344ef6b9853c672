"""What ``ciera train`` tells a person and writes for a program: the per-step record (JSONL),
the progress line, the start-up memory line, and the per-phase summary table.

The JSONL keeps every internal count under stable keys (benchmarks and tests read them); what
is printed speaks of loss, throughput, bytes on the wire and, for a compressed run, what went
plainly and why. ``--verbose`` adds the internals: each step's escape rungs and exponent
changes, their legend, the compiled programs and their padding.

A priming step (the first step, and the first after a restore) gathers every compressed
tensor plainly to fill fresh caches: its exponent "changes" are the whole tensor, so the
summary's exponent-change means leave priming steps out.
"""

from __future__ import annotations

import numpy as np

from ciera_jax.runtime.units import fmt_bytes


# --verbose: what the progress line's internals mean
RUNG_LEGEND = ("rungs R:n = n tensor-layers whose gather took escape rung R: -1 not "
               "compressed (plain by the plan); 0 nothing escaped, higher rungs more escapes; "
               "the top rung is the fallback (a plain gather that re-primes the cache); wire = "
               "bytes sent / plain bf16 bytes")


def step_record(step: int, m: dict, dt: float, cpu_s: float, kinds: dict, with_tensors: bool,
                priming: bool = False, retried: bool = False) -> dict:
    """One JSONL row from the step's host metrics ``m``. ``dt``: the step's wall seconds;
    ``cpu_s``: the process's CPU seconds over it (every thread: compiles, XLA:CPU's devices),
    steadier than ``dt`` on a shared machine. ``verify_failed``: shards whose self-check
    failed (summed over ranks; the step was not applied and runs again); ``retried``: this row
    is such a redo."""
    g = m["gather"]
    sent = sum(float(s["sent_bytes"]) for s in g.values())
    plain = sum(float(s["plain_bytes"]) for s in g.values())
    changed = sum(float(s["changed"]) for s in g.values())
    words = sum(float(s["words_changed"]) for s in g.values())
    elems = sum(float(s["elements"]) for s in g.values())
    rungs: dict[str, int] = {}
    for s in g.values():
        rungs[str(int(s["rung"]))] = rungs.get(str(int(s["rung"])), 0) + 1
    rec = {"step": step, "loss": float(m["loss"]), "ce": float(m["ce"]),
           "lb_loss": float(m["lb_loss"]), "z_loss": float(m["z_loss"]),
           "grad_norm": float(m["grad_norm"]), "sent_bytes": int(sent), "plain_bytes": int(plain),
           "exp_changed_frac": changed / max(elems, 1.0),
           "word_changed_frac": words / max(elems, 1.0),
           "fallbacks": int(sum(int(s["fallback"]) for s in g.values())),
           "rungs": rungs, "step_time_s": dt, "step_cpu_s": cpu_s, "priming": priming,
           "verify_failed": int(m["verify_failed"]), "retried": retried,
           # the step's program: its index, the seconds compiling it took if this step did,
           # and the tensor-layers whose demand was above its fixed rung (of those, the ones
           # still sent as words at an overflow rung: the rest went plainly)
           "program": int(m.get("program", 0)), "compile_s": float(m.get("compile_s", 0.0)),
           # the step program's compile alone, and the encode program's (once a run, in a
           # thread beside the first step program's: compile_s holds only what it added)
           "step_compile_s": float(m.get("step_compile_s", m.get("compile_s", 0.0))),
           "encode_compile_s": float(m.get("encode_compile_s", 0.0)),
           # --compile-beside: a program taken at this step, compiled in a thread beside the
           # steps before (its seconds; no step waited for them), and whether this step ran a
           # compiled stand-in while the policy's program compiled
           "beside_compile_s": float(m.get("beside_compile_s", 0.0)),
           "stand_in": bool(m.get("stand_in", 0)),
           "overflows": int(m.get("overflows", 0)),
           "overflow_words": int(m.get("overflow_words", 0)),
           # what the program's fixed rungs sent beyond this step's ideal ones (one rank)
           "padding_bytes": int(m.get("padding_bytes", 0))}
    if with_tensors:
        rec["exp_change_by_tensor"] = {k: float(s["changed"]) / float(s["elements"])
                                       for k, s in sorted(g.items())}
        by_kind: dict[str, list[float]] = {}
        for k, s in g.items():
            acc = by_kind.setdefault(kinds.get(k, "other"), [0.0, 0.0, 0.0])
            acc[0] += float(s["changed"])
            acc[1] += float(s["words_changed"])
            acc[2] += float(s["elements"])
        rec["exp_change_by_kind"] = {k: c / max(e, 1.0)
                                     for k, (c, _, e) in sorted(by_kind.items())}
        rec["word_change_by_kind"] = {k: w / max(e, 1.0)
                                      for k, (_, w, e) in sorted(by_kind.items())}
    return rec


def progress_line(rec: dict, steps: int, tokens: int, gather: str = "ciera",
                  verbose: bool = False) -> str:
    """One step: loss and throughput; the bytes on the wire unless the run gathers plainly;
    with ``verbose`` the exponent changes and escape rungs as well."""
    width = 20
    done = int(width * rec["step"] / max(steps, 1))
    bar = "#" * done + "." * (width - done)
    line = (f"[{bar}] step {rec['step']:>4}/{steps} loss {rec['loss']:.4f} | "
            f"{tokens / max(rec['step_time_s'], 1e-9):,.0f} tok/s")
    if gather != "plain":
        ratio = rec["sent_bytes"] / max(rec["plain_bytes"], 1)
        line += (f" | wire {ratio:.3f}x plain ({fmt_bytes(rec['sent_bytes'])}/"
                 f"{fmt_bytes(rec['plain_bytes'])})")
    if verbose:
        rungs = ",".join(f"{k}:{v}" for k, v in sorted(rec["rungs"].items(),
                                                       key=lambda kv: int(kv[0])))
        changed = ("priming" if rec.get("priming")
                   else f"{100 * rec['exp_changed_frac']:.3f}%")
        line += (f" | exp changed {changed} | rungs {rungs} ({rec['fallbacks']} sent "
                 "plainly)")
    return line


def memory_line(memory: dict, gather: str = "ciera") -> str:
    """``memory``: bytes per device by part (params, optimizer, caches); a run that keeps no
    caches (``gather`` other than ciera) names none."""
    if gather != "ciera":
        memory = {k: v for k, v in memory.items() if not k.startswith("caches")}
    tail = (" (caches: replicated on every rank; derived, not checkpointed)"
            if gather == "ciera" else "")
    return ("memory per device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in memory.items())
            + tail)


def summarize(history: list[dict], tc, gather: str, verbose: bool = False) -> str:
    """Per-phase table (first step: compile + priming; warm-up; after warm-up; last 25%; the
    whole run; columns say how they aggregate the steps), then in words what went plainly and
    why (a compressed run) and what compiling cost; ``verbose`` adds the programs' internals."""
    if not history:
        return "(no steps run)"
    first = history[0]["step"]
    note = ("exp chg % leaves out priming steps; " if verbose and gather == "ciera" else "")
    lines = [f"summary: config={tc.config} gather={gather} steps {first}..{history[-1]['step']} "
             f"({note}the first step also compiles)", *_phase_table(history, tc, gather, verbose)]
    if gather == "ciera":
        lines.append(_sent_plainly_line(history, tc.warmup_steps))
    lines.append(_compiles_line(history, gather))
    if verbose and gather == "ciera":
        lines += _internals_lines(history)
    return "\n".join(lines)


def _phase_table(history: list[dict], tc, gather: str, verbose: bool) -> list[str]:
    w = tc.warmup_steps
    first = history[0]["step"]
    phases = [("first step", [r for r in history if r["step"] == first]),
              (f"warm-up (<= {w})", [r for r in history if first < r["step"] <= w]),
              ("after warm-up", [r for r in history if r["step"] > max(w, first)]),
              ("last 25%", history[len(history) - max(1, len(history) // 4):]),
              ("all", history)]

    def wire(rs):
        sent, plain = (sum(r[k] for r in rs) for k in ("sent_bytes", "plain_bytes"))
        return f"{sent / max(plain, 1):>12.4f}"

    def median_s(rs):
        return f"{sorted(r['step_time_s'] for r in rs)[len(rs) // 2]:>9.3f}"

    def exp_chg(rs):
        changes = [r["exp_changed_frac"] for r in rs if not r.get("priming")]
        return f"{100 * np.mean(changes):>11.4f}" if changes else f"{'-':>11}"

    cols = [("steps", 6, "count", lambda rs: f"{len(rs):>6}"),
            ("loss", 9, "last", lambda rs: f"{rs[-1]['loss']:>9.4f}")]
    if gather != "plain":
        cols.append(("wire/plain", 12, "total", wire))
    if gather == "ciera":
        if verbose:
            cols.append(("exp chg %", 11, "mean", exp_chg))
        cols.append(("sent plainly", 14, "sum",
                     lambda rs: f"{sum(r['fallbacks'] for r in rs):>14}"))
    cols.append(("step s", 9, "median", median_s))
    lines = [f"{'phase':<18}" + "".join(f"{name:>{wd}}" for name, wd, _, _ in cols),
             f"{'':<18}" + "".join(f"{how:>{wd}}" for _, wd, how, _ in cols)]
    return lines + [f"{name:<18}" + "".join(cell(rs) for *_, cell in cols)
                    for name, rs in phases if rs]


def _sent_plainly_line(history: list[dict], warmup_steps: int) -> str:
    """What went plainly and why: the caches filling (a priming step), a step running an
    already compiled stand-in while its own compiled, or weights that moved more than the
    step was compiled to send compressed (mostly in the warm-up, when they move most)."""
    gathers = sum(n for r in history for k, n in r["rungs"].items() if int(k) >= 0)
    by_plan = sum(r["rungs"].get("-1", 0) for r in history)
    filling = sum(r["fallbacks"] for r in history if r.get("priming"))
    stand_in = sum(r["fallbacks"] for r in history
                   if r.get("stand_in") and not r.get("priming"))
    moved = [r for r in history if not r.get("priming") and not r.get("stand_in")]
    too_far = sum(r["fallbacks"] for r in moved)
    in_warmup = sum(r["fallbacks"] for r in moved if r["step"] <= warmup_steps)
    total = filling + stand_in + too_far
    primings = sum(bool(r.get("priming")) for r in history)
    why = [f"{filling} filling the caches (" + ("the first step)" if primings == 1 else
                                                f"{primings} steps: the first, and each retry "
                                                "after a failed self-check)")] if filling else []
    if stand_in:
        why.append(f"{stand_in} on steps that ran an already compiled step while their own "
                   "compiled")
    if too_far:
        why.append(f"{too_far} whose weights moved more than the step was compiled to send "
                   f"compressed ({in_warmup} of them in the warm-up)")
    line = (f"sent plainly: {total} of {gathers} gathers of a compressed tensor-layer"
            + (": " + "; ".join(why) if why else ""))
    if by_plan:
        line += (f"; and {by_plan} gathers of tensor-layers the plan keeps plain (compressing "
                 "them does not pay)")
    return line


def _compiles_line(history: list[dict], gather: str) -> str:
    """The seconds the run waited for compiles, and what was compiled."""
    steps = [c for r in history for c in (r.get("step_compile_s", r["compile_s"]),
                                          r.get("beside_compile_s", 0.0)) if c]
    waited = sum(r["compile_s"] for r in history)
    line = f"compiles: {waited:.1f} s waited"
    if steps:
        times = "once" if len(steps) == 1 else f"{len(steps)} times"
        line += f"; the train step compiled {times} ({sum(steps):.1f} s)"
        if len(steps) > 1 and gather == "ciera":
            line += " (again where it sends fewer bytes for how the weights move then)"
    encode_s = sum(r.get("encode_compile_s", 0.0) for r in history)
    if gather == "ciera" and encode_s:
        line += f"; the caches' encoder {encode_s:.1f} s (beside the first step)"
    stand_ins = sum(r.get("stand_in", False) for r in history)
    if stand_ins:
        line += (f"; {stand_ins} steps ran an already compiled step while theirs compiled "
                 "beside them")
    return line


def _internals_lines(history: list[dict]) -> list[str]:
    """--verbose: the programs, their overflows and padding."""
    compiles = [c for r in history for c in (r.get("step_compile_s", r["compile_s"]),
                                             r.get("beside_compile_s", 0.0)) if c]
    stand_ins = sum(r.get("stand_in", False) for r in history)
    encode_s = sum(r.get("encode_compile_s", 0.0) for r in history)
    waited = sum(r["compile_s"] for r in history)
    overflows = sum(r.get("overflows", 0) for r in history)
    as_words = sum(r.get("overflow_words", 0) for r in history)
    lines = [f"programs: {len(compiles)} compiled in this run ({sum(compiles):.1f} s; "
             f"recompiles {max(len(compiles) - 1, 0)}) and the encode program "
             + (f"({encode_s:.1f} s)" if encode_s else "(compiled before this run)")
             + f": {waited:.1f} s waited for compiles"
             + (f" ({stand_ins} steps ran a compiled stand-in while a program compiled "
                "beside them)" if stand_ins else "")
             + f"; overflows {overflows} "
             f"tensor-layers above their program's rung ({as_words} of them sent as words "
             "at the rung they needed, the rest plainly), overflow redos 0 (the demand is "
             "known before the step)"]
    last = history[len(history) - max(1, len(history) // 4):]
    plain = max(sum(r["plain_bytes"] for r in last), 1)
    padding = sum(r.get("padding_bytes", 0) for r in last)
    lines.append(f"last 25% at each step's ideal rungs (no program's padding): wire/plain "
                 f"{(sum(r['sent_bytes'] for r in last) - padding) / plain:.4f}; the programs' "
                 f"padding {padding / plain:.4f}")
    return lines

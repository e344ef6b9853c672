"""What ``ciera train`` tells a person and writes for a program: the per-step record (JSONL),
the progress line, the start-up memory line and legend, and the per-phase summary table.

A priming step (the first step, and the first after a restore) gathers every compressed
tensor plainly to fill fresh caches: its exponent "changes" are the whole tensor, so the
summary's exponent-change means leave priming steps out.
"""

from __future__ import annotations

import numpy as np

from ciera_jax.runtime.units import fmt_bytes


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


def progress_line(rec: dict, steps: int, tokens: int) -> str:
    width = 20
    done = int(width * rec["step"] / max(steps, 1))
    bar = "#" * done + "." * (width - done)
    ratio = rec["sent_bytes"] / max(rec["plain_bytes"], 1)
    rungs = ",".join(f"{k}:{v}" for k, v in sorted(rec["rungs"].items(), key=lambda kv: int(kv[0])))
    changed = ("priming" if rec.get("priming")
               else f"{100 * rec['exp_changed_frac']:.3f}%")
    return (f"[{bar}] step {rec['step']:>4}/{steps} loss {rec['loss']:.4f} | "
            f"{tokens / max(rec['step_time_s'], 1e-9):,.0f} tok/s | wire {ratio:.3f}x plain "
            f"({fmt_bytes(rec['sent_bytes'])}/{fmt_bytes(rec['plain_bytes'])}) | exp changed "
            f"{changed} | rungs {rungs} fallbacks {rec['fallbacks']}")


def memory_line(memory: dict) -> str:
    """``memory``: bytes per device by part (params, optimizer, caches)."""
    return ("memory per device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in memory.items())
            + " (caches: replicated on every rank; derived, not checkpointed)")


def summarize(history: list[dict], tc, gather: str) -> str:
    """Per-phase table: first step (compile + priming), warm-up, after warm-up, last 25%,
    whole run. Columns say how they aggregate the steps."""
    if not history:
        return "(no steps run)"
    w = tc.warmup_steps
    first = history[0]["step"]
    phases = [("first step", [r for r in history if r["step"] == first]),
              (f"warm-up (<= {w})", [r for r in history if first < r["step"] <= w]),
              ("after warm-up", [r for r in history if r["step"] > max(w, first)]),
              ("last 25%", history[len(history) - max(1, len(history) // 4):]),
              ("all", history)]
    cols = (("steps", 6, "count"), ("loss", 9, "last"), ("wire/plain", 12, "total"),
            ("exp chg %", 11, "mean"), ("fallbacks", 10, "sum"), ("step s", 9, "median"))
    lines = [f"summary: config={tc.config} gather={gather} steps {first}..{history[-1]['step']} "
             "(exp chg % leaves out priming steps; the first step also compiles)",
             f"{'phase':<18}" + "".join(f"{name:>{wd}}" for name, wd, _ in cols),
             f"{'':<18}" + "".join(f"{how:>{wd}}" for _, wd, how in cols)]
    for name, rs in phases:
        if not rs:
            continue
        sent = sum(r["sent_bytes"] for r in rs)
        plain = sum(r["plain_bytes"] for r in rs)
        times = sorted(r["step_time_s"] for r in rs)
        changes = [r["exp_changed_frac"] for r in rs if not r.get("priming")]
        chg = f"{100 * np.mean(changes):>11.4f}" if changes else f"{'-':>11}"
        lines.append(f"{name:<18}{len(rs):>6}{rs[-1]['loss']:>9.4f}{sent / max(plain, 1):>12.4f}"
                     f"{chg}{sum(r['fallbacks'] for r in rs):>10}{times[len(times) // 2]:>9.3f}")
    compiles = [c for r in history for c in (r.get("step_compile_s", r["compile_s"]),
                                             r.get("beside_compile_s", 0.0)) if c]
    stand_ins = sum(r.get("stand_in", False) for r in history)
    encode_s = sum(r.get("encode_compile_s", 0.0) for r in history)
    waited = sum(r["compile_s"] for r in history)
    overflows = sum(r.get("overflows", 0) for r in history)
    as_words = sum(r.get("overflow_words", 0) for r in history)
    lines.append(f"programs: {len(compiles)} compiled in this run ({sum(compiles):.1f} s; "
                 f"recompiles {max(len(compiles) - 1, 0)}) and the encode program "
                 + (f"({encode_s:.1f} s)" if encode_s
                    else "(compiled before this run)")
                 + f": {waited:.1f} s waited for compiles"
                 + (f" ({stand_ins} steps ran a compiled stand-in while a program compiled "
                    "beside them)" if stand_ins else "")
                 + f"; overflows {overflows} "
                 f"tensor-layers above their program's rung ({as_words} of them sent as words "
                 "at the rung they needed, the rest plainly), overflow redos 0 (the demand is "
                 "known before the step)")
    last = history[len(history) - max(1, len(history) // 4):]
    plain = max(sum(r["plain_bytes"] for r in last), 1)
    padding = sum(r.get("padding_bytes", 0) for r in last)
    lines.append(f"last 25% at each step's ideal rungs (no program's padding): wire/plain "
                 f"{(sum(r['sent_bytes'] for r in last) - padding) / plain:.4f}; the programs' "
                 f"padding {padding / plain:.4f}")
    return "\n".join(lines)

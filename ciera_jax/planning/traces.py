"""Traces the planner and the simulator both read: how much a compressed gather sends, measured.

Exponent mode: the fraction of bf16 exponents that change per step, per tensor kind. Accepted
inputs:
- the trace JSON (``{"change_rate_by_kind": {kind: rate}, "default": rate}``; the stability
  study writes this format; the shipped ``planning/data/default_trace.json`` is its measurement on
  ``small``);
- ``ciera train --metrics-out`` JSONL, whose lines may carry ``exp_change_by_kind``: the
  steady-state rate per kind is the mean over the last half of the lines that carry it.

Word mode: bytes per weight per phase and tensor kind (:class:`WordTrace`).

The planner and :mod:`ciera_jax.sim` both read it, so the planner never imports the simulator.
It needs no JAX.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

DATA = Path(__file__).parent / "data"  # shipped as package data (pyproject.toml)
DEFAULT_TRACE = DATA / "default_trace.json"


@dataclasses.dataclass(frozen=True)
class Trace:
    rates: dict
    default: float = 1e-3
    source: str = ""
    placeholder: bool = False

    def rate(self, kind: str) -> float:
        return float(self.rates.get(kind, self.default))

    def to_json(self) -> dict:
        return {"change_rate_by_kind": dict(self.rates), "default": self.default,
                "source": self.source, "placeholder": self.placeholder}


def default_trace() -> Trace:
    return load_trace(DEFAULT_TRACE)


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"trace file not found: {p}")
    text = p.read_text()
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        d = None
    if isinstance(d, dict) and "change_rate_by_kind" in d:
        return Trace({k: float(v) for k, v in d["change_rate_by_kind"].items()},
                     float(d.get("default", 1e-3)), str(p), bool(d.get("placeholder", False)))
    # JSONL metrics (a single line parses as a dict above without the key: treat alike)
    rows = []
    for i, line in enumerate(text.splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i + 1}: neither trace JSON nor JSONL metrics ({e})") from None
        if isinstance(rec, dict) and isinstance(rec.get("exp_change_by_kind"), dict):
            rows.append(rec["exp_change_by_kind"])
    if not rows:
        raise ValueError(f"{p}: no 'change_rate_by_kind' object and no JSONL line with "
                         "'exp_change_by_kind'")
    tail = rows[len(rows) // 2:]
    kinds = sorted({k for r in tail for k in r})
    rates = {k: sum(float(r[k]) for r in tail if k in r) / sum(1 for r in tail if k in r)
             for k in kinds}
    default = max(rates.values()) if rates else 1e-3
    return Trace(rates, default, f"{p} (mean of last {len(tail)} of {len(rows)} steps)")


# ----------------------------------------------------------------------------- word mode

WORD_TRACE = DATA / "word_trace.json"  # measured, when present
WORD_DEFAULT = DATA / "word_default.json"  # from the offline study
PHASES = ("warmup", "peak", "steady", "late")


@dataclasses.dataclass(frozen=True)
class WordTrace:
    """Word-mode bytes per weight (rung choice and exponent-mode fallback included), per phase
    and tensor kind: ``phases[phase] = {"bytes_per_weight": {kind: B}, "overall": B}``."""

    phases: dict
    source: str = ""  # the file
    note: str = ""  # where its numbers come from

    def bpw(self, kind: str, phase: str = "steady") -> float:
        if phase not in self.phases:
            raise KeyError(f"word trace {self.source} has no phase {phase!r}; it has: "
                           f"{', '.join(self.phases)}")
        p = self.phases[phase]
        return float(p.get("bytes_per_weight", {}).get(kind, p["overall"]))

    def to_json(self) -> dict:
        return {"source": self.source, "note": self.note, "phases": self.phases}


def load_word_trace(path: str | Path) -> WordTrace:
    """``{"source": ..., "phases": {phase: {"bytes_per_weight": {kind: B}, "overall": B}}}``."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"word trace file not found: {p}")
    d = json.loads(p.read_text())
    phases = d.get("phases") if isinstance(d, dict) else None
    if not isinstance(phases, dict) or not phases or any(
            not isinstance(v, dict) or "overall" not in v for v in phases.values()):
        raise ValueError(f"{p}: not a word trace (want {{'phases': {{phase: {{'overall': "
                         "bytes_per_weight, 'bytes_per_weight': {kind: ...}}}}}}})")
    return WordTrace(phases, str(p), str(d.get("source", "")))


def default_word_trace() -> WordTrace:
    """The measured trace (``data/word_trace.json``, written by the weight-stability study)
    when present, else the defaults taken from the offline word-delta study."""
    return load_word_trace(WORD_TRACE if WORD_TRACE.exists() else WORD_DEFAULT)

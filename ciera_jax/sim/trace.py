"""Exponent-change traces: the fraction of bf16 exponents that change per step, per tensor kind.

Accepted inputs:
- the trace JSON (``{"change_rate_by_kind": {kind: rate}, "default": rate}``; the stability
  study writes this format; the shipped ``data/default_trace.json`` is its measurement on
  ``small``);
- ``ciera train --metrics-out`` JSONL, whose lines may carry ``exp_change_by_kind``: the
  steady-state rate per kind is the mean over the last half of the lines that carry it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

DEFAULT_TRACE = Path(__file__).parent / "data" / "default_trace.json"


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

"""What a gather's codec costs a GPU, read from a recorded table (``data/codec_cost.json``).

The table holds, per GPU and mode, the device kernels of one compiled gather (its steady path
as ``ciera aot --gather-shape`` or ``benchmarks/gather_cost.py`` reads it off XLA:GPU's
schedule, collectives left out: the link prices those) and GPU measurements where there are
any. Each entry names its source. Nothing here is a hand-written rate.

The codec time of a tensor of ``n`` bytes is the compiled gather's roofline scaled to ``n``:
each kernel's bytes scaled by ``n / tensor_bytes``, each kernel at least one launch
(``launch_s``), the rest at the GPU's HBM rate; from the recorded shape nearest ``n`` (log
distance) at the GPU count nearest the one asked for. ``calibration="measured"`` multiplies
that roofline by what a GPU measured against it (the measured mode's time over its roofline at
the measured size), and says so in the source.

``plain`` is the plain gather's own device work (the layout transposes of a gather off axis
0), ``payload`` an exponent-cache tensor's backward re-gather, priced as the exponent
gather's exchange program (the encode is not run again).
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import lru_cache
from pathlib import Path

TABLE = Path(__file__).parent / "data" / "codec_cost.json"
CALIBRATIONS = ("roofline", "measured")
# kernel kinds that run on the device (the rest are collectives: the link's time)
DEVICE_KINDS = ("fusion", "mosaic", "triton", "gemm", "custom-call", "copy")
# which compiled programs price each cost-model method
PROGRAMS = {"plain": ("plain", None), "ciera": ("exponent", None), "word": ("word", None),
            "payload": ("exponent", "exchange")}


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """One mode's codec seconds for a tensor, and where the figure comes from, in words."""

    seconds: float
    source: str


def entry_from_report(report: dict, source: str) -> dict:
    """One table entry from a gather-cost report (``ciera_models.aot.gather_cost``): its
    device kernels per program as ``[bytes, runs]``."""
    programs = {name: [[k["bytes"], k["runs"]] for k in p["kernel_list"]
                       if k["kind"] in DEVICE_KINDS]
                for name, p in report["programs"].items()}
    return {"mode": report["mode"], "gpu": report["gpu"], "gpus": report["gpus"],
            "tensor_bytes": report["tensor_bytes"], "programs": programs, "source": source}


def write_table(path, entries: list[dict], hbm_Bps: dict, launch_s: float,
                measurements: list[dict] = ()) -> None:
    """The table: ``entries`` (:func:`entry_from_report`), each GPU's HBM rate the roofline
    used, the launch floor per kernel, and ``measurements`` (``{mode, gpu, tensor_bytes,
    codec_s, source}``)."""
    Path(path).write_text(json.dumps({"hbm_Bps": hbm_Bps, "launch_s": launch_s,
                                      "entries": entries,
                                      "measurements": list(measurements)}, indent=1) + "\n")


@lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict:
    p = Path(path) if path else TABLE
    if not p.exists():
        raise FileNotFoundError(f"codec cost table not found: {p} (write it with "
                                "benchmarks/gather_cost.py --table)")
    return json.loads(p.read_text())


def _entry(table: dict, mode: str, gpu: str, gpus: int, n_bytes: float) -> dict:
    rows = [e for e in table["entries"] if e["mode"] == mode and e["gpu"] == gpu]
    if not rows:
        gpus_known = sorted({e["gpu"] for e in table["entries"]})
        raise KeyError(f"no compiled {mode} gather for GPU {gpu!r} in the codec table; it "
                       f"holds: {', '.join(gpus_known)}")
    return min(rows, key=lambda e: (abs(math.log(max(gpus, 1) / e["gpus"])),
                                    abs(math.log(max(n_bytes, 1) / e["tensor_bytes"]))))


def roofline(table: dict, method: str, n_bytes: float, gpu: str, gpus: int) -> tuple[float, dict]:
    """The roofline seconds of ``method`` (a cost-model name) on ``n_bytes``, and its entry."""
    mode, program = PROGRAMS[method]
    e = _entry(table, mode, gpu, gpus, n_bytes)
    scale = n_bytes / e["tensor_bytes"]
    hbm, floor = table["hbm_Bps"][gpu], table["launch_s"]
    t = sum(runs * max(b * scale / hbm, floor)
            for name, ks in e["programs"].items() if program in (None, name) for b, runs in ks)
    return t, e


def _measured_factor(table: dict, gpu: str) -> tuple[float, dict] | None:
    """A GPU's measured codec time over its roofline (the largest measured tensor's)."""
    ms = [m for m in table.get("measurements", []) if m["gpu"] == gpu]
    if not ms:
        return None
    m = max(ms, key=lambda m: m["tensor_bytes"])
    method = {v[0]: k for k, v in PROGRAMS.items() if v[1] is None}[m["mode"]]
    t, _ = roofline(table, method, m["tensor_bytes"], gpu, 1)
    return m["codec_s"] / t, m


def codec_cost(method: str, n_bytes: float, gpu: str, gpus: int,
               calibration: str = "roofline", path: str | None = None) -> CodecCost:
    """Seconds of ``method``'s device work on a tensor of ``n_bytes`` gathered over ``gpus``
    ``gpu`` s, and its source."""
    if calibration not in CALIBRATIONS:
        raise ValueError(f"codec calibration {calibration!r}: use one of "
                         f"{', '.join(CALIBRATIONS)}")
    table = load_table(path)
    t, e = roofline(table, method, n_bytes, gpu, gpus)
    if calibration == "measured" and method != "plain":  # the measurement is the codec's alone
        f = _measured_factor(table, gpu)
        if f is None:
            raise ValueError(f"no GPU measurement of the codec on {gpu} in the codec table; "
                             "use calibration 'roofline'")
        return CodecCost(t * f[0], f"{e['source']}, scaled by {f[0]:.1f}x: {f[1]['source']}")
    return CodecCost(t, f"{e['source']}, not measured on a GPU")


def source(gpu: str, calibration: str = "roofline", path: str | None = None) -> str:
    """The words a prediction gives for its codec term on ``gpu``."""
    return "codec: " + codec_cost("word", 1 << 26, gpu, 16, calibration, path).source

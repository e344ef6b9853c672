"""What every benchmark shares: the command-line flags, the JSON envelope, the output folder,
the table printer.

Every benchmark has a ``main(argv=None)`` built on :func:`parser` (``--out`` for the JSON,
``--png`` where it draws a plot) and writes its results with :func:`write_results`, which wraps
them in the same envelope: the machine, the library versions, the command line and the date.
Tables printed as they are measured go through :func:`print_table`.
Default outputs go under ``benchmarks/results/``. The package is installed (``pip install -e
.``), so nothing here edits ``sys.path``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence, Union

RESULTS = Path(__file__).resolve().parent / "results"


def parser(doc: str, name: str, *, png: bool = False) -> argparse.ArgumentParser:
    """An ArgumentParser with the shared flags; ``name`` names the default outputs."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0], epilog=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS / f"{name}.json"),
                   help="JSON results (default: %(default)s)")
    if png:
        p.add_argument("--png", default=str(RESULTS / f"{name}.png"),
                       help="plot (default: %(default)s; '' for none)")
    return p


def envelope() -> dict:
    """Where and with what a result was measured."""
    import jax  # imported late: a benchmark may set XLA_FLAGS before JAX starts

    from ciera_jax.runtime.devices import cpu_unless_accelerator

    cpu_unless_accelerator()  # a results file is written on any machine, GPU or not
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for mod in ("jaxlib", "flax", "optax", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    devices = jax.devices()
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    # 1/5/15-minute load averages at the end: on a shared machine, how much
                    # else was running while this was timed.
                    "load_avg": [round(x, 2) for x in os.getloadavg()],
                    "backend": devices[0].platform, "device_kind": devices[0].device_kind,
                    "devices": len(devices)},
        "versions": versions,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(path: str | os.PathLike | None, results) -> dict:
    """Write ``{**envelope(), "results": results}`` as JSON to ``path`` (skip if falsy)."""
    doc = {**envelope(), "results": results}
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, default=_plain) + "\n")
        print(f"wrote {out}")
    return doc


def _plain(x):
    """JSON for numpy / jax scalars and arrays."""
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


# A column: (header, width, cell), where cell is a row key, (row key, format spec), or a function
# of the row that returns the text. Numbers right-aligned in ``width`` characters.
Column = tuple[str, int, Union[str, tuple[str, str], Callable[[dict], Any]]]


def print_table(rows: Sequence[dict], columns: Sequence[Column], header: bool = True) -> None:
    """Print ``rows`` as fixed-width columns (one line each, flushed: benchmarks print rows as
    they are measured), with a header line first unless ``header`` is False."""
    if header:
        print(" ".join(f"{name:>{width}}" for name, width, _ in columns), flush=True)
    for r in rows:
        cells = []
        for _, width, cell in columns:
            if callable(cell):
                text = str(cell(r))
            elif isinstance(cell, tuple):
                text = format(r[cell[0]], cell[1])
            else:
                text = str(r[cell])
            cells.append(f"{text:>{width}}")
        print(" ".join(cells), flush=True)

"""The step model's codec cost table (``ciera_jax/planning/data/codec_cost.json``), from a
gather-cost run (``benchmarks/gather_cost.py``, compiled now or recorded) and, where there is
one, a one-GPU measurement of the exponent gather (``benchmarks/gather_bench.py --devices 1``
on a GPU).

    python benchmarks/codec_table.py benchmarks/results/gather_cost_<...>.json \\
        --measured benchmarks/results/gather_bench_h100_1gpu.json

Each entry names its source: "compile roofline, <GPU>, at <commit>, <date>"; a measurement
"measured on one <GPU>, <date>". Hopper GPUs run the same compiled program, so an H200 entry is
the H100 compile at the H200's HBM rate, and says so.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path

from ciera_jax.planning import codec_costs
from ciera_jax.runtime import gpu_targets

SAME_PROGRAM = {"h100-80gb": ("h200-141gb",)}  # GPUs that run the program compiled for the key
SHORT = {"h100-80gb": "H100", "h200-141gb": "H200"}


def _commit(path: str | None) -> str:
    """The commit a recorded run compiled (its name's ``at-<commit>``, else the commit that
    added it), or this checkout's."""
    m = re.search(r"at-([0-9a-f]{7,40})", Path(path).name) if path else None
    if m:
        return m.group(1)
    cmd = ["git", "log", "-1", "--format=%h", "--", path] if path else \
        ["git", "rev-parse", "--short", "HEAD"]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
    return out or "uncommitted"


def entries(doc: dict, commit: str) -> list[dict]:
    out = []
    date = doc["date"][:10]
    for r in doc["results"]:
        gpu = r["gpu"]
        out.append(codec_costs.entry_from_report(
            r, f"compile roofline, {SHORT.get(gpu, gpu)}, at {commit}, {date}"))
        for other in SAME_PROGRAM.get(gpu, ()):
            e = codec_costs.entry_from_report(
                r, f"compile roofline, {SHORT.get(gpu, gpu)}'s program at the "
                   f"{SHORT.get(other, other)}'s HBM rate, at {commit}, {date}")
            out.append({**e, "gpu": other})
    return out


def measurements(path: str) -> list[dict]:
    """The exponent gather's codec time on one GPU: the gather's time less the plain copy's,
    the median over the churns measured, per tensor size."""
    doc = json.loads(Path(path).read_text())
    kind = doc["machine"]["device_kind"]
    gpu = next(t.name for t in gpu_targets.TARGETS.values() if t.description in kind
               or kind in t.description)
    by_size: dict[int, list[float]] = {}
    for r in doc["results"]["rows"]:
        if r["N"] == 1:
            n = 2 * r["shape"][0] * r["shape"][1] * r["shape"][2]
            by_size.setdefault(n, []).append(r["ciera_s"] - r["plain_bits_s"])
    return [{"mode": "exponent", "gpu": gpu, "tensor_bytes": n,
             "codec_s": statistics.median(ts),
             "source": f"measured on one {SHORT.get(gpu, gpu)}, {doc['date'][:10]} "
                       f"({Path(path).name}, the exponent gather less a plain copy)"}
            for n, ts in sorted(by_size.items())]


def write(table: str, recorded, measured: str | None = None) -> None:
    """Write the table from ``recorded`` (a gather-cost results path, or its document)."""
    path = recorded if isinstance(recorded, (str, Path)) else None
    doc = json.loads(Path(recorded).read_text()) if path else recorded
    from ciera_models.aot.kernel_list import LAUNCH_S

    hbm = {t.name: t.memory_bandwidth_Bps for t in gpu_targets.TARGETS.values()}
    codec_costs.write_table(table, entries(doc, _commit(str(path) if path else None)), hbm,
                            LAUNCH_S, measurements(measured) if measured else [])
    print(f"wrote {table}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recorded", help="a gather_cost.py results JSON")
    p.add_argument("--measured", default=None, help="a one-GPU gather_bench.py results JSON")
    p.add_argument("--table", default=str(codec_costs.TABLE), help="where to write the table")
    args = p.parse_args(argv)
    write(args.table, args.recorded, args.measured)


if __name__ == "__main__":
    main()

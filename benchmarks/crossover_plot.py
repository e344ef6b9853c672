"""The sweep's picture: time per gather against link rate, log-log, one panel per process count
and series; per mode the measured points and the step model's predicted line; each measured
crossover marked where the mode's time meets plain's.

    draw(doc, "docs/crossover.png")   # doc: gather_multiprocess.py's JSON (write_results)
"""

from __future__ import annotations

import math

COLORS = {"plain": "black", "exponent": "tab:blue", "word": "tab:orange"}


def draw(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    points = [p for p in res["points"] if p["rate_bps"]]
    panels = sorted({(p["series"], p["procs"]) for p in points}, key=lambda k: (k[0], k[1]))
    cols = sorted({procs for _, procs in panels})
    rows = sorted({series for series, _ in panels})
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(5.2 * len(cols), 4.0 * len(rows)),
                             squeeze=False, sharex=True)
    for (series, procs) in panels:
        ax = axes[rows.index(series)][cols.index(procs)]
        pts = [p for p in points if (p["series"], p["procs"]) == (series, procs)]
        for mode in ("plain", "exponent", "word"):
            mp = sorted((p for p in pts if p["mode"] == mode), key=lambda p: p["rate_bps"])
            if not mp:
                continue
            x = [p["rate_bps"] / 1e9 for p in mp]
            ax.plot(x, [p["measured_s"] * 1e3 for p in mp], "o", color=COLORS[mode],
                    label=f"{mode} measured")
            if all(p["predicted_s"] for p in mp):
                ax.plot(x, [p["predicted_s"] * 1e3 for p in mp], "-", color=COLORS[mode],
                        alpha=0.7, label=f"{mode} predicted")
        for c in res["crossovers"]:
            if (c["series"], c["procs"]) != (series, procs) or c["measured"]["rate"] is None:
                continue
            r = c["measured"]["rate"]
            t = _plain_at(pts, r)
            ax.plot([r / 1e9], [t * 1e3], marker="X", ms=12, color=COLORS[c["mode"]],
                    markeredgecolor="black", linestyle="none")
            ax.annotate(f"{c['mode']} pays below {r / 1e9:.2g} Gbit/s", (r / 1e9, t * 1e3),
                        textcoords="offset points", xytext=(6, 8), fontsize=8,
                        color=COLORS[c["mode"]])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{series} series, {procs} processes, 16 MB bf16", fontsize=10)
        ax.set_xlabel("link rate (Gbit/s, tc tbf per process)")
        ax.set_ylabel("ms per gather (slowest process, median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    # a re-priced sweep: the load of the run that measured it
    machine = (res.get("repriced_from") or {}).get("machine") or doc["machine"]
    fig.suptitle("Where CIERA pays: measured over real sockets (points),\nthe step model on the "
                 f"calibrated host (lines); load {machine['load_avg'][1]:.1f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plain_at(pts: list[dict], rate: float) -> float:
    """Plain's measured time at ``rate``, log-interpolated between the sweep's rates (where a
    mode's time meets it, at the crossover)."""
    mp = sorted((p for p in pts if p["mode"] == "plain"), key=lambda p: p["rate_bps"])
    for a, b in zip(mp, mp[1:]):
        if a["rate_bps"] <= rate <= b["rate_bps"]:
            f = math.log(rate / a["rate_bps"]) / math.log(b["rate_bps"] / a["rate_bps"])
            return math.exp(math.log(a["measured_s"]) * (1 - f) + math.log(b["measured_s"]) * f)
    return mp[-1]["measured_s"]

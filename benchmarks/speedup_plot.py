"""Predicted step speed-up of OLMoE-1B-7B against the per-GPU bandwidth of the network across
hosts: CIERA's word and exponent modes and the equal-memory baseline (plain FSDP that keeps its
gathered weights), at 16 and 128 H100s, from the one step model every command uses
(:func:`ciera_jax.sim.predict.predict`; hosts of 8 on NVLink, the codec priced from the
compiled program).

    python benchmarks/speedup_plot.py          # docs/speedup_olmoe.png + results JSON
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from common import parser, write_results  # benchmarks/common.py

DOCS = Path(__file__).resolve().parent.parent / "docs"
RATES_GBps = (3, 5, 8, 11, 16, 25, 42, 64, 100, 160, 250, 360)
MARKS = {"100 GbE": 11, "IB NDR 400": 42, "NVLink4": 360}  # per GPU per direction, GB/s
CURVES = (("word", "CIERA word", "-"), ("ciera", "CIERA exponent", "--"),
          ("plain-noreshard", "plain FSDP keeping weights (equal memory)", ":"))


def parse_args(argv=None):
    p = parser(__doc__, f"speedup_plot_{datetime.date.today().isoformat()}")
    p.add_argument("--png", default=str(DOCS / "speedup_olmoe.png"))
    p.add_argument("--config", default="olmoe-1b-7b")
    p.add_argument("--cluster", default="h100-ib400")
    p.add_argument("--gpus", type=int, nargs="+", default=[16, 128])
    p.add_argument("--codec", choices=("roofline", "measured"), default="roofline")
    return p.parse_args(argv)


def sweep(config: str, cluster_name: str, gpus: list[int], codec: str) -> list[dict]:
    from ciera_jax.sim.cluster import get_cluster
    from ciera_jax.sim.predict import predict

    base = get_cluster(cluster_name, calibration=codec)
    rows = []
    for n in gpus:
        for rate in RATES_GBps:
            inter = dataclasses.replace(base.inter, beta_Bps=rate * 1e9)
            p = predict(config, n, dataclasses.replace(base, inter=inter))
            rows.append({"gpus": n, "network_GBps": rate, "source": p.source,
                         **{f"speedup_{m}": p.speedup(m) for m, _, _ in CURVES},
                         "step_plain_s": p.step_s("plain")})
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colors = {16: "tab:blue", 128: "tab:red"}
    for n in sorted({r["gpus"] for r in rows}):
        rs = [r for r in rows if r["gpus"] == n]
        for m, label, ls in CURVES:
            ax.plot([r["network_GBps"] for r in rs], [r[f"speedup_{m}"] for r in rs], ls=ls,
                    color=colors.get(n), marker="o" if m == "word" else None, ms=3,
                    label=f"{n} GPUs: {label}")
    for name, rate in MARKS.items():
        ax.axvline(rate, color="gray", lw=0.8, alpha=0.6)
        ax.text(rate, 0.02, f" {name}", rotation=90, va="bottom", fontsize=8, color="dimgray",
                transform=ax.get_xaxis_transform())
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("network bandwidth across hosts, per GPU per direction (GB/s)")
    ax.set_ylabel("predicted step speed-up over plain FSDP")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = sweep(args.config, args.cluster, args.gpus, args.codec)
    src = rows[0]["source"]
    plot(rows, args.png, f"{args.config}, H100s in hosts of 8 on NVLink (predicted)\n{src}")
    print(f"wrote {args.png}")
    for r in rows:
        print(f"{r['gpus']:>4} GPUs {r['network_GBps']:>4} GB/s: word "
              f"{r['speedup_word']:.2f}x, exponent {r['speedup_ciera']:.2f}x, equal-memory "
              f"{r['speedup_plain-noreshard']:.2f}x")
    write_results(args.out, {"config": args.config, "cluster": args.cluster,
                             "codec": args.codec, "rows": rows})


if __name__ == "__main__":
    main()

"""Simulate FSDP step time and extra memory on a GPU cluster: plain, int8, entropy, CIERA modes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ciera_jax.cli import cluster_flags
from ciera_jax.planning.traces import PHASES


def add_arguments(p: argparse.ArgumentParser) -> None:
    cluster_flags.add_config(p, old="--model")
    p.add_argument("--gpus", default=None,
                   help="comma-separated GPU counts (default: the cluster name's count, else "
                        "16,128)")
    cluster_flags.add_cluster(p)
    p.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens per GPU per step")
    p.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation (default 0.35)")
    p.add_argument("--trace", default=None,
                   help="exponent-change trace: trace JSON or `ciera train --metrics-out` JSONL")
    p.add_argument("--word-trace", default=None,
                   help="word-mode trace JSON (default: sim/data/word_trace.json if present, "
                        "else the word-delta study's figures)")
    p.add_argument("--phase", choices=PHASES, default="steady",
                   help="training phase whose word-mode bytes per weight to use (default steady)")
    p.add_argument("--codec-stream", choices=("compute", "comm"), default="compute",
                   help="where codec work runs (default: compute stream)")
    p.add_argument("--table", action="store_true",
                   help="also print every method's step time, memory and speed-ups (wide)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="plot CIERA's speedup vs GPU count here")


def parse_gpus(text: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gpus must be comma-separated integers, got {text!r}") from None
    if not out or any(n < 1 for n in out):
        raise ValueError(f"--gpus must list positive integers, got {text!r}")
    return out


LABEL = {"ciera": "exponent", "plain-noreshard": "noreshard"}


def label(m: str) -> str:
    return LABEL.get(m, m)


def format_table(result: dict) -> str:
    """Step time and extra memory per GPU of every method; CIERA's speedups."""
    from ciera_jax.sim.step import METHODS  # here: the `ciera` parser must not load JAX

    first = next(iter(result["results"].values()))
    methods = [m for m in METHODS if m in first["methods"]]
    over = [(c, m) for c in ("ciera", "word", "fit") if f"speedup_{c}_over" in first
            for m in ("plain", "plain-noreshard", "int8") if m in first[f"speedup_{c}_over"]]
    head = (["GPUs"] + [f"{label(m)} ms" for m in methods]
            + [f"{label(m)} +GB" for m in methods if m not in ("plain", "int8", "entropy")]
            + [f"{label(c)} x {label(m)}" for c, m in over])
    rows = []
    for N, e in result["results"].items():
        r = e["methods"]
        rows.append([N] + [f"{r[m]['step_s'] * 1e3:.1f}{'' if r[m].get('fits', True) else '*'}"
                           for m in methods]
                    + [f"{r[m]['extra_memory_bytes'] / 1e9:.2f}" for m in methods
                       if m not in ("plain", "int8", "entropy")]
                    + [f"{e[f'speedup_{c}_over'][m]:.2f}" for c, m in over])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
                     + ["(ms: step time; +GB: extra memory per GPU over plain FSDP; exponent, "
                        "word: CIERA's modes; noreshard: plain FSDP that keeps the gathered "
                        "weights for the backward, word mode's equal-memory baseline; fit: "
                        "the budgeted planner's plan within the GPU's memory, what a run gets; "
                        "*: does not fit the GPU's memory; x: step-time speedup)"])


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ns = [int(n) for n in result["results"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in ("ciera", "word", "fit"):
        for m in ("plain", "plain-noreshard", "int8"):
            ys = [result["results"][str(n)].get(f"speedup_{c}_over", {}).get(m) for n in Ns]
            if all(y is not None for y in ys):
                ax.plot(Ns, ys, marker="o", ls={"word": "-", "fit": ":"}.get(c, "--"),
                        label=f"{label(c)} {'plan' if c == 'fit' else 'mode'} over {m}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("step-time speedup")
    ax.set_title(f"{result['model']} on {result['cluster']['name']}, "
                 f"{result['tokens_per_gpu']} tokens/GPU (simulated)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from ciera_jax.sim.cluster import get_cluster
    from ciera_jax.sim.predict import predict
    from ciera_jax.sim.step import sweep
    from ciera_jax.planning.traces import default_trace, default_word_trace, load_trace, load_word_trace
    from ciera_jax.runtime.outputs import check_output_file
    from ciera_jax.planning.shapes import get_config

    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path:
            check_output_file(path, flag)
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be a fraction in (0, 1], got {args.mfu:g}")
    cfg = get_config(args.config)
    from ciera_jax.planning import clusters

    count = clusters.parse(args.cluster)[1]
    gpus = parse_gpus(args.gpus) if args.gpus else [count] if count else [16, 128]
    if args.tokens_per_gpu < 1:
        raise ValueError("--tokens-per-gpu must be positive")
    cluster = get_cluster(args.cluster, mfu=args.mfu, calibration=args.codec)
    trace = load_trace(args.trace) if args.trace else default_trace()
    word = load_word_trace(args.word_trace) if args.word_trace else default_word_trace()
    word.bpw("default", args.phase)  # a trace without the phase: a clear error here, before the sweep
    result = sweep(cfg, gpus, cluster, args.tokens_per_gpu, trace,
                   codec_stream=args.codec_stream, word_trace=word, phase=args.phase)
    print(f"{cfg.name} on {cluster.name} ({cluster.gpus_per_node} GPUs/node, MFU {cluster.mfu}), "
          f"{args.tokens_per_gpu} tokens/GPU, trace: {Path(trace.source).name}"
          + (" (placeholder)" if trace.placeholder else "")
          + f", word trace: {Path(word.source).name} ({args.phase})")
    if args.table:
        print(format_table(result))
    lines = [predict(cfg, n, cluster, args.tokens_per_gpu, trace=trace, word_trace=word,
                     phase=args.phase, codec_stream=args.codec_stream) for n in gpus]
    result["predictions"] = [p.to_json() for p in lines]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        plot(result, args.png)
        print(f"wrote {args.png}")
    for p in lines:
        print(p.line())
    return 0

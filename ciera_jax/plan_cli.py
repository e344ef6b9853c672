"""Show which tensors CIERA compresses and the predicted gather time saved per step."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="olmoe-1b-7b", help="model config name")
    p.add_argument("--gpus", type=int, default=16, help="ranks on the fsdp axis")
    p.add_argument("--profile", default="h100-ib400",
                   help="built-in profile name or a profile JSON file (default h100-ib400)")
    p.add_argument("--change-rate", type=float, default=None,
                   help="exponent change rate per step for every tensor "
                        "(default: the shipped per-kind trace)")
    p.add_argument("--trace", default=None, help="trace JSON / metrics JSONL instead")
    p.add_argument("--json", default=None, help="also write every decision here")


def _row_groups(decisions, cfg):
    """Globals, then one representative of each distinct layer structure with its count."""
    globals_ = [d for d in decisions if d.layer is None]
    by_layer: dict[int, list] = {}
    for d in decisions:
        if d.layer is not None:
            by_layer.setdefault(d.layer, []).append(d)
    sigs: dict[tuple, list[int]] = {}
    for l, ds in by_layer.items():
        sigs.setdefault(tuple((d.name, d.shape, d.compress) for d in ds), []).append(l)
    groups = [("global", globals_, 1)]
    for layers in sigs.values():
        span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
        groups.append((f"layers {span} (each)", by_layer[layers[0]], len(layers)))
    return groups


def run(args: argparse.Namespace) -> int:
    from ciera_jax import costmodel as cm
    from ciera_jax.planner import plan_model, summarize
    from ciera_jax.shapes import get_config

    cfg = get_config(args.config)
    if args.gpus < 1:
        raise ValueError("--gpus must be positive")
    profile = cm.Profile.load(args.profile)
    if args.change_rate is not None:
        if not 0.0 <= args.change_rate <= 1.0:
            raise ValueError("--change-rate must be in [0, 1]")
        trace = args.change_rate
    elif args.trace:
        from ciera_jax.sim.trace import load_trace
        trace = load_trace(args.trace)
    else:
        trace = None
    decisions = plan_model(cfg, args.gpus, profile, trace)
    print(f"{cfg.name} on {args.gpus} ranks, profile {profile.name} "
          f"(alpha {profile.alpha_s * 1e6:g} us, beta {profile.beta_Bps / 1e9:g} GB/s, "
          f"codec {profile.codec_Bps / 1e9:g} GB/s)")
    head = ["tensor", "shape", "MB", "decision", "t_plain us", "t_ciera us", "x"]
    rows = []
    for title, ds, count in _row_groups(decisions, cfg):
        rows.append([f"[{title}]", "", "", "", "", "", ""])
        for d in ds:
            rows.append([d.name, "x".join(map(str, d.shape)), f"{d.nbytes / 1e6:.2f}",
                         "ciera" if d.compress else "plain", f"{d.t_plain * 1e6:.1f}",
                         f"{d.t_ciera * 1e6:.1f}", str(count)])
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.ljust(w) if i < 2 or i == 3 else x.rjust(w)  # noqa: E731
                              for i, (x, w) in enumerate(zip(r, widths)))
    print(fmt(head))
    print(fmt(["-" * w for w in widths]))
    for r in rows:
        print(fmt(r))
    s = summarize(decisions)
    print(f"\n{s['compressed']} of {s['tensors']} tensors compressed "
          f"({s['bytes_compressed'] / 1e9:.2f} of {s['bytes_total'] / 1e9:.2f} GB)")
    print(f"gather time per pass (all tensors, one gather each): plain {s['t_plain_s'] * 1e3:.2f} ms,"
          f" planned {s['t_planned_s'] * 1e3:.2f} ms ({s['speedup']:.2f}x)")
    print(f"predicted saving per step (forward gather + backward re-gather): "
          f"{s['saving_per_step_s'] * 1e3:.2f} ms")
    if args.json:
        out = {"config": cfg.name, "gpus": args.gpus, "profile": profile.name, "summary": s,
               "decisions": [{"name": d.name, "layer": d.layer, "kind": d.kind,
                              "shape": list(d.shape), "bytes": d.nbytes,
                              "compress": d.compress, "t_plain_s": d.t_plain,
                              "t_ciera_s": d.t_ciera, "reason": d.reason} for d in decisions]}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0

"""Plan each tensor's gather mode (plain, exponent, word) under a GPU's memory, and show the cost."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ciera_jax.cli import cluster_flags
from ciera_jax.planning import clusters
from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning.shapes import get_config
from ciera_jax.planning.traces import PHASES, default_word_trace, load_trace, load_word_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    cluster_flags.add_config(p)
    p.add_argument("--gpus", type=int, default=None, help="ranks on the fsdp axis (default: "
                   "the cluster name's count, else 16)")
    cluster_flags.add_cluster(p)
    p.add_argument("--profile", default=None,
                   help="price the gathers on one flat link instead of the cluster: a "
                        "built-in profile name or a JSON file from `ciera calibrate`")
    p.add_argument("--memory-gb", default=None,
                   help="device memory per GPU in GB (1e9 bytes) to plan within (default: the "
                        "profile's memory_gb; unlimited if it has none); 'inf' for unlimited")
    p.add_argument("--tokens-per-gpu", type=int, default=4096,
                   help="tokens per GPU per step, for the activation estimate")
    p.add_argument("--remat", default="full",
                   choices=("full", "save_dot_except_mlp", "none"),
                   help="what the layer scan saves for the backward (ciera train --remat); "
                        "the activations the memory model counts")
    p.add_argument("--change-rate", type=float, default=None,
                   help="exponent change rate per step for every tensor "
                        "(default: the shipped per-kind trace)")
    p.add_argument("--trace", default=None, help="exponent trace JSON / metrics JSONL instead")
    p.add_argument("--word-trace", default=None, help="word-mode trace JSON (default: shipped)")
    p.add_argument("--phase", choices=PHASES, default="steady",
                   help="training phase whose word-mode bytes per weight to plan for")
    p.add_argument("--json", default=None, help="also write every decision here")


def _memory_gb(text, profile):
    if text is None:
        return profile.memory_gb
    if str(text).strip().lower() in ("inf", "unlimited", "none"):
        return None
    try:
        gb = float(text)
    except ValueError:
        raise ValueError(f"--memory-gb must be a number of GB or 'inf', got {text!r}") from None
    if not gb > 0:
        raise ValueError(f"--memory-gb must be a positive number of GB (or 'inf'), got {text}")
    return gb


def _row_groups(choices):
    """Globals, then one representative of each distinct layer structure with its count."""
    globals_ = [c for c in choices if c.layer is None]
    by_layer: dict[int, list] = {}
    for c in choices:
        if c.layer is not None:
            by_layer.setdefault(c.layer, []).append(c)
    sigs: dict[tuple, list[int]] = {}
    for l, cs in by_layer.items():
        sigs.setdefault(tuple((c.name, c.shape, c.mode) for c in cs), []).append(l)
    groups = [("global", globals_, 1)]
    for layers in sigs.values():
        span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
        groups.append((f"layers {span} (each)", by_layer[layers[0]], len(layers)))
    return groups


def _table(head, rows, left=2):
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.ljust(w) if i < left else x.rjust(w)  # noqa: E731
                              for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: they load JAX and Flax, and building the `ciera` parser
    # (which imports this module) must not.
    from ciera_jax.planning import memory
    from ciera_jax.runtime.outputs import check_output_file
    from ciera_jax.planning.planner import (HEADROOM_GB, cache_budget, fit_advice, modes_summary,
                                            plan_model_modes)

    if args.json:
        check_output_file(args.json, "--json")
    cfg, profile, trace, word, gb = _inputs(args)
    advice = fit_advice(cfg, args.gpus, gb, args.tokens_per_gpu, args.remat)
    if advice:
        print(advice)
    base = memory.memory_per_gpu(cfg, args.gpus, tokens_per_gpu=args.tokens_per_gpu,
                                 remat=args.remat)
    budget = cache_budget(gb, base, f" of {cfg.name} on {args.gpus} GPUs",
                          headroom_gb=HEADROOM_GB)
    plan = plan_model_modes(cfg, args.gpus, profile, budget, trace, word, args.phase)
    free = plan_model_modes(cfg, args.gpus, profile, None, trace, word, args.phase)
    modes = {(c.layer, c.name): c.mode for c in plan}
    mem = memory.memory_per_gpu(cfg, args.gpus, modes, tokens_per_gpu=args.tokens_per_gpu,
                                remat=args.remat)

    print(f"{cfg.name} on {args.gpus} ranks, {_link_words(profile, args)}; "
          f"{cm.codec_source(profile)}; memory "
          + ("unlimited" if gb is None else f"{gb:g} GB per GPU")
          + f", word mode at {word.bpw('default', args.phase):.2f} B/weight ({args.phase})")
    _print_tensors(plan)
    print()
    unit, scale = ("GB", 1e9) if mem.total >= 1e9 else ("MB", 1e6)  # decimal, as profiles
    print(_table(["memory per GPU", unit], [[k, f"{v / scale:.2f}"] for k, v in mem.rows()],
                 left=1))
    s, u = modes_summary(plan), modes_summary(free)
    print()
    _print_summary(s, u, budget)
    if args.json:
        out = {"config": cfg.name, "gpus": args.gpus,
               "profile": args.profile or f"{args.gpus}x{clusters.parse(args.cluster)[0].name}",
               "memory_gb": gb, "cache_budget_bytes": budget, "phase": args.phase,
               "memory": mem.to_json(), "summary": s, "summary_unlimited": u,
               "decisions": [_decision(c) for c in plan]}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.profile is None:
        print(cluster_flags.prediction(cfg, args.gpus, args.cluster, args.codec,
                                       args.tokens_per_gpu or 4096, remat=args.remat).line())
    else:
        print("(no step prediction: --profile prices the gathers on one link; name a "
              "--cluster for the step)")
    return 0


def _link_words(link, args) -> str:
    """The link the gathers are priced on, in words."""
    if args.profile is not None:
        return (f"profile {link.name} (alpha {link.alpha_s * 1e6:g} us, "
                f"beta {link.beta_Bps / 1e9:g} GB/s)")
    spec, _ = clusters.parse(args.cluster)
    return f"cluster {clusters.describe(spec, args.gpus)} ({args.gpus}x{spec.name})"


def _inputs(args: argparse.Namespace) -> tuple:
    """``(config, profile, trace, word trace, memory GB)`` from the flags, each checked."""
    cfg = get_config(args.config)
    spec, args.gpus = clusters.parse(args.cluster, args.gpus)
    args.gpus = 16 if args.gpus is None else args.gpus
    if args.gpus < 1:
        raise ValueError("--gpus must be positive")
    if args.tokens_per_gpu < 0:
        raise ValueError("--tokens-per-gpu must be non-negative")
    profile = (links.Profile.load(args.profile) if args.profile is not None
               else clusters.link(spec, args.codec))
    if args.change_rate is not None:
        if not 0.0 <= args.change_rate <= 1.0:
            raise ValueError("--change-rate must be in [0, 1]")
        trace = args.change_rate
    else:
        trace = load_trace(args.trace) if args.trace else None
    word = load_word_trace(args.word_trace) if args.word_trace else default_word_trace()
    return cfg, profile, trace, word, _memory_gb(args.memory_gb, profile)


def _print_tensors(plan) -> None:
    """The plan per tensor: one row per global tensor and per tensor of each layer structure."""
    head = ["tensor", "shape", "bf16 MB", "mode", "cache MB/GPU", "plain ms/step",
            "planned ms/step", "layers"]
    rows = []
    for title, cs, count in _row_groups(plan):
        rows.append([f"[{title}]"] + [""] * 7)
        for c in cs:
            rows.append([c.name, "x".join(map(str, c.shape)), f"{c.nbytes / 1e6:.2f}", c.mode,
                         f"{c.cache_bytes / 1e6:.2f}", f"{c.options['plain'][1] * 1e3:.3f}",
                         f"{c.step_s * 1e3:.3f}", str(count)])
    print(_table(head, rows, left=2))
    print("(ms/step: the tensor's communication in one step as `ciera train` runs it, "
          "isolated: plain and exponent gather forward + backward, word once (the backward "
          "reads its cache), and each reduce-scatters its gradient once; norms are "
          "replicated, not gathered)")


def _print_summary(s: dict, u: dict, budget) -> None:
    """The plan's totals (``s``) beside those with unlimited memory (``u``)."""
    print("tensors by mode: " + ", ".join(f"{m} {n}" for m, n in s["tensors_by_mode"].items()))
    print("cache budget per GPU: " + ("unlimited" if budget is None
                                      else f"{budget / 1e9:.2f} GB")
          + f"; used {s['cache_bytes'] / 1e9:.2f} GB")
    print(f"communication per step (gathers + gradient reduce-scatter): plain "
          f"{s['gather_plain_s'] * 1e3:.2f} ms; "
          f"planned within budget {s['gather_planned_s'] * 1e3:.2f} ms "
          f"({s['gather_speedup']:.2f}x, cache {s['cache_bytes'] / 1e9:.2f} GB/GPU); "
          f"unlimited memory {u['gather_planned_s'] * 1e3:.2f} ms "
          f"({u['gather_speedup']:.2f}x, cache {u['cache_bytes'] / 1e9:.2f} GB/GPU)")
    print(f"predicted saving per step: {s['saving_per_step_s'] * 1e3:.2f} ms")
    if budget == 0:
        print("no memory left for caches: every tensor plain")


def _decision(c) -> dict:
    """One tensor's decision as ``--json`` writes it."""
    return {"name": c.name, "layer": c.layer, "kind": c.kind, "shape": list(c.shape),
            "mode": c.mode, "cache_bytes": c.cache_bytes,
            "plain_s_per_step": c.options["plain"][1], "planned_s_per_step": c.step_s,
            "options": {m: {"cache_bytes": b, "s_per_step": t}
                        for m, (b, t) in c.options.items()}}

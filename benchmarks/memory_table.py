"""Which CIERA mode fits on which GPU: memory per GPU and the best plan that fits, by scale.

    python benchmarks/memory_table.py [--out results/memory_table.json] [--tokens-per-gpu 4096]
        [--remat full|save_dot_except_mlp|none]

For olmoe-1b-7b, qwen1.5-moe-a2.7b, deepseek-moe-16b and mixtral-8x7b on 16, 128 and 1024 GPUs
of H100-80GB and H200-141GB (clusters of 8 GPUs per NVLink node on 400G InfiniBand): the FSDP
training state per GPU (float32 params, AdamW moments, gradients: shrinks with the GPU count),
the transient gathered layers and activations (the memory model's estimates, per remat policy),
what a cache of every gathered tensor costs per GPU in exponent mode (1 B/param) and word mode
(2 B/param; does not shrink), the memory left for caches (less the planner's headroom, as
``ciera plan`` and ``--cache auto`` leave it), the budgeted planner's best plan within it (per tensor plain /
exponent / word) and its simulated step-time speedup over plain FSDP and over the equal-memory
baseline (plain FSDP that keeps the gathered weights for the backward: 2 B/param, marked when
it does not fit either). Prints a markdown table (docs/planning.md, "Memory") and writes JSON.
"""

from __future__ import annotations

import sys

from common import parser, write_results  # benchmarks/common.py, beside this script

CONFIGS = ("olmoe-1b-7b", "qwen1.5-moe-a2.7b", "deepseek-moe-16b", "mixtral-8x7b")
GPUS = (16, 128, 1024)
CLUSTERS = {"H100-80GB": "h100", "H200-141GB": "h200"}


def one(cfg, N: int, cluster, tokens: int, trace, word, remat: str = "full") -> dict:
    """Memory and the best plan that fits for one config, GPU count and cluster."""
    from ciera_jax.planning import memory
    from ciera_jax.planning.planner import modes_summary
    from ciera_jax.sim import simulate_step
    from ciera_jax.sim.step import plan_within_memory

    fit = plan_within_memory(cfg, N, cluster, tokens, trace, word, remat=remat)
    full = {m: memory.memory_per_gpu(cfg, N, m, tokens_per_gpu=tokens).cache
            for m in ("exponent", "word")}
    row = {"config": cfg.name, "gpus": N, "gpu": cluster.name,
           "memory_gb": cluster.topology.memory_gb, "memory": fit.base.to_json(),
           "full_cache_bytes": full}
    if fit.plan is None:
        return {**row, "fits": False, "reason": fit.reason}
    budget, modes = fit.budget, fit.modes
    sim = {m: simulate_step(cfg, N, cluster, m, tokens, trace, word_trace=word)
           for m in ("plain", "plain-noreshard")}
    best = simulate_step(cfg, N, cluster, tokens_per_gpu=tokens, trace=trace, word_trace=word,
                         plan=modes)
    held = sim["plain-noreshard"].extra_memory_bytes
    return {**row, "fits": True, "cache_budget_bytes": budget,
            "plan": modes_summary(fit.plan)["tensors_by_mode"],
            "plan_cache_bytes": best.extra_memory_bytes,
            "step_s": {"plain": sim["plain"].step_s,
                       "plain-noreshard": sim["plain-noreshard"].step_s, "plan": best.step_s},
            "speedup_over_plain": sim["plain"].step_s / best.step_s,
            "speedup_over_equal_memory": sim["plain-noreshard"].step_s / best.step_s,
            "equal_memory_fits": held <= budget, "no_cache": not modes}


def markdown(rows: list[dict]) -> str:
    gb = lambda b: f"{b / 1e9:.1f}"  # noqa: E731
    lines = ["| model | GPUs | GPU | state GB/GPU | transient + activations GB | exponent cache "
             "GB | word cache GB | left for caches GB | best plan that fits (tensors) | "
             "x plain FSDP | x equal-memory baseline |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        m = r["memory"]
        head = (f"| {r['config']} | {r['gpus']} | {r['gpu']} | {gb(m['state'])} | "
                f"{gb(m['gathered'] + m['activations'])} | {gb(r['full_cache_bytes']['exponent'])}"
                f" | {gb(r['full_cache_bytes']['word'])} | ")
        if not r["fits"]:
            why = r["reason"] if "without caches" in r["reason"] else "state does not fit"
            lines.append(head + f"step does not fit: {why} | - | - | - |")
            continue
        p = r["plan"]
        plan = ("none: no memory left for a cache" if r["no_cache"] else
                ", ".join(f"{k} {v}" for k, v in p.items() if v)
                + f" ({gb(r['plan_cache_bytes'])} GB)")
        eq = f"{r['speedup_over_equal_memory']:.2f}" + ("" if r["equal_memory_fits"]
                                                        else " (baseline does not fit)")
        lines.append(head + f"{gb(r['cache_budget_bytes'])} | {plan} | "
                     f"{r['speedup_over_plain']:.2f} | {eq} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "memory_table")
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--remat", default="full",
                   choices=("full", "save_dot_except_mlp", "none"),
                   help="the layer scan's remat policy, as ciera train --remat (default: full)")
    a = p.parse_args(argv)
    from ciera_jax.planning.shapes import get_config
    from ciera_jax.sim import default_trace, default_word_trace, get_cluster

    trace, word = default_trace(), default_word_trace()
    rows = []
    for name in CONFIGS:
        for N in GPUS:
            for gpu, cl in CLUSTERS.items():
                cluster = get_cluster(cl)
                r = one(get_config(name), N, cluster, a.tokens_per_gpu, trace, word,
                        remat=a.remat)
                rows.append({**r, "gpu": gpu})
    table = markdown(rows)
    none = [f"{r['config']} x {r['gpus']} x {r['gpu']}" + ("" if r["fits"] else " (step)")
            for r in rows if not r["fits"] or r["no_cache"]]
    print(table)
    print("\nNo cache fits ((step): nor the step without one): " + ("; ".join(none) if none else "none"))
    print(f"\n{a.tokens_per_gpu} tokens/GPU, --remat {a.remat}, word mode at {word.bpw('default'):.3f} B/weight "
          f"(steady), exponent mode at the measured change rates; speedups: simulated step time")
    write_results(a.out, {"rows": rows, "markdown": table, "no_cache": none,
                          "tokens_per_gpu": a.tokens_per_gpu, "remat": a.remat,
                          "word_trace": word.to_json(),
                          "trace": trace.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

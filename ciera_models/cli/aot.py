"""Compile the train step for a GPU cluster without a GPU, and report the program it would run.

``ciera aot --config olmoe-1b-7b --cluster 16xh100-ib400 --compare plain`` builds the trainer
on a compile-only mesh of 16 H100s (hosts of 8), lowers its step from abstract state (nothing
is allocated) and compiles it with XLA:GPU and the FSDP flags GPU users run. It prints compile
time, HLO size, kernels, conditionals, every collective (bytes, in a conditional branch or not,
what is scheduled between its start and its done) and XLA's memory per GPU against the GPU's
memory, beside the plan and memory model the trainer used, and ends with the step prediction ``ciera plan`` and ``ciera
simulate`` make for the same cluster (:mod:`ciera_jax.sim.predict`). Needs the CUDA plugin equal to the
installed jaxlib (``pip install -e ".[gpu-aot]"``). How to read it: docs/aot.md.

``ciera aot --gather-shape 16,2048,1024 --axis 1 --mode word --gpus 8`` compiles one gather
instead (:mod:`ciera_models.aot.gather_cost`): its kernels, their HBM bytes, the launch floor
and the roofline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ciera_jax.cli import cluster_flags
from ciera_jax.planning import clusters
from ciera_jax.runtime.units import fmt_bytes
from ciera_models.train.config import TrainConfig, add_fields, from_args

GB = 1e9


def _size(b: float) -> str:
    return fmt_bytes(b) if abs(b) < 0.1 * GB else f"{b / GB:.1f} GB"


def _limit(r: dict) -> str:
    lim = r.get("scheduler_limit")
    if not lim:
        return "-"
    return f"{lim['slop_percent']}%: {_size(lim['io'])} + {_size(lim['bytes'])}"


def _other(r: dict) -> str:
    """The compile that was not kept (memory limit auto): its slop, total and overlap."""
    o = r.get("scheduler_limit", {}).get("other")
    if not o:
        return "-"
    return (f"{o['slop_percent']}%: {_size(o['total'])}, "
            f"{100 * o['all_gather_overlap_share']:.0f}% overlapped")


def _compile_runs(r: dict) -> dict[str, str]:
    """With ``--repeat``: a row of every compile's wall seconds (the compile row is the
    fastest)."""
    walls = [c["wall_s"] for c in r.get("compile_runs", [])]
    if len(walls) < 2:
        return {}
    return {f"  each of {len(walls)} compiles (fastest above)":
            ", ".join(f"{w:.1f}" for w in walls) + " s"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the cluster")
    g.add_argument("--gpus", type=int, default=None, help="GPUs on the fsdp axis, hosts of 8 "
                   "(default: the cluster name's count, else 16)")
    cluster_flags.add_cluster(g)
    g.add_argument("--gpu", default=None, help="the target GPU alone (h100-80gb, h200-141gb): "
                   "deprecated, use --cluster")
    g.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens each GPU trains "
                   "on per step; the global batch follows (default: 4096)")
    g.add_argument("--compare", choices=("plain",), default=None,
                   help="also compile --gather plain and print the two side by side")
    g.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="compile each program N times, alternating between them with "
                   "--compare; the compile row shows the fastest (on a shared machine, the "
                   "least disturbed) and the JSON keeps every time (default: 1)")
    g.add_argument("--modules", action="store_true",
                   help="also count the kernels XLA:GPU compiles (a PTX module each: what the "
                   "compile time follows), in one more compile of each program that dumps them")
    g.add_argument("--phases", action="store_true",
                   help="also time the XLA:GPU compile's phases (HLO passes, priority fusion, "
                   "LLVM and PTX) from XLA's own trace events, in one more compile of each "
                   "program under JAX's profiler")
    g.add_argument("--temporaries", type=int, default=0, metavar="N",
                   help="also list the N largest of XLA's temporaries (slots of its "
                   "preallocated temp buffer, with the instructions that share each), from one "
                   "more compile of each program that dumps its buffer assignment (default: 0)")
    g.add_argument("--program", choices=("steady", "priming"), default="steady",
                   help="which of the trainer's programs: steady (every compressed gather's "
                   "escape section fixed at the rung that holds the steady-state demand: 1/8 "
                   "of a word tensor's elements escaping, 1/512 of an exponent tensor's "
                   "exponents changing; the program a run starts with) or priming (every "
                   "gather plain) (default: steady)")
    g.add_argument("--step", metavar="MODULE:FUNCTION", default=None,
                   help="compile your own train step instead of the trainer's: FUNCTION(mesh) "
                   "in an importable MODULE returns (step, abstract arguments) on the "
                   "compile-only mesh it gets (docs/aot.md); reports its kernels, the "
                   "conditionals a step executes (weighted by loop trips), all-gathers in "
                   "branches, overlap and memory")
    one = p.add_argument_group("one gather instead of the step (its GPU cost: kernels, HBM "
                               "bytes, launch floor, roofline)")
    one.add_argument("--gather-shape", metavar="D,D,...", default=None,
                     help="compile one bf16 gather of this global shape, e.g. 16,2048,1024, "
                     "as `ciera train` runs it (plain; encode + exchange at the steady rung, "
                     "with --fallback's structure)")
    one.add_argument("--axis", type=int, default=0, help="its gather axis (default: 0)")
    one.add_argument("--mode", choices=("all", "plain", "exponent", "word"), default="all",
                     help="which gather (default: all three)")
    one.add_argument("--kernels", action="store_true", help="also list every kernel")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", default=None, help="write the report(s) as JSON")
    out.add_argument("--hlo-out", metavar="DIR", default=None,
                     help="write each compiled program's scheduled HLO text here")
    out.add_argument("--collectives", action="store_true",
                     help="list every collective, not only the counts")
    add_fields(p.add_argument_group("what to train (the trainer's flags)"), TrainConfig)
    p.set_defaults(config="olmoe-1b-7b")


def run(args) -> int:
    from ciera_jax.runtime import gpu_targets, outputs

    gpu_targets.prepare_environment()  # before JAX starts its backends
    target, spec = cluster_of(args)
    gpu_targets.check_cluster(args.gpus)
    if args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat}: compile each program at least once")
    if args.temporaries < 0:
        raise ValueError(f"--temporaries {args.temporaries}: list none (0) or more")
    if args.json:
        outputs.check_output_file(args.json, "--json")
    if args.step:
        return _run_user_step(args, target)
    if args.gather_shape is not None:
        return run_gather(args, target)
    tc = from_args(TrainConfig, args)
    if tc.profile is None:  # the trainer plans on the cluster's links, as the prediction prices
        tc = dataclasses.replace(tc, profile=f"{args.gpus}x{spec.name}")
    if tc.schedule_steps is None:  # the cosine horizon is a constant of the step: any will do
        tc = dataclasses.replace(tc, schedule_steps=TrainConfig.schedule_steps)
    from ciera_models.model import configs

    configs.get_config(tc.config)  # unknown config: one line with the choices
    from ciera_models.aot.compile import batch_for, compile_repeated

    batch_for(tc, args.gpus, args.tokens_per_gpu)  # a batch that does not divide: one line

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    runs = [tc] + ([dataclasses.replace(tc, gather="plain")] if args.compare else [])
    reports = compile_repeated(runs, target, args.gpus, args.tokens_per_gpu, args.repeat,
                               args.hlo_out, log, program=args.program, modules=args.modules,
                               phases=args.phases, temporaries=args.temporaries)
    print(render(reports, target, show_collectives=args.collectives))
    pred = prediction(args, spec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": dataclasses.asdict(target), "reports": reports,
                       "prediction": pred.to_json()}, f, indent=1)
    print(f"compiled: {100 * reports[0]['all_gather_overlap_share']:.0f}% of the all-gather "
          "bytes overlap other work (the model prefetches one layer ahead)")
    print(pred.line())
    return 0


def cluster_of(args) -> tuple:
    """``(compile target, cluster)`` from ``--cluster`` (or the deprecated ``--gpu``); sets
    ``args.gpus`` from the cluster name's count where ``--gpus`` is not given."""
    from ciera_jax.runtime import gpu_targets

    if args.gpu is not None:
        target = gpu_targets.get_target(args.gpu)
        print("note: --gpu is deprecated; use --cluster", file=sys.stderr)
        spec = next(c for c in clusters.CLUSTERS.values() if c.gpu == target.name)
        args.gpus = 16 if args.gpus is None else args.gpus
        return target, spec
    spec, gpus = clusters.parse(args.cluster, args.gpus)
    args.gpus = 16 if gpus is None else gpus
    return gpu_targets.get_target(spec.gpu), spec


def prediction(args, spec):
    """The step prediction for this run's model and cluster: ``ciera plan``'s and ``ciera
    simulate``'s."""
    return cluster_flags.prediction(args.config, args.gpus, spec.name, args.codec,
                                    args.tokens_per_gpu, remat=args.remat)


def run_gather(args, target) -> int:
    """``--gather-shape``: one gather's GPU cost per mode, a table and ``--json``."""
    from ciera_models.aot import gather_cost

    try:
        shape = tuple(int(d) for d in args.gather_shape.split(","))
    except ValueError:
        raise ValueError(f"--gather-shape {args.gather_shape!r}: give integers separated by "
                         "commas, e.g. 16,2048,1024") from None
    modes = gather_cost.MODES if args.mode == "all" else (args.mode,)
    for mode in modes:
        gather_cost.check_gather(shape, args.axis, args.gpus, mode)
    if args.hlo_out:
        from pathlib import Path
        Path(args.hlo_out).mkdir(parents=True, exist_ok=True)
    reports = [gather_cost.gather_cost(m, shape, args.axis, args.gpus, target, args.hlo_out,
                                       fallback=args.fallback)
               for m in modes]
    print(gather_cost.render(reports, kernels=args.kernels))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": dataclasses.asdict(target), "gathers": reports}, f, indent=1)
    return 0


def _phase_rows(p: dict | None) -> dict[str, str]:
    """``--phases``: the compile's phases, from XLA's trace events in a compile of their own."""
    if p is None:
        return {}
    seconds = lambda k: f"{p[k]:.1f} s" if k in p else "-"  # noqa: E731
    return {"  phases (a profiled compile): HLO passes": seconds("hlo_passes_s"),
            "    of which priority fusion": seconds("priority_fusion_s"),
            "  LLVM and PTX, modules": f"{seconds('backend_s')}, {p.get('modules', '-')}"}


def summary_rows(r: dict) -> dict[str, str]:
    """The report's headline figures, by row name."""
    colls = r["collectives"]
    in_branch = [c for c in colls if c["in_branch"]]
    exposed = [c for c in colls if not c["in_branch"] and c["overlap"] in ("nothing", "sync")]
    mem, tr = r["memory"], r["trainer"]
    modes: dict[str, int] = {}
    for m in tr["cache_modes"].values():
        modes[m] = modes.get(m, 0) + 1
    return {
        "XLA:GPU compile (after lowering)": f"{r['compile_s']:.1f} s ({r['compile_cpu_s']:.1f} s CPU)",
        **_compile_runs(r),
        **_phase_rows(r.get("compile_phases")),
        "lowering": f"{r['lower_s']:.1f} s",
        "scheduled HLO": f"{r['hlo_bytes'] / 1e6:.2f} MB",
        "fusions (kernels)": f"{r['fusions']:,}",
        "  distinct (by XLA's deduplicated_name)": f"{r['distinct_fusions']:,}",
        **({"PTX modules (what the compile follows)": f"{r['ptx_modules']:,}"}
           if "ptx_modules" in r else {}),
        "custom calls": f"{r['custom_calls']:,}",
        "steady path per step: kernel launches": f"{r['steady_launches_per_step']:,}",
        "steady path per step: copies": f"{r['steady_copies_per_step']:,} ("
                                        f"{_size(r['steady_copy_bytes_per_step'])})",
        "conditionals": f"{r['conditionals']:,}" + (
            f" ({r['nested_conditionals']:,} inside another's branch)"
            if r.get("nested_conditionals") else ""),
        "collectives": f"{len(colls):,}",
        "  inside conditional branches": f"{len(in_branch)} ({sum(c['steady'] for c in in_branch)}"
                                         " on the steady path)",
        "  fallback-only (overflow, priming)": f"{sum(not c['steady'] for c in colls)}",
        "  outside, nothing between start and done": f"{len(exposed)}",
        "all-gather bytes overlapped (outside branches)":
            f"{100 * r['all_gather_overlap_share']:.0f}%",
        "XLA memory: arguments + temporaries": f"{_size(mem['argument'])} + "
                                               f"{_size(mem['temp'])}",
        "XLA memory: total per GPU": f"{_size(mem['total'])} of {_size(mem['memory_bytes'])} ("
                                     + ("fits" if mem["headroom"] >= 0 else "does NOT fit")
                                     + f", {mem['headroom'] / GB:+.1f} GB)",
        "XLA scheduler limit: inputs + temporaries": _limit(r),
        "  the other compile (not kept)": _other(r),
        "memory model total": _size(tr["memory_model"]["total"]),
        "caches per GPU": f"{_size(tr['cache_bytes'])} ("
                          + ", ".join(f"{n} {m}" for m, n in sorted(modes.items())) + ")",
        **_encode_rows(r.get("encode")),
    }


def _encode_rows(e: dict | None) -> dict[str, str]:
    """The encode program's rows (compiled once per run, beside the step programs)."""
    if e is None:
        return {}
    modules = f", {e['ptx_modules']:,} PTX modules" if "ptx_modules" in e else ""
    return {"encode program (once per run): compile": f"{e['compile_s']:.1f} s "
                                                       f"({e['compile_cpu_s']:.1f} s CPU)",
            "  its fusions": f"{e['fusions']:,} ({e['distinct_fusions']:,} distinct{modules})",
            "  its XLA memory total": _size(e["memory_total"])}


def ratio_line(a: dict, b: dict) -> str:
    """Report ``a`` against report ``b`` (ciera against plain): the step program's compile (and
    with each one's encode program, one after the other, when both compiled one), the kernels
    (PTX modules too when both counted them: what the compile follows), HLO and memory."""
    modules = (f", {a['ptx_modules'] / max(b['ptx_modules'], 1):.2f}x PTX modules"
               if "ptx_modules" in a and "ptx_modules" in b else "")
    both = ""
    if "encode" in a and "encode" in b:
        total = [r["compile_s"] + r["encode"]["compile_s"] for r in (a, b)]
        both = f"; step + encode program {total[0] / total[1]:.2f}x"
    return ("ratios (ciera / plain): "
            f"compile {a['compile_s'] / b['compile_s']:.2f}x "
            f"({a['compile_cpu_s'] / b['compile_cpu_s']:.2f}x CPU{both}), "
            f"fusions {a['fusions'] / max(b['fusions'], 1):.2f}x "
            f"({a['distinct_fusions'] / max(b['distinct_fusions'], 1):.2f}x distinct{modules}), "
            f"HLO {a['hlo_bytes'] / b['hlo_bytes']:.2f}x, "
            f"memory {a['memory']['total'] / b['memory']['total']:.2f}x")


def _temporary_lines(r: dict) -> list[str]:
    """``--temporaries``: the largest slots of XLA's temporary buffer, one line each."""
    if not r.get("temporaries"):
        return []
    lines = [f"largest temporaries ({r['gather']}): size, offset in the buffer, shape, the "
             "instructions that hold it"]
    for t in r["temporaries"]:
        held = ", ".join(t["values"][:3]) + (f" (+{len(t['values']) - 3})"
                                             if len(t["values"]) > 3 else "")
        lines.append(f"{_size(t['size']):>10} @{t['offset'] / GB:7.2f} GB  "
                     f"{t['shape'][:48]:<48}  {held}")
    return lines


def render(reports: list[dict], target, show_collectives: bool = False) -> str:
    from ciera_jax.runtime import gpu_targets

    r0 = reports[0]
    head = (f"{r0['config']} on {r0['gpus']} x {target.name} ({target.description}, "
            f"{target.memory_gb:.1f} GB, {r0['memory']['allocator'] / GB:.1f} GB of it JAX's "
            f"allocator's), {r0['tokens_per_gpu']} tokens per GPU, "
            f"batch {r0['batch'][0]}x{r0['batch'][1]}, --remat {r0['trainer']['remat']}, "
            f"attention {r0['trainer']['attention']}, experts {r0['trainer']['experts']}, "
            f"the {r0.get('program', 'steady')} program")
    cols = [summary_rows(r) for r in reports]
    names = [f"--gather {r['gather']}" for r in reports]
    width = max(len(k) for k in cols[0])
    lines = [head, "XLA flags: " + (" ".join(f"--{k}={v}" for k, v in r0["flags"].items()
                                             if k != gpu_targets.SLOP_FLAG) or "defaults"),
             "", f"{'':<{width}}  " + "  ".join(f"{n:>28}" for n in names)]
    for k in cols[0]:
        lines.append(f"{k:<{width}}  " + "  ".join(f"{c[k]:>28}" for c in cols))
    if len(reports) == 2:
        lines += ["", ratio_line(*reports)]
    for r in reports:
        lines += ["", f"plan ({r['gather']}): {r['trainer']['plan']}"]
        lines += _temporary_lines(r)
        if show_collectives:
            lines.append(f"{'kind':<16}{'MB':>9}{'runs':>6}  {'branch':<7}{'overlap':<9}source")
            for c in r["collectives"]:
                src = c["sources"][0] if c["sources"] else "-"
                lines.append(f"{c['kind']:<16}{c['bytes'] / 1e6:>9.2f}{c['runs']:>6}  "
                             f"{'yes' if c['in_branch'] else 'no':<7}{c['overlap']:<9}{src}")
    return "\n".join(lines)


def _run_user_step(args, target) -> int:
    """``--step``: the user's step compiled and reported (:mod:`ciera_models.aot.user_step`)."""
    from ciera_models.aot.user_step import REPORT_KEYS, compile_user_step, load_builder

    sys.path.insert(0, ".")  # a module beside the caller, as ``python -m`` would find it
    report = compile_user_step(load_builder(args.step), args.gpus, target.name, args.xla_flags,
                               None)
    for key in REPORT_KEYS:
        value = report.get(key)
        if key == "memory":
            value = f"{_size(value['total'])} of {_size(value['capacity'])}"
        elif isinstance(value, float):
            value = f"{value:.3f}"
        print(f"{key:32s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0

"""What one gather costs a GPU: its kernels and their HBM bytes, compiled for GPUs that are not
there (``ciera aot --gather-shape``, ``benchmarks/gather_cost.py``).

One tensor, gathered over ``gpus`` target GPUs as ``ciera train`` gathers it: plain (the bits
of the shard, gathered), or compressed in the trainer's two programs, the encode (run ahead, at
the end of the previous step) and the step's exchange at a fixed rung (the steady program's:
the rung holding the steady-state demand of :mod:`~ciera_jax.loop.rungs`), self-check
on, its stats packed as a train step packs what it reads of them, the cache donated as a train
step donates its caches. ``fallback`` as ``ciera train --fallback``: on GPUs (``auto``) a
``program`` whose rung holds the demand (no fallback, no conditional), or a ``branch``: a
fallback conditional, word mode with its overflow rungs. Each program is compiled by XLA:GPU
with the FSDP flags; the report lists the kernels on its steady path
(:mod:`~ciera_models.aot.kernel_list`: the fallback's branches left out) with their bytes, and
the launch floor and the roofline.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.collective import OVERFLOW_RUNGS, ExponentWire, WordWire, lowering_for, transfer
from ciera_jax.collective import capacity
from ciera_jax.collective.cache import init_cache
from ciera_jax.collective import gather as collective
from ciera_jax.runtime import gpu_targets
from ciera_models.aot import kernel_list, schedule
from ciera_jax.loop import rungs
from ciera_models.train.config import FALLBACKS

MODES = ("plain", "exponent", "word")
AXIS = "fsdp"
# The exchange's stats a train step reads (``ciera_jax.fsdp``'s gather), packed as it packs
# them: one int32 vector per tensor. The others are dead code in a step, and returned as
# scalars each would be an output buffer of its own (a kernel, or a copy of a constant).
TRAIN_STATS = ("sent_bytes", "plain_bytes", "changed", "rung", "fallback", "verify_failed")


def check_gather(shape: tuple[int, ...], axis: int, gpus: int, mode: str) -> None:
    """One-line errors before anything compiles."""
    if mode not in MODES:
        raise ValueError(f"--mode {mode}: choose one of {', '.join(MODES)}")
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"--gather-shape {shape}: give positive dimensions, e.g. 16,2048,1024")
    if not 0 <= axis < len(shape):
        raise ValueError(f"--axis {axis}: the shape {shape} has axes 0..{len(shape) - 1}")
    if shape[axis] % gpus:
        raise ValueError(f"--gather-shape {shape}: axis {axis} ({shape[axis]}) must divide "
                         f"among {gpus} GPUs")


def _lead(tree):  # one rank's encoded values as rows of a sharded array
    return jax.tree.map(lambda a: a[None], tree)


def _unlead(tree):
    return jax.tree.map(lambda a: a[0], tree)


def steady_rung(wire, fallback: str = "auto") -> tuple[int, int]:
    """(rung, overflow rungs) of the steady program ``ciera train`` compiles first."""
    rung = rungs.rungs_holding({"t": wire})["t"]
    branch = fallback == "branch"
    return rung, (OVERFLOW_RUNGS if branch and isinstance(wire, WordWire) else 0)


def lowered_programs(mode: str, shape, axis: int, mesh, dtype=jnp.bfloat16,
                     fallback: str = "auto") -> tuple[dict, dict]:
    """``({program name: lowered}, {"rung", "exits"})``: plain's one program, or a
    compressed gather's encode and exchange. Call inside :func:`lowering_for`."""
    if fallback not in FALLBACKS:
        raise ValueError(f"--fallback {fallback}: choose one of {', '.join(FALLBACKS)}")
    spec = P(*[AXIS if d == axis else None for d in range(len(shape))])
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    sm = lambda f, ins, outs, donate=(): jax.jit(jax.shard_map(  # noqa: E731
        f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False), donate_argnums=donate)
    if mode == "plain":
        gather = sm(lambda s: collective.plain_all_gather(s, AXIS, axis=axis), (spec,), P())
        return {"gather": gather.lower(x)}, {}
    cache = jax.eval_shape(lambda: init_cache(shape, dtype, mode=mode))
    cspec = jax.tree.map(lambda _: P(), cache)
    encode = sm(lambda s, c: _lead(collective.encode(s, c, AXIS, axis=axis)), (spec, cspec),
                P(AXIS))
    lowered_encode = encode.lower(x, cache)
    encoded = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                           lowered_encode.out_info)
    wire = encoded.wire
    rung, exits = steady_rung(wire, fallback)
    holds = fallback != "branch"  # the host runs a program whose rung holds the demand
    demand = jax.ShapeDtypeStruct(encoded.demand.shape, jnp.int32,
                                  sharding=NamedSharding(mesh, P()))
    needed = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))

    word = mode == "word"

    def exchange(s, e, c, d, n):
        full, new_cache, stats = collective.exchange(s, _unlead(e), c,
                                                     capacity.fix(d, rung, n, exits, holds),
                                                     AXIS)
        stats = train_stats(stats)
        # A word cache's words are the full tensor's bits: returned twice, one output would be
        # a copy of the other, which a train step (the tensor to its layer, the cache to the
        # next step) never makes.
        return (new_cache, stats) if word else (full, new_cache, stats)

    step = sm(exchange, (spec, P(AXIS), cspec, P(), P()),
              (cspec, P()) if word else (P(), cspec, P()), donate=(2,))
    ahead = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                        sharding=NamedSharding(mesh, P(AXIS))),
                         lowered_encode.out_info)
    return ({"encode": lowered_encode, "exchange": step.lower(x, ahead, cache, demand, needed)},
            {"rung": rung, "exits": exits})


def train_stats(stats: dict) -> jax.Array:
    """int32 (len(TRAIN_STATS),): the stats a train step reads, side by side."""
    return jnp.stack([jnp.asarray(stats[k]).astype(jnp.int32) for k in TRAIN_STATS])


def _fallback_computations(prog: schedule.Program) -> set[str]:
    """Computations holding a fallback's transfer (by the library function on its stack)."""
    return {c.computation for c in prog.collectives()
            if any(s.split(":")[-1] in transfer.FALLBACK_FUNCTIONS for s in c.sources)}


def program_cost(text: str, hbm_Bps: float) -> dict:
    """One compiled program's steady-path kernels and their totals."""
    prog = schedule.Program(text)
    kernels, conditionals = kernel_list.steady_kernels(prog, _fallback_computations(prog))
    return {**kernel_list.totals(kernels, hbm_Bps), "conditionals": conditionals,
            "kernel_list": [k.__dict__ for k in kernels]}


@gpu_targets.compile_only()
def gather_cost(mode: str, shape, axis: int, gpus: int, target: gpu_targets.GpuTarget,
                hlo_out: str | None = None, fallback: str = "auto") -> dict:
    """The cost report of one ``mode`` gather of a bf16 ``shape`` on ``axis`` over ``gpus`` x
    ``target``: per program and in all (``fallback``: as ``ciera train --fallback``)."""
    shape = tuple(shape)
    check_gather(shape, axis, gpus, mode)
    mesh = gpu_targets.compile_only_mesh(target, gpus)
    with lowering_for("cuda", capability=target.compute_capability):
        lowered, rung = lowered_programs(mode, shape, axis, mesh, fallback=fallback)
    programs = {}
    for name, lo in lowered.items():
        t = time.perf_counter()
        text = gpu_targets.compile_with(lo, gpu_targets.FSDP_XLA_FLAGS).as_text()
        programs[name] = {**program_cost(text, target.memory_bandwidth_Bps),
                          "compile_s": time.perf_counter() - t}
        if hlo_out:
            with open(f"{hlo_out}/gather-{mode}-{name}.hlo.txt", "w") as f:
                f.write(text)
    every = [kernel_list.Kernel(**k) for p in programs.values() for k in p["kernel_list"]]
    return {"mode": mode, "shape": list(shape), "axis": axis, "gpus": gpus, "gpu": target.name,
            "dtype": "bfloat16", "tensor_bytes": math.prod(shape) * 2, **rung,
            "fallback": "branch" if fallback == "branch" else "program",
            **kernel_list.totals(every, target.memory_bandwidth_Bps),
            "conditionals": sum(p["conditionals"] for p in programs.values()),
            "programs": programs}


def render(reports: list[dict], kernels: bool = False) -> str:
    """A table: one row per mode (and per program), and with ``kernels`` every kernel."""
    r0 = reports[0]
    lines = [f"one gather of bf16 {tuple(r0['shape'])} ({r0['tensor_bytes'] / 1e6:.0f} MB) on "
             f"axis {r0['axis']} over {r0['gpus']} x {r0['gpu']}, steady path (FSDP flags, "
             "self-check on; kernels: fusions, custom calls, copies, collectives)",
             f"{'mode':<10}{'program':<10}{'rung':>5}{'kernels':>8}{'HBM MB':>9}"
             f"{'floor us':>9}{'roofline us':>12}{'conds':>6}"]

    def row(mode, prog, rung, r):
        return (f"{mode:<10}{prog:<10}{rung:>5}{r['kernels']:>8}{r['bytes'] / 1e6:>9.1f}"
                f"{r['launch_floor_s'] * 1e6:>9.0f}{r['roofline_s'] * 1e6:>12.0f}"
                f"{r['conditionals']:>6}")

    for r in reports:
        rung = str(r.get("rung", "-")) + (f"+{r['exits']}" if r.get("exits") else "")
        lines.append(row(r["mode"], "all", rung, r))
        if len(r["programs"]) > 1:
            lines += [row("", name, "", p) for name, p in r["programs"].items()]
    if kernels:
        for r in reports:
            for name, p in r["programs"].items():
                lines += ["", f"{r['mode']} {name}: {'kind':<16}{'runs':>5}{'MB':>9}  source"]
                lines += [f"  {k['name'][:40]:<40} {k['kind']:<14}{k['runs']:>5}"
                          f"{k['bytes'] / 1e6:>9.2f}  {k['source']}" for k in p["kernel_list"]]
    return "\n".join(lines)

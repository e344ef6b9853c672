"""The train step a GPU pod would run, compiled here without a GPU (``ciera aot``).

The trainer is built on a compile-only mesh of the target cluster (``ciera_jax.runtime.
gpu_targets``), its step lowered from abstract state (``ShapeDtypeStruct`` with the trainer's
shardings: nothing is allocated) and compiled by XLA:GPU with the FSDP flags GPU users run.
The report reads the scheduled program (``ciera_models.aot.schedule``): kernels, conditionals,
every collective with what overlaps it, and XLA's memory count against the GPU's memory, beside
what the trainer's plan and the memory model said.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.collective import transfer
from ciera_jax.fsdp import AXIS
from ciera_jax.collective import lowering_for
from ciera_jax.runtime import gpu_targets, hlo
from ciera_models.aot import schedule
from ciera_models.train import memory_limit
from ciera_models.train.build import build_trainer
from ciera_models.train.state import placed_abstract
from ciera_models.train.step import AHEAD_SPECS


def batch_for(tc, gpus: int, tokens_per_gpu: int):
    """``tc`` with the global batch that gives each GPU ``tokens_per_gpu`` tokens."""
    per_gpu, rem = divmod(tokens_per_gpu, tc.length)
    if per_gpu < 1 or rem:
        raise ValueError(f"--tokens-per-gpu {tokens_per_gpu} must be a multiple of the "
                         f"sequence length {tc.length}")
    return dataclasses.replace(tc, batch_size=per_gpu * gpus)


def abstract_step_args(tr):
    """``(params, caches, opt_state, ahead, tokens)`` as the step takes them, all abstract."""
    mesh = tr.mesh
    params, caches, words = tr.encode_arguments()
    opt = placed_abstract(jax.eval_shape(tr.tx.init, params), tr.opt_specs, mesh)
    ahead = placed_abstract(jax.eval_shape(tr.prepare_fn, params, caches, words), AHEAD_SPECS,
                            mesh)
    # a batch holds seq_len + 1 tokens per sequence: inputs and their next tokens
    tokens = jax.ShapeDtypeStruct((tr.tc.batch_size, tr.tc.length + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P(AXIS)))
    return params, caches, opt, ahead, tokens


def encode_report(lowered, options: dict, modules: bool = False) -> dict:
    """The encode program (``prepare_fn``: compiled once per run, beside the step programs)
    compiled with the step's ``options``: its compile, kernels and XLA's memory count."""
    c = compile_lowered(lowered, options)
    return {"compile_s": c.wall_s, "compile_cpu_s": c.cpu_s, "hlo_bytes": len(c.text),
            "fusions": c.kernels["fusions"], "distinct_fusions": c.kernels["distinct_fusions"],
            "memory_total": c.total, "collectives": len(c.collectives),
            **({"ptx_modules": count_ptx_modules(lowered, options)} if modules else {})}


def _steady(c: schedule.Collective) -> bool:
    """On every step's path: not the fallback's (overflow, priming) plain rest."""
    return not any(s.split(":")[-1] in transfer.FALLBACK_FUNCTIONS for s in c.sources)


def _collective_row(c: schedule.Collective) -> dict:
    return {**dataclasses.asdict(c), "steady": _steady(c)}


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One XLA:GPU compile of the lowered step, and what the report reads of it."""

    options: dict
    text: str
    memory: Any  # compiled.memory_analysis()
    collectives: list
    kernels: dict
    wall_s: float
    cpu_s: float

    @property
    def total(self) -> int:
        return memory_limit.xla_total(self.memory)

    @property
    def overlap(self) -> float:
        return schedule.overlap_share(self.collectives)


@gpu_targets.compile_only()  # GPUs this process does not have
def compile_lowered(lowered, options: dict) -> CompiledStep:
    t, c = time.perf_counter(), time.process_time()
    compiled = gpu_targets.compile_with(lowered, options)
    # CPU seconds as well as wall: on a shared machine the wall clock is mostly the load
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    text = compiled.as_text()
    prog = schedule.Program(text)
    collectives = prog.collectives()
    # off the steady path: branches that hold the fallback's (overflow, priming) transfer
    per_step = prog.per_step({c.computation for c in collectives if not _steady(c)})
    kernels = {**prog.kernels(), **{f"steady_{k}_per_step": v for k, v in per_step.items()},
               # every path's, each weighted by its loops' trips: an upper bound of a step's
               "conditionals_per_step": prog.per_step(set())["conditionals"],
               "all_gathers_in_branches": sum(c.kind == "all-gather" and c.in_branch
                                              for c in collectives)}
    return CompiledStep(options, text, compiled.memory_analysis(), collectives, kernels, wall,
                     cpu)


def _limit_row(kept: CompiledStep, other: CompiledStep | None, memory_limit: str, io: int,
               target) -> dict:
    slop = kept.options.get(gpu_targets.SLOP_FLAG, gpu_targets.DEFAULT_SLOP_PERCENT)
    row = {"memory_limit": memory_limit, "slop_percent": slop, "io": io,
           "bytes": gpu_targets.scheduler_limit_bytes(target, io, slop)}
    if other is not None:  # the compile not kept, for the comparison
        row["other"] = {"slop_percent": other.options.get(gpu_targets.SLOP_FLAG,
                                                          gpu_targets.DEFAULT_SLOP_PERCENT),
                        "total": other.total, "all_gather_overlap_share": other.overlap,
                        "compile_cpu_s": other.cpu_s}
    return row


def count_ptx_modules(lowered, options: dict) -> int:
    """The kernels XLA:GPU compiles for ``lowered`` with ``options``: an LLVM module and a PTX
    assembly each, which is what its compile time follows (not the fusions XLA names alike,
    ``distinct_fusions``: ``docs/aot.md``). Counted in a compile of its own that dumps them
    (``xla_dump_to``: a ``*.ptx`` file each), since the dump's writing slows that compile."""
    return _dumped(lowered, options, lambda d: len(list(d.glob("*.ptx"))))


def largest_temporaries(lowered, options: dict, n: int) -> list[dict]:
    """The ``n`` largest slots of XLA:GPU's temporary buffer for ``lowered`` with ``options``
    (:func:`ciera_jax.runtime.hlo.temp_slots`), from a compile of its own that dumps its
    buffer assignment: what the memory count's temporaries are made of (the report's copies
    miss a fusion that copies, such as a whole stack's transpose)."""
    def read(d: Path) -> list[dict]:
        dumps = sorted(d.glob("*gpu_after_optimizations-buffer-assignment.txt"))
        if len(dumps) != 1:
            raise RuntimeError(f"expected one XLA:GPU buffer assignment dumped, found "
                               f"{len(dumps)}")
        return hlo.temp_slots(dumps[0].read_text())[:n]
    return _dumped(lowered, options, read)


@gpu_targets.compile_only()
def _dumped(lowered, options: dict, read):
    """``read`` (a folder) of what one more compile of ``lowered`` with ``options`` dumped
    (``xla_dump_to``), in a folder removed after."""
    with tempfile.TemporaryDirectory() as d:
        gpu_targets.compile_with(lowered, {**options, "xla_dump_to": d})
        return read(Path(d))


# XLA's own trace events for the phases of a GPU compile (JAX's profiler, XLA 0.10's names):
# the HLO passes, priority fusion among them, the backend (LLVM and PTX), and one event per
# kernel module compiled
PHASE_EVENTS = {"hlo_passes_s": "OptimizeHloModule", "priority_fusion_s": "priority-fusion",
                "backend_s": "CompileToBackendResult"}
MODULE_EVENT = "CompileSingleModule"


@gpu_targets.compile_only()
def compile_phases(lowered, options: dict) -> dict:
    """Where XLA:GPU's compile of ``lowered`` with ``options`` goes, from XLA's own trace
    events: one more compile under JAX's profiler (which slows it). Seconds per phase of
    :data:`PHASE_EVENTS` and the kernel modules compiled; a phase the trace lacks (another
    XLA's names) is left out, not reported as zero."""
    # an option that changes nothing XLA does (no dump folder: nothing dumps), so JAX compiles
    # again instead of handing back the executable these options already made
    options = {**options, "xla_dump_hlo_pass_re": ""}
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            gpu_targets.compile_with(lowered, options)
        (trace,) = Path(d).rglob("perfetto_trace.json.gz")
        return phases_of(json.loads(gzip.decompress(trace.read_bytes())))


def phases_of(trace: dict) -> dict:
    """:func:`compile_phases`' reading of one perfetto trace (``{"traceEvents": [...]}``)."""
    seconds: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X":
            seconds[e.get("name")] += e.get("dur", 0) / 1e6
            count[e.get("name")] += 1
    out = {key: seconds[name] for key, name in PHASE_EVENTS.items() if count[name]}
    if count[MODULE_EVENT]:
        out["modules"] = count[MODULE_EVENT]
    return out


@gpu_targets.compile_only()
def compile_repeated(tcs: list, target: gpu_targets.GpuTarget, gpus: int, tokens_per_gpu: int,
                     repeat: int, hlo_out: str | None = None, log=None,
                     program: str = "steady", modules: bool = False,
                     phases: bool = False, temporaries: int = 0) -> list[dict]:
    """:func:`compile_step` of each of ``tcs``, ``repeat`` times, alternating between them so
    the machine's other load falls on all alike. Each report is its first compile's, with
    ``compile_runs`` (every compile's ``wall_s`` and ``cpu_s``) and ``compile_s`` /
    ``compile_cpu_s`` those of its fastest: a compile's own cost, where the other load only
    ever adds. XLA's program is the same each time (each compile lowers again: JAX would
    otherwise hand back the executable it already has). ``modules``: the first compile's
    report also counts its PTX modules (:func:`count_ptx_modules`); ``phases``: and times its
    compile's phases (:func:`compile_phases`); ``temporaries``: and lists that many of its
    largest temporaries (:func:`largest_temporaries`)."""
    reports: list[dict] = []
    for attempt in range(repeat):
        for i, tc in enumerate(tcs):
            rep = compile_step(tc, target, gpus, tokens_per_gpu, hlo_out, log, program,
                               modules=modules and attempt == 0,
                               phases=phases and attempt == 0,
                               temporaries=temporaries if attempt == 0 else 0)
            if attempt == 0:
                reports.append({**rep, "compile_runs": []})
            elif rep["distinct_fusions"] != reports[i]["distinct_fusions"]:
                raise RuntimeError(f"ciera aot: the {tc.gather} step compiled to "
                                   f"{rep['distinct_fusions']} distinct fusion names, "
                                   f"{reports[i]['distinct_fusions']} the first time")
            reports[i]["compile_runs"].append({"wall_s": rep["compile_s"],
                                               "cpu_s": rep["compile_cpu_s"]})
    for rep in reports:
        fastest = min(rep["compile_runs"], key=lambda c: c["wall_s"])
        rep["compile_s"], rep["compile_cpu_s"] = fastest["wall_s"], fastest["cpu_s"]
    return reports


@gpu_targets.compile_only()
def compile_step(tc, target: gpu_targets.GpuTarget, gpus: int, tokens_per_gpu: int,
                 hlo_out: str | None = None, log=None, program: str = "steady",
                 modules: bool = False, phases: bool = False, temporaries: int = 0) -> dict:
    """Compile ``tc``'s train step for ``gpus`` x ``target`` and report the program
    (``program``: which of the trainer's programs, ``steady`` or ``priming``:
    :meth:`~ciera_models.train.state.Trainer.at_rungs`; XLA's scheduler limit as ``tc.memory_limit``
    says: :func:`ciera_models.train.memory_limit.compile_within`, as ``ciera train`` compiles)."""
    tc = batch_for(tc, gpus, tokens_per_gpu)
    # Plan within what JAX's allocator may hold of the target (this environment's share, as a
    # pod run's memory_stats report it), never a CPU device's memory.
    allocator = target.allocator_bytes()
    if tc.memory_gb is None:
        tc = dataclasses.replace(tc, memory_gb=allocator / 1e9)
    mesh = gpu_targets.compile_only_mesh(target, gpus)
    t0 = time.perf_counter()
    # The codec's kernels as impl="auto" picks them on the target GPU (Mosaic GPU on Hopper),
    # not as on this host's CPU (fused jnp): the program the pod would run.
    with lowering_for("cuda", capability=target.compute_capability):
        tr = build_trainer(tc, mesh)
        args = tr.at_rungs(abstract_step_args(tr), program)
        lowered = tr.step_fn.lower(*args)
        lowered_encode = tr.prepare_fn.lower(*tr.encode_arguments())
    t_lower = time.perf_counter() - t0
    model = memory_limit.model_memory(tr, tokens_per_gpu)
    limit = memory_limit.SchedulerLimit(target, memory_limit.per_gpu_bytes(args), model.total,
                                        memory_limit.room_bytes(target, tc.memory_gb))
    if log:
        log(f"ciera aot: {tc.gather} step of {tc.config} on {gpus} x {target.name}: lowered in "
            f"{t_lower:.1f} s, compiling with XLA:GPU ({tc.xla_flags} flags, memory limit "
            f"{tc.memory_limit})")
    options = functools.partial(gpu_targets.compiler_options, tc.xla_flags)
    kept, other = memory_limit.compile_within(
        limit, tc.memory_limit, lambda slop: compile_lowered(lowered, options(slop)),
        lambda c: c.total, log, who="ciera aot")
    text = kept.text
    if hlo_out:
        Path(hlo_out).mkdir(parents=True, exist_ok=True)
        (Path(hlo_out) / f"{tc.config}-{gpus}x{target.name}-{tc.gather}.hlo.txt").write_text(text)
    ma, xla_total = kept.memory, kept.total
    caches = jax.tree.leaves(args[1])
    report = {
        "config": tc.config, "gather": tc.gather, "cache": tc.cache, "plan": tc.plan,
        "program": program,
        "gpus": gpus, "gpu": target.name, "tokens_per_gpu": tokens_per_gpu,
        "batch": [tc.batch_size, tc.length], "flags": gpu_targets.for_this_xla(kept.options),
        "scheduler_limit": _limit_row(kept, other, tc.memory_limit, limit.io_bytes, target),
        "lower_s": t_lower, "compile_s": kept.wall_s, "compile_cpu_s": kept.cpu_s,
        "hlo_bytes": len(text),
        **kept.kernels,
        "collectives": [_collective_row(c) for c in kept.collectives],
        "all_gather_overlap_share": kept.overlap,
        "memory": {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
                   "alias": ma.alias_size_in_bytes, "temp": ma.temp_size_in_bytes,
                   "total": xla_total, "capacity": target.memory_bytes,
                   # what the step must fit in: the allocator's share, or --memory-gb
                   "allocator": allocator, "memory_bytes": limit.memory_bytes,
                   "headroom": limit.memory_bytes - xla_total},
        "trainer": {"plan": tr.plan_summary, "attention": tr.attention, "experts": tr.experts,
                    "remat": tr.tc.remat,
                    "cache_modes": dict(sorted(tr.cache_modes.items())),
                    "cache_bytes": sum(math.prod(c.shape) * c.dtype.itemsize for c in caches),
                    "memory_model": model.to_json()},
    }
    if modules:
        report["ptx_modules"] = count_ptx_modules(lowered, kept.options)
    if phases:
        report["compile_phases"] = compile_phases(lowered, kept.options)
    if temporaries:
        report["temporaries"] = largest_temporaries(lowered, kept.options, temporaries)
    report["encode"] = encode_report(lowered_encode, kept.options, modules)
    return report

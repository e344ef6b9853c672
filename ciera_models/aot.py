"""The train step a GPU pod would run, compiled here without a GPU (``ciera aot``).

The trainer is built on a compile-only mesh of the target cluster (``ciera_jax.runtime.
gpu_targets``), its step lowered from abstract state (``ShapeDtypeStruct`` with the trainer's
shardings: nothing is allocated) and compiled by XLA:GPU with the FSDP flags GPU users run.
The report reads the scheduled program (``ciera_jax.runtime.schedule``): kernels, conditionals,
every collective with what overlaps it, and XLA's memory count against the GPU's memory, beside
what the trainer's plan and the memory model said.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.collective import transfer
from ciera_jax.fsdp import AXIS
from ciera_jax.kernels.backend import lowering_for
from ciera_jax.planning import memory
from ciera_jax.runtime import gpu_targets, schedule
from ciera_models.plan_policy import NO_CACHE
from ciera_models.state import build_trainer, fresh_caches, is_spec
from ciera_models.step import AHEAD_SPECS


def batch_for(tc, gpus: int, tokens_per_gpu: int):
    """``tc`` with the global batch that gives each GPU ``tokens_per_gpu`` tokens."""
    per_gpu, rem = divmod(tokens_per_gpu, tc.length)
    if per_gpu < 1 or rem:
        raise ValueError(f"--tokens-per-gpu {tokens_per_gpu} must be a multiple of the "
                         f"sequence length {tc.length}")
    return dataclasses.replace(tc, batch_size=per_gpu * gpus)


def _placed(tree, specs, mesh):
    """Abstract arrays with the shardings ``specs`` (a prefix tree of PartitionSpecs)."""
    def one(spec, sub):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, spec)), sub)
    return jax.tree.map(one, specs, tree, is_leaf=is_spec)


def abstract_step_args(tr):
    """``(params, caches, opt_state, ahead, tokens)`` as the step takes them, all abstract."""
    mesh = tr.mesh
    params = _placed(tr.param_shapes, tr.param_specs, mesh)
    caches = _placed(jax.eval_shape(lambda: fresh_caches(tr.cache_shapes, tr.tensors,
                                                         tr.cache_modes)), P(), mesh)
    opt = _placed(jax.eval_shape(tr.tx.init, params), tr.opt_specs, mesh)
    ahead = _placed(jax.eval_shape(tr.prepare_fn, params, caches), AHEAD_SPECS, mesh)
    # a batch holds seq_len + 1 tokens per sequence: inputs and their next tokens
    tokens = jax.ShapeDtypeStruct((tr.tc.batch_size, tr.tc.length + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P(AXIS)))
    return params, caches, opt, ahead, tokens


def _steady(c: schedule.Collective) -> bool:
    """On every step's path: not the fallback's (overflow, priming) plain rest."""
    return not any(s.split(":")[-1] in transfer.FALLBACK_FUNCTIONS for s in c.sources)


def _collective_row(c: schedule.Collective) -> dict:
    return {**dataclasses.asdict(c), "steady": _steady(c)}


def _model_memory(tr, tokens_per_gpu: int) -> memory.Memory:
    """The memory model's count for the trainer's own cache modes."""
    by_name = {k.rsplit("/", 1)[-1]: m for k, m in tr.cache_modes.items()}
    mode_of = lambda t: {"word": "word", "exponent": "exponent"}.get(  # noqa: E731
        by_name.get(t.name, NO_CACHE), "plain")
    return memory.memory_per_gpu(tr.tc.model, tr.n, mode_of, tokens_per_gpu=tokens_per_gpu,
                                 remat=tr.tc.remat)


def per_gpu_bytes(args) -> int:
    """Bytes one GPU holds of the abstract step arguments (each leaf's shard)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(args))


def compiler_options(flags: str, target: gpu_targets.GpuTarget, io_bytes: int,
                     model: memory.Memory, memory_limit: str = "plan") -> dict:
    """The flag set, and with ``memory_limit="plan"`` XLA's scheduler limited to the memory
    model's total (``gpu``: XLA's default limit, 95% of 80% of the GPU less the inputs)."""
    opts = dict(gpu_targets.FLAG_SETS[flags])
    if memory_limit == "plan":
        opts[gpu_targets.SLOP_FLAG] = gpu_targets.plan_slop_percent(target, io_bytes, model.total)
    elif memory_limit != "gpu":
        raise ValueError(f"memory_limit must be 'plan' or 'gpu', got {memory_limit!r}")
    return opts


def compile_step(tc, target: gpu_targets.GpuTarget, gpus: int, tokens_per_gpu: int,
                 flags: str = "fsdp", hlo_out: str | None = None, log=None,
                 program: str = "steady", memory_limit: str = "plan") -> dict:
    """Compile ``tc``'s train step for ``gpus`` x ``target`` and report the program
    (``program``: which of the trainer's programs, ``steady`` or ``priming``:
    :meth:`~ciera_models.state.Trainer.at_rungs`; ``memory_limit``: :func:`compiler_options`)."""
    tc = batch_for(tc, gpus, tokens_per_gpu)
    if tc.memory_gb is None:  # plan within the target's memory, never a CPU device's
        tc = dataclasses.replace(tc, memory_gb=target.memory_gb)
    mesh = gpu_targets.compile_only_mesh(target, gpus)
    t0 = time.perf_counter()
    # The codec's kernels as impl="auto" picks them on the target GPU (Mosaic GPU on Hopper),
    # not as on this host's CPU (fused jnp): the program the pod would run.
    with lowering_for("cuda", capability=target.compute_capability):
        tr = build_trainer(tc, mesh)
        args = tr.at_rungs(abstract_step_args(tr), program)
        lowered = tr.step_fn.lower(*args)
    t_lower = time.perf_counter() - t0
    model = _model_memory(tr, tokens_per_gpu)
    io_bytes = per_gpu_bytes(args)
    options = compiler_options(flags, target, io_bytes, model, memory_limit)
    slop = options.get(gpu_targets.SLOP_FLAG, gpu_targets.DEFAULT_SLOP_PERCENT)
    if log:
        log(f"ciera aot: {tc.gather} step of {tc.config} on {gpus} x {target.name}: lowered in "
            f"{t_lower:.1f} s, compiling with XLA:GPU ({flags} flags, scheduler memory "
            f"limit {memory_limit}: {gpu_targets.SLOP_FLAG}={slop})")
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile(compiler_options=options)
    # CPU seconds as well as wall: on a shared machine the wall clock is mostly the load
    t_compile, cpu_compile = time.perf_counter() - t1, time.process_time() - c1
    text = compiled.as_text()
    if hlo_out:
        Path(hlo_out).mkdir(parents=True, exist_ok=True)
        (Path(hlo_out) / f"{tc.config}-{gpus}x{target.name}-{tc.gather}.hlo.txt").write_text(text)
    prog = schedule.Program(text)
    colls = prog.collectives()
    ma = compiled.memory_analysis()
    xla_total = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                 + ma.temp_size_in_bytes)
    caches = jax.tree.leaves(args[1])
    return {
        "config": tc.config, "gather": tc.gather, "cache": tc.cache, "plan": tc.plan,
        "program": program,
        "gpus": gpus, "gpu": target.name, "tokens_per_gpu": tokens_per_gpu,
        "batch": [tc.batch_size, tc.length], "flags": options,
        "scheduler_limit": {"memory_limit": memory_limit, "slop_percent": slop,
                            "io": io_bytes,
                            "bytes": gpu_targets.scheduler_limit_bytes(target, io_bytes, slop)},
        "lower_s": t_lower, "compile_s": t_compile, "compile_cpu_s": cpu_compile,
        "hlo_bytes": len(text),
        **prog.kernels(),
        "collectives": [_collective_row(c) for c in colls],
        "all_gather_overlap_share": schedule.overlap_share(colls),
        "memory": {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
                   "alias": ma.alias_size_in_bytes, "temp": ma.temp_size_in_bytes,
                   "total": xla_total, "capacity": target.memory_bytes,
                   "headroom": target.memory_bytes - xla_total},
        "trainer": {"plan": tr.plan_summary, "attention": tr.attention, "experts": tr.experts,
                    "remat": tr.tc.remat,
                    "cache_modes": dict(sorted(tr.cache_modes.items())),
                    "cache_bytes": sum(math.prod(c.shape) * c.dtype.itemsize for c in caches),
                    "memory_model": model.to_json()},
    }

"""XLA:GPU's scheduler memory limit for the train step, set from the plan: one policy for
``ciera train`` on GPUs and ``ciera aot``, so the report's memory is what a pod gets.

XLA's latency-hiding scheduler keeps buffers live to overlap collectives until it reaches
``xla_gpu_memory_limit_slop_factor`` % of 80% of the GPU less the step's inputs and outputs
(:mod:`ciera_jax.runtime.gpu_targets`). Unlimited, it can spend what the plan gave to caches or
headroom; limited, it overlaps fewer of the gathers (docs/results.md, section 7, "Memory").
Hence ``auto``: it limits only where XLA's own schedule would not fit the memory the plan allows
the step (the GPU's, or ``--memory-gb``, less ``planner.HEADROOM_GB``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, TypeVar

import jax

from ciera_jax.planning import memory, planner
from ciera_jax.runtime import gpu_targets
from ciera_models.train import compression

MEMORY_LIMITS = gpu_targets.MEMORY_LIMITS
Compiled = TypeVar("Compiled")


def per_gpu_bytes(args) -> int:
    """Bytes one GPU holds of the step's arguments (each leaf's shard; abstract ones too)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(args))


def model_memory(tr, tokens_per_gpu: int) -> memory.Memory:
    """The memory model's count of trainer ``tr``'s step, with its own cache modes."""
    by_name = {k.rsplit("/", 1)[-1]: m for k, m in tr.cache_modes.items()}

    def mode_of(t) -> str:
        mode = by_name.get(t.name)
        return mode if mode in ("word", "exponent") else "plain"

    return memory.memory_per_gpu(tr.tc.model, tr.n, mode_of, tokens_per_gpu=tokens_per_gpu,
                                 remat=tr.tc.remat)


@dataclasses.dataclass(frozen=True)
class SchedulerLimit:
    """What the limit is derived from: the GPU, the step's inputs per GPU, the plan's total,
    and the memory the plan allows the step (``room_bytes``: the GPU's, or ``--memory-gb``, less
    the planner's headroom)."""

    target: gpu_targets.GpuTarget
    io_bytes: int
    plan_bytes: int
    room_bytes: int

    @property
    def memory_bytes(self) -> int:
        """The memory the step and its caches must fit in: the room and the planner's
        headroom."""
        return self.room_bytes + int(planner.HEADROOM_GB * memory.GB)

    @property
    def slop(self) -> int:
        """The slop factor that puts XLA's limit at the plan's total."""
        return gpu_targets.plan_slop_percent(self.target, self.io_bytes, self.plan_bytes)


def room_bytes(target: gpu_targets.GpuTarget, memory_gb: float | None) -> int:
    """The memory a step may use: ``memory_gb`` (``compression.memory_gb``: ``--memory-gb``, or
    what the GPU's allocator may hold) or the GPU's, less ``planner.HEADROOM_GB``, as the plan's
    cache budget counts it."""
    gb = target.memory_gb if memory_gb is None else min(memory_gb, target.memory_gb)
    return int(planner.room_bytes(gb))


def scheduler_limit(tr, args, target: gpu_targets.GpuTarget, tokens_per_gpu: int) -> SchedulerLimit:
    """The limit's inputs for trainer ``tr``'s step on ``args`` (real or abstract)."""
    platform = tr.mesh.devices.flat[0].platform
    return SchedulerLimit(target, per_gpu_bytes(args), model_memory(tr, tokens_per_gpu).total,
                     room_bytes(target, compression.memory_gb(tr.tc, platform)))


def compile_within(limit: SchedulerLimit, how: str, compile_at: Callable[[int | None], Compiled],
                   total: Callable[[Compiled], int], log=None,
                   who: str = "ciera") -> tuple[Compiled, Compiled | None]:
    """``(kept, other)``: ``compile_at(slop)`` (None: XLA's default limit) as ``how`` says.
    ``gpu``: XLA's default. ``plan``: the plan's. ``auto``: XLA's default, and again at the
    plan's only when XLA's count (``total``) is above the room the plan allows the step
    (``limit.room_bytes``) and the plan's limit is tighter; the smaller count is kept, ``other``
    is the one not. A default schedule that fits is kept whatever the model said: a limit then
    saves memory no one needs and costs the gathers' overlap."""
    if how not in MEMORY_LIMITS:
        raise ValueError(f"memory_limit must be one of {MEMORY_LIMITS}, got {how!r}")
    slop = limit.slop
    tighter = slop < gpu_targets.DEFAULT_SLOP_PERCENT
    if how == "plan":
        kept, other = compile_at(slop if tighter else None), None
    else:
        kept, other = compile_at(None), None
        if how == "auto" and tighter and total(kept) > limit.room_bytes:
            if log:
                log(f"{who}: XLA counts {total(kept) / 1e9:.1f} GB, more than the "
                    f"{limit.room_bytes / 1e9:.1f} GB the plan allows the step (the model: "
                    f"{limit.plan_bytes / 1e9:.1f} GB): compiling again with "
                    f"{gpu_targets.SLOP_FLAG}={slop}")
            second = compile_at(slop)
            if total(second) < total(kept):
                kept, other = second, kept
            else:
                other = second
    _say_if_over(limit, total(kept), log, who)
    return kept, other


def _say_if_over(limit: SchedulerLimit, total: int, log, who: str) -> None:
    """One line when even the kept schedule does not fit the memory the step has: it would
    not run, and the line says by how much and the ``--memory-gb`` that plans the caches
    smaller by as much (the memory model missed what XLA keeps beside them)."""
    short = total - limit.memory_bytes
    if short <= 0 or not log:
        return
    log(f"{who}: XLA counts {total / 1e9:.1f} GB per device for this step, {short / 1e9:.1f} GB "
        f"more than the {limit.memory_bytes / 1e9:.1f} GB it may hold: it will not run. The "
        f"memory model counted {limit.plan_bytes / 1e9:.1f} GB; --memory-gb "
        f"{math.floor((limit.memory_bytes - short) / 1e9)} plans the caches that much smaller")


def xla_total(ma) -> int:
    """XLA's count of a program's memory per device (inputs, outputs, temporaries), from its
    ``compiled.memory_analysis()``."""
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes)

"""XLA:GPU's scheduler memory limit for the train step, set from the plan: one policy for
``ciera train`` on GPUs and ``ciera aot``, so the report's memory is what a pod gets.

XLA's latency-hiding scheduler keeps buffers live to overlap collectives until it reaches
``xla_gpu_memory_limit_slop_factor`` % of 80% of the GPU less the step's inputs and outputs
(:mod:`ciera_jax.runtime.gpu_targets`). Unlimited, it can spend what the plan gave to caches or
headroom (OLMoE-1B-7B's plain step on 16 H100s: 25.4 GB at XLA's default, 19.2 GB at the
plan's limit; docs/results.md). It also overestimates a compressed step's needs, so a limit
at the plan can cost that step its overlap and save nothing: hence ``auto``, which limits only
where XLA counts more than the plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, TypeVar

import jax

from ciera_jax.planning import memory
from ciera_jax.runtime import gpu_targets

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
class LimitPlan:
    """What the limit is derived from: the GPU, the step's inputs per GPU, the plan's total."""

    target: gpu_targets.GpuTarget
    io_bytes: int
    plan_bytes: int

    @property
    def slop(self) -> int:
        """The slop factor that puts XLA's limit at the plan's total."""
        return gpu_targets.plan_slop_percent(self.target, self.io_bytes, self.plan_bytes)

    @property
    def tolerance(self) -> int:
        """One step of the slop factor: the limit is no finer, so nearer than this is within."""
        return gpu_targets.scheduler_limit_bytes(self.target, self.io_bytes, 1)


def plan_for(tr, args, target: gpu_targets.GpuTarget, tokens_per_gpu: int) -> LimitPlan:
    """The limit's inputs for trainer ``tr``'s step on ``args`` (real or abstract)."""
    return LimitPlan(target, per_gpu_bytes(args), model_memory(tr, tokens_per_gpu).total)


def compile_within(plan: LimitPlan, how: str, compile_at: Callable[[int | None], Compiled],
                   total: Callable[[Compiled], int], log=None,
                   who: str = "ciera") -> tuple[Compiled, Compiled | None]:
    """``(kept, other)``: ``compile_at(slop)`` (None: XLA's default limit) as ``how`` says.
    ``gpu``: XLA's default. ``plan``: the plan's. ``auto``: XLA's default, and again at the
    plan's when XLA counts (``total``) more than the plan by more than one step of the factor
    and the plan's limit is tighter; the smaller count is kept, ``other`` is the one not."""
    if how not in MEMORY_LIMITS:
        raise ValueError(f"memory_limit must be one of {MEMORY_LIMITS}, got {how!r}")
    slop = plan.slop
    tighter = slop < gpu_targets.DEFAULT_SLOP_PERCENT
    if how == "plan":
        return compile_at(slop if tighter else None), None
    first = compile_at(None)
    if how == "gpu" or not tighter or total(first) <= plan.plan_bytes + plan.tolerance:
        return first, None
    if log:
        log(f"{who}: XLA counts {total(first) / 1e9:.1f} GB, the plan {plan.plan_bytes / 1e9:.1f}"
            f" GB: compiling again with {gpu_targets.SLOP_FLAG}={slop}")
    second = compile_at(slop)
    return (second, first) if total(second) < total(first) else (first, second)


def xla_total(ma) -> int:
    """XLA's count of a program's memory per device (inputs, outputs, temporaries), from its
    ``compiled.memory_analysis()``."""
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes)

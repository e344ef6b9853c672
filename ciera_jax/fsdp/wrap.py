"""Wrapping by instance: :func:`shard` makes an existing module instance gather its
parameters just before each call, without editing or subclassing its class by hand (as
PyTorch's ``fully_shard(block)``). The decorator (:func:`~ciera_jax.fsdp.gathered`) stays for
code you own; both give the same gathers, caches, stats and parameters.

The instance's class is swapped for a gathering subclass made once per (class, options), the
way ``fully_shard`` does it: its parameter paths, state and Flax metadata are untouched, and
``nnx.split`` / ``nnx.merge`` / ``nnx.jit`` / ``nnx.scan`` rebuild it as the gathering class.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from ciera_jax.fsdp.state.axes import AXIS
from ciera_jax.fsdp.decorator import gathered
from ciera_jax.fsdp.state.discovery import (GATHER_ATTR, GatherSpec, gather_spec, iter_modules,
                                            sharded_params)
from ciera_jax.runtime.partition import Rules

WRAPPED_ATTR = "ciera_wrapped_class"  # on a gathering subclass: the class it wraps


@functools.cache
def _gathering_class(cls: type, spec: GatherSpec) -> type:
    """``cls`` whose ``__call__`` gathers (one class per (cls, spec), so graphdefs compare
    equal across splits and jit calls)."""
    call = gathered(spec.axis_name, dtype=spec.dtype, rules=spec.rules,
                    replicate=spec.replicate)(cls.__call__)
    sub = type(f"Sharded{cls.__name__}", (cls,), {
        "__call__": call, "__module__": cls.__module__,
        "__qualname__": f"Sharded{cls.__qualname__}",
        "__doc__": f"{cls.__name__} gathering its FSDP-split parameters before each call "
                   f"(made by ciera_jax.fsdp.shard).", WRAPPED_ATTR: cls})
    return sub


def is_sharded(module) -> bool:
    """Does ``module`` gather before its call (wrapped by :func:`shard` or decorated)?"""
    return gather_spec(module) is not None


def shard(module: nnx.Module, where: Callable | None = None, *, axis_name: str = AXIS,
          dtype=jnp.bfloat16, rules: Rules = (), replicate: str | bool = False) -> nnx.Module:
    """Make module instances gather their FSDP-split parameters just before each call.

    ``where=None``: ``module`` itself (e.g. the root, after its blocks). ``where(path,
    submodule) -> bool``: every sub-module it selects (``path`` a tuple of attribute names and
    list indices), e.g. ``lambda path, m: isinstance(m, Block)``: blocks in an ``nnx.List``,
    or layers stacked with ``nnx.vmap`` and run with ``nnx.scan`` (each layer gathers its
    own). The options are those of :func:`~ciera_jax.fsdp.gathered`. A module gathers the
    parameters under it that no gathering sub-module does, so shard the blocks first, then
    the root. Returns ``module``; then call :func:`~ciera_jax.fsdp.attach_caches` once.
    """
    spec = GatherSpec(axis_name, dtype, tuple(rules), replicate)
    if where is None:
        targets = [module]
    else:
        targets = [m for path, m in iter_modules(module) if where(path, m)]
        if not targets:
            raise ValueError(f"fsdp.shard: `where` selected no module of "
                             f"{type(module).__name__}; it is called as where(path, module)")
    for m in targets:
        cls = type(m)
        if getattr(getattr(cls, "__call__", None), GATHER_ATTR, None) is not None:
            if getattr(cls, WRAPPED_ATTR, None) is not None and gather_spec(m) == spec:
                continue  # sharded already, same options
            raise ValueError(f"fsdp.shard: {cls.__name__} gathers already (decorated, or "
                             f"sharded with other options); shard each instance once")
        object.__setattr__(m, "__class__", _gathering_class(cls, spec))
        if not sharded_params(m, spec, strict=False):
            object.__setattr__(m, "__class__", cls)
            raise ValueError(
                f"fsdp.shard: {cls.__name__} holds no parameter split over {axis_name!r} that "
                f"a sharded sub-module does not gather already, so it would gather nothing; "
                f"leave it unwrapped (or annotate its parameters over {axis_name!r})")
    return module

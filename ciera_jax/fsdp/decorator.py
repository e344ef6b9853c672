"""The :func:`gathered` decorator: a sharded module's parameters are gathered just before its
``__call__`` runs, through the active :class:`~ciera_jax.fsdp.Engine` (a default ``ciera`` one
when none is active)."""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp

from ciera_jax.fsdp.axes import AXIS
from ciera_jax.fsdp.context import active_engine
from ciera_jax.fsdp.discovery import GATHER_ATTR, GatherSpec
from ciera_jax.fsdp.engine import Engine
from ciera_jax.fsdp.rules import Rules


def gathered(axis_name: str = AXIS, *, dtype=jnp.bfloat16, rules: Rules = (),
             replicate: str | bool = False) -> Callable:
    """Decorate a sharded NNX module's ``__call__``: gather its sharded params before use.

    Every parameter under the module (its Flax layers included) that is split over
    ``axis_name`` (by Flax's partitioning metadata, ``fsdp_axis`` metadata or ``rules``, see
    :mod:`ciera_jax.fsdp.discovery`) is cast to ``dtype`` and gathered with the active engine's
    gather (:func:`gather_mode`; default ``ciera``), so the body sees full weights. Inside the
    user's ``jax.shard_map`` the gathers run there; under ``jit`` with a mesh set (no
    ``shard_map``) the call opens a ``shard_map`` region for them and the body runs under
    sharding propagation. Exponent caches (:func:`attach_caches`) and stats
    (:func:`gather_stats`) are module state. Without any mesh the params are only cast.
    ``replicate``: a regex over parameter paths (or True) that may stay whole when no source
    covers them; any other uncovered weight of 2+ dimensions is an error.
    """
    spec = GatherSpec(axis_name, dtype, tuple(rules), replicate)

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            engine = active_engine() or Engine("ciera", axis_name=axis_name)
            return engine.call(self, fn, args, kwargs, spec)

        setattr(wrapper, GATHER_ATTR, spec)
        return wrapper

    return deco

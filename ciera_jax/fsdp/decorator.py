"""The :func:`gathered` decorator: a sharded module's parameters are gathered just before its
``__call__`` runs. What the call does is the module's static setup
(:mod:`ciera_jax.fsdp.state.setup`): on its own (:mod:`.percall`), prepared by a train step
(:mod:`.prepared`), or nothing but the call when a prepared layer stack holds its full
weights already."""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp

from ciera_jax.fsdp.state.axes import AXIS, MANUAL, REGION, placement
from ciera_jax.fsdp.state.discovery import GATHER_ATTR, GatherSpec, module_name
from ciera_jax.fsdp.percall import call as call_alone
from ciera_jax.fsdp.state.setup import setup_of
from ciera_jax.fsdp.prepared import call as call_prepared
from ciera_jax.runtime.partition import Rules


def gathered(axis_name: str = AXIS, *, dtype=jnp.bfloat16, rules: Rules = (),
             replicate: str | bool = False) -> Callable:
    """Decorate a sharded NNX module's ``__call__``: gather its sharded params before use.

    Every parameter under the module (its Flax layers included) that is split over
    ``axis_name`` (by Flax's partitioning metadata, ``fsdp_axis`` metadata or ``rules``, see
    :mod:`ciera_jax.fsdp.state.discovery`) is cast to ``dtype`` and gathered with the module's gather
    mode (:func:`~ciera_jax.fsdp.set_gather_mode`; default ``ciera``), so the body sees full
    weights. Inside the user's ``jax.shard_map`` the gathers run there; under ``jit`` with a
    mesh set (no ``shard_map``) the call opens a ``shard_map`` region for them and the body
    runs under sharding propagation. Caches (:func:`attach_caches`) and stats
    (:func:`gather_stats`) are module state. Without any mesh the params are only cast.
    ``replicate``: a regex over parameter paths (or True) that may stay whole when no source
    covers them; any other uncovered weight of 2+ dimensions is an error.
    """
    spec = GatherSpec(axis_name, dtype, tuple(rules), replicate)

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            return call(self, fn, args, kwargs, spec)

        setattr(wrapper, GATHER_ATTR, spec)
        return wrapper

    return deco


def call(module, fn, args, kwargs, spec: GatherSpec):
    """One call of a gathering module, as its setup says."""
    setup = setup_of(module)
    if setup.held:
        return fn(module, *args, **kwargs)
    if setup.prepared:
        place = placement(spec.axis_name, module_name(module))
        if place == MANUAL:
            return call_prepared(module, fn, args, kwargs, setup)
        if place == REGION:
            raise ValueError(f"{module_name(module)}: a step prepared by fsdp.prepare runs "
                             "inside shard_map; under jit without shard_map, gather per call "
                             "(fsdp.set_gather_mode)")
    return call_alone(module, fn, args, kwargs, spec, setup)

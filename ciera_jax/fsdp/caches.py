"""Exponent caches as module state: one :class:`ExponentCacheVar` per gathered parameter,
attached beside it on the module that holds it (``kernel`` -> ``kernel_exp_cache``), and
conversions between cache states and ``{parameter path: cache}`` dicts. Derived, replicated
state, like batch-norm statistics: carried through the step, never checkpointed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import ciera_jax.cache as cache_lib
from ciera_jax.fsdp.discovery import (gather_spec, iter_modules, path_key, set_module_path,
                                      sharded_params)
from ciera_jax.fsdp.stacking import stack_of, stack_size

CACHE_SUFFIX = "_exp_cache"


class ExponentCacheVar(nnx.Variable):
    """Exponent cache of one gathered parameter (full shape, replicated over the gather axis).

    Derived state: it is carried through the train step like optimizer state but never
    checkpointed; a fresh (unprimed) cache re-primes on its first gather, bitwise exactly.
    """


def cache_attr(name: str) -> str:
    """The attribute beside parameter ``name`` that holds its cache."""
    return f"{name}{CACHE_SUFFIX}"


def new_cache(layer_shape, dtype, layers: int = 0):
    """An unprimed cache for one layer's full tensor; stacked ``layers`` deep when nonzero."""
    if layers:
        return jax.vmap(lambda _: cache_lib.init_cache(layer_shape, dtype))(jnp.zeros(layers))
    return cache_lib.init_cache(layer_shape, dtype)


def attach_caches(model: nnx.Module) -> nnx.Module:
    """Give every gathered parameter an unprimed exponent cache beside it; name module paths.

    Call once on the model built with its full (global) parameter shapes, eagerly sharded or
    not. Idempotent: a parameter that has a cache keeps it (so a layer constructor run under
    ``nnx.vmap`` may attach its own, which then stack with the layer). Returns the model.
    """
    mods = dict(iter_modules(model))
    for path, module in mods.items():
        spec = gather_spec(module)
        if spec is None and not stack_size(module):
            continue
        set_module_path(module, "/".join(map(str, path)))
        if spec is None:
            continue
        n, _ = stack_of(path, mods)
        for p in sharded_params(module, spec, lead=1 if n else 0, strict=False):
            if hasattr(p.owner, cache_attr(p.name)):
                continue
            dtype = spec.dtype or p.var.get_value().dtype
            layers = p.var.get_value().shape[0] if p.lead else 0
            if p.lead > 1:
                raise ValueError(f"{path_key(path)}/{p.key}: {p.lead} stacked axes; one "
                                 "layer axis is supported")
            setattr(p.owner, cache_attr(p.name),
                    ExponentCacheVar(new_cache(p.layer_shape, dtype, layers)))
    return model


def cache_dict(caches: nnx.State) -> dict:
    """``{parameter path: cache}`` from a state of :class:`ExponentCacheVar`."""
    out = {}
    pairs = jax.tree_util.tree_flatten_with_path(
        caches, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    for path, var in pairs:
        out[path_key(path)[:-len(CACHE_SUFFIX)]] = var.get_value()
    return out


def with_caches(caches: nnx.State, new: dict) -> nnx.State:
    """``caches`` with the entries of ``new`` (``{parameter path: cache}``) replaced."""

    def one(path, var):
        k = path_key(path)[:-len(CACHE_SUFFIX)]
        return var.replace(value=new[k]) if k in new else var

    return jax.tree_util.tree_map_with_path(one, caches,
                                            is_leaf=lambda v: isinstance(v, nnx.Variable))

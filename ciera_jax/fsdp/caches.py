"""Exponent caches as module state: one :class:`ExponentCacheVar` per gathered parameter,
attached next to it, and conversions between cache states and ``{tensor key: cache}`` dicts.
Derived, replicated state, like batch-norm statistics: carried, never checkpointed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ciera_jax.fsdp._util import _is_gathered, _iter_modules, _key
from ciera_jax.fsdp.layer_stack import _stack_of, stack_size
from ciera_jax.fsdp.rules import _sharded_params


class ExponentCacheVar(nnx.Variable):
    """Exponent cache of one gathered parameter (uint8, full shape, replicated over fsdp).

    Derived state: it is carried through the train step like optimizer state but never
    checkpointed; a fresh (unprimed) cache re-primes on its first gather, bitwise exactly.
    """


def _cache_attr(name: str) -> str:
    return f"{name}_exp_cache"


def attach_caches(model: nnx.Module) -> nnx.Module:
    """Give every decorated module an unprimed exponent cache per sharded param; name paths.

    Call once on the model built with full (global) parameter shapes, before splitting it.
    Returns the model (modified in place).
    """
    import ciera_jax

    mods = dict(_iter_modules(model))
    for path, module in mods.items():
        info = _is_gathered(module)
        if info is None and not stack_size(module):
            continue
        object.__setattr__(module, "_ciera_path", "/".join(str(p) for p in path))
        if info is None:
            continue
        n, _ = _stack_of(path, mods)
        for name, var, axis in _sharded_params(module, info["rules"]):
            shape = var.get_value().shape
            dt = info["dtype"] or var.get_value().dtype
            if n:  # one cache per layer, stacked like the parameter (primed flag per layer)
                cache = jax.vmap(lambda _: ciera_jax.init_cache(shape[1:], dt))(jnp.zeros(n))
            else:
                cache = ciera_jax.init_cache(shape, dt)
            setattr(module, _cache_attr(name), ExponentCacheVar(cache))
    return model


def reset_caches(caches):
    """Fresh unprimed caches with the same structure (after a restore: re-prime on first gather)."""
    return jax.tree.map(jnp.zeros_like, caches)


def cache_dict(caches: nnx.State) -> dict:
    """``{tensor key: ExponentCache}`` from a state of :class:`ExponentCacheVar`."""
    out = {}
    pairs = jax.tree_util.tree_flatten_with_path(
        caches, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    suffix = _cache_attr("")
    for path, var in pairs:
        k = _key(path)
        out[k[:-len(suffix)]] = var.get_value()
    return out


def with_caches(caches: nnx.State, new: dict) -> nnx.State:
    """``caches`` with the entries of ``new`` (``{tensor key: ExponentCache}``) replaced."""
    suffix = _cache_attr("")

    def one(path, var):
        k = _key(path)[:-len(suffix)]
        return var.replace(value=new[k]) if k in new else var

    return jax.tree_util.tree_map_with_path(one, caches,
                                            is_leaf=lambda v: isinstance(v, nnx.Variable))

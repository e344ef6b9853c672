"""The :func:`gathered` decorator: a sharded module's parameters are gathered just before its
``__call__`` runs (CIERA, plain or int8) and restored to shards after it."""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp
from jax import lax

from ciera_jax.fsdp._util import _axis_bound, invariant
from ciera_jax.fsdp.caches import ExponentCacheVar, _cache_attr
from ciera_jax.fsdp.context import _CTX, _ENGINE, GATHER_MODES, PREGATHERED, GatherContext
from ciera_jax.fsdp.rules import AXIS, RULES, _sharded_params


def _reduce_stats(st: dict, axis_name: str) -> dict:
    """Per-rank gather stats -> rank-invariant scalars (change counts summed over ranks)."""
    out = {}
    for k, v in st.items():
        v = jnp.asarray(v)
        if v.dtype == jnp.bool_:
            v = v.astype(jnp.int32)
        out[k] = invariant(v, axis_name, lax.psum if k == "changed" else lax.pmax)
    return out


def gather_params(xs: dict, caches: dict, axes: dict, axis_name: str, mode: str):
    """Gather local shards ``xs`` (name -> array in compute dtype) along ``axes[name]``.

    ``ciera`` gathers them together (one agreement collective per call); ``plain`` and
    ``int8`` one by one. Returns ``(fulls, new_caches, stats)`` dicts keyed by name; stats are
    rank-invariant scalars in bytes one rank sends (``sent_bytes``, ``plain_bytes``), exponents
    changed over the whole tensor (``changed``) and its size (``elements``), ``tier``,
    ``fallback``. Caches are returned unchanged by the baselines.
    """
    import ciera_jax
    from ciera_jax import quantized

    n = lax.axis_size(axis_name)
    if mode == "ciera":
        missing = [k for k in xs if caches.get(k) is None]
        if missing:
            raise ValueError(f"gather 'ciera' needs exponent caches for {missing}: call "
                             "ciera_jax.fsdp.attach_caches(model) after building the model")
        fulls, new_caches, st = ciera_jax.all_gather_tree(
            xs, {k: caches[k] for k in xs}, axis_name, axis={k: axes[k] for k in xs})
        stats = {k: _reduce_stats(v, axis_name) for k, v in st.items()}
    elif mode in ("plain", "int8"):
        fulls, new_caches, stats = {}, dict(caches), {}
        for k, x in xs.items():
            plain = jnp.int32(x.size * x.dtype.itemsize)
            if mode == "plain":
                fulls[k] = ciera_jax.plain_all_gather(x, axis_name, axis=axes[k])
                sent = plain
            else:
                fulls[k] = quantized.int8_all_gather(x, axis_name, axis=axes[k]).astype(x.dtype)
                sent = jnp.int32(quantized.wire_bytes(x.size))
            stats[k] = dict(sent_bytes=sent, plain_bytes=plain, changed=jnp.int32(0),
                            tier=jnp.int32(-1), fallback=jnp.int32(0))
    else:
        raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
    for k, x in xs.items():
        stats[k] = {s: lax.stop_gradient(v) for s, v in stats[k].items()
                    if s in ("sent_bytes", "plain_bytes", "changed", "tier", "fallback")}
        stats[k]["elements"] = jnp.int32(x.size * n)
    return fulls, new_caches, stats


def gathered(axis_name: str = AXIS, *, dtype=jnp.bfloat16, rules=RULES) -> Callable:
    """Decorate a sharded NNX module's ``__call__``: gather its sharded params before use.

    Inside ``jax.shard_map`` over ``axis_name``, each direct ``nnx.Param`` attribute with a
    split axis (``fsdp_axis`` metadata, else the rule table) is cast to ``dtype`` and gathered
    with the gather selected by :func:`gather_mode` (default ``ciera``); the module's body sees
    the full weights, and its exponent caches (:class:`ExponentCacheVar`, created by
    :func:`attach_caches`) are updated in place. Gradients flow back to the shards through the
    gather's backward, a ``psum_scatter``. Outside ``shard_map`` the params are only cast.
    """

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            ctx = _CTX.get() or GatherContext()
            engine = _ENGINE.get()
            if engine is not None and ctx.mode != PREGATHERED and _axis_bound(axis_name):
                return engine.call(self, fn, args, kwargs, rules=rules, dtype=dtype)
            params = _sharded_params(self, rules)
            saved = [(var, var.get_value()) for _, var, _ in params]
            try:
                xs = {name: var.get_value().astype(dtype) if dtype is not None else var.get_value()
                      for name, var, _ in params}
                if params and ctx.mode != PREGATHERED and _axis_bound(axis_name):
                    cvars = {name: getattr(self, _cache_attr(name), None) for name, _, _ in params}
                    caches = {k: (v.get_value() if isinstance(v, ExponentCacheVar) else None)
                              for k, v in cvars.items()}
                    axes = {name: axis for name, _, axis in params}
                    xs, new_caches, stats = gather_params(xs, caches, axes, axis_name, ctx.mode)
                    path = getattr(self, "_ciera_path", type(self).__name__)
                    for name, _, _ in params:
                        if ctx.mode == "ciera":
                            cvars[name].set_value(new_caches[name])
                        ctx.stats[f"{path}/{name}" if path else name] = stats[name]
                for name, var, _ in params:
                    var.set_value(xs[name])
                return fn(self, *args, **kwargs)
            finally:
                for var, value in saved:
                    var.set_value(value)

        wrapper._ciera_gathered = dict(axis_name=axis_name, dtype=dtype, rules=rules)
        return wrapper

    return deco

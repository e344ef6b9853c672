"""The exponent cache: what each rank remembers of the last gathered tensor.

A cache holds the 8-bit exponent of every element of the *full* gathered tensor (1 byte per
parameter, replicated over the gather axis) and a ``primed`` flag. It is functional state: pass
it into :func:`ciera_jax.all_gather` and carry the returned one to the next step, like optimizer
state. It is derived state too: a fresh (or restored) cache is unprimed, and the first gather
re-primes it with a plain gather, so it never needs to be checkpointed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax import codec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExponentCache:
    """``exp``: uint8 exponents of the full tensor; ``primed``: bool scalar.

    ``dtype`` (static) is the dtype the cache serves; for dtypes without a compressed format
    (fp16, fp8, integers) ``exp`` is empty and gathers are plain.
    """

    exp: jax.Array
    primed: jax.Array
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.exp.shape)

    @property
    def compressible(self) -> bool:
        return codec.is_compressible(self.dtype)


def init_cache(global_shape, dtype) -> ExponentCache:
    """An unprimed cache for a tensor whose *gathered* (full) shape is ``global_shape``."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in global_shape) if codec.is_compressible(dtype) else (0,)
    return ExponentCache(jnp.zeros(shape, jnp.uint8), jnp.zeros((), jnp.bool_), dtype)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, (int, np.integer)) for d in x)


def init_cache_tree(tree, dtype=None):
    """Caches for every leaf of ``tree``.

    Leaves may be arrays or ``jax.ShapeDtypeStruct`` (their full shape and dtype are used), or
    shape tuples together with ``dtype``.
    """

    def one(leaf):
        if _is_shape(leaf):
            if dtype is None:
                raise ValueError("init_cache_tree: shape-tuple leaves need dtype=")
            return init_cache(leaf, dtype)
        return init_cache(leaf.shape, dtype if dtype is not None else leaf.dtype)

    return jax.tree.map(one, tree, is_leaf=_is_shape)


def reset(cache: ExponentCache) -> ExponentCache:
    """Mark a cache unprimed (e.g. after parameters were changed outside the train step)."""
    return dataclasses.replace(cache, primed=jnp.zeros_like(cache.primed))


def is_cache(x: Any) -> bool:
    return isinstance(x, ExponentCache)

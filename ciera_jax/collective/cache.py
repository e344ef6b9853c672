"""The caches: what each rank remembers of the last gathered tensor; its kind picks the mode.

An :class:`ExponentCache` holds the 8-bit exponent of every element of the *full* gathered
tensor (1 byte per parameter); a :class:`WordCache` holds the full words themselves (2 bytes per
bf16 parameter, 4 per float32), so a gather can send each word's small move since the last step
(word mode) and, holding the exponents too, can always fall back to exponent mode. Both are
replicated over the gather axis and carry a ``primed`` flag. They are functional state: pass one
into :func:`ciera_jax.all_gather` and carry the returned one to the next step, like optimizer
state. They are derived state too: a fresh (or restored) cache is unprimed, and the first gather
re-primes it with a plain gather, so it never needs to be checkpointed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax.codec import bitfields

MODES = ("exponent", "word")
# The shape of a cache that serves no compressed gather (a dtype without a compressed format;
# a trainer's tensor gathered plainly): one element, never zero. JAX 0.11's partitioner
# (Shardy) crashes the process compiling a shard_map that takes a zero-size array.
EMPTY_SHAPE = (1,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExponentCache:
    """``exp``: uint8 exponents of the full tensor; ``primed``: bool scalar.

    ``dtype`` (static) is the dtype the cache serves; for dtypes without a compressed format
    (fp16, fp8, integers) ``exp`` is a placeholder (:data:`EMPTY_SHAPE`) and gathers are plain.
    """

    exp: jax.Array
    primed: jax.Array
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    mode = "exponent"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.exp.shape)

    @property
    def compressible(self) -> bool:
        return bitfields.is_compressible(self.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WordCache:
    """``words``: the full tensor's words as the same-width unsigned dtype (uint16 for bf16,
    uint32 for float32); ``primed``: bool scalar; ``dtype`` (static): the dtype it serves.

    After any gather through it, ``words`` is bitwise the gathered tensor (see
    :func:`cached_full`). A placeholder (:data:`EMPTY_SHAPE`) for dtypes without a compressed
    format.
    """

    words: jax.Array
    primed: jax.Array
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    mode = "word"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.words.shape)

    @property
    def compressible(self) -> bool:
        return bitfields.is_compressible(self.dtype)

    @property
    def exp(self) -> jax.Array:
        """The cached exponents (uint8), for exponent mode."""
        return bitfields.exponent(bitfields.from_bits(self.words, self.dtype))


def init_cache(global_shape, dtype, mode: str = "exponent"):
    """An unprimed cache for a tensor whose *gathered* (full) shape is ``global_shape``.

    ``mode="exponent"``: 1 byte per element, exponent reuse; ``"word"``: the full words
    (2 B per bf16 element), word mode, which falls back to exponent mode when words moved too
    far. The cache decides the mode of every gather it serves.
    """
    if mode not in MODES:
        raise ValueError(f"init_cache: unknown cache mode {mode!r}; choose one of {MODES}")
    dtype = np.dtype(dtype)
    compressible = bitfields.is_compressible(dtype)
    shape = tuple(int(d) for d in global_shape) if compressible else EMPTY_SHAPE
    primed = jnp.zeros((), jnp.bool_)
    if mode == "word":
        word = bitfields.word_format(dtype).word if compressible else np.dtype(np.uint8)
        return WordCache(jnp.zeros(shape, word), primed, dtype)
    return ExponentCache(jnp.zeros(shape, jnp.uint8), primed, dtype)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, (int, np.integer)) for d in x)


def init_cache_tree(tree, dtype=None, mode="exponent"):
    """Caches for every leaf of ``tree``.

    Leaves may be arrays or ``jax.ShapeDtypeStruct`` (their full shape and dtype are used), or
    shape tuples together with ``dtype``. ``mode`` is one value for all leaves or a tree of
    ``"exponent"`` / ``"word"`` mirroring ``tree``.
    """

    def one(leaf, m):
        if _is_shape(leaf):
            if dtype is None:
                raise ValueError("init_cache_tree: shape-tuple leaves need dtype=")
            return init_cache(leaf, dtype, m)
        return init_cache(leaf.shape, dtype if dtype is not None else leaf.dtype, m)

    if isinstance(mode, str):
        return jax.tree.map(lambda leaf: one(leaf, mode), tree, is_leaf=_is_shape)
    try:
        return jax.tree.map(one, tree, mode, is_leaf=_is_shape)
    except ValueError as err:
        raise ValueError("init_cache_tree: mode must be one of "
                         f"{MODES} or a tree of them mirroring the tensors ({err})") from None


def is_cache(x: Any) -> bool:
    return isinstance(x, (ExponentCache, WordCache))


def cached_full(cache: WordCache) -> jax.Array:
    """The full tensor a primed :class:`WordCache` holds: bitwise the last gathered tensor.

    After a gather through a word cache (any branch: word, exponent or plain), the returned
    cache's words are this step's full weights, so a backward pass can read them here instead
    of gathering again. Only meaningful when ``cache.primed``.
    """
    if not isinstance(cache, WordCache):
        raise TypeError(f"cached_full needs a WordCache (init_cache(..., mode='word')), got "
                        f"{type(cache).__name__}: an exponent cache does not hold the weights")
    return bitfields.from_bits(cache.words, cache.dtype)

"""Phase 1 for several tensors of one size in ONE traced codec: the codec's ops compiled once.

Every compressed tensor's encode is a few dozen ops; a step that encodes ten tensors compiles
them ten times (XLA has no function reuse across call sites), which is most of what the codec
adds to a step's compile. The codec reads a shard and its cached slice element by element in
flat order, so shards of one element count can share one body: each is flattened, with its
cached slice, its priming flag and its checksum (computed on the shard as laid out, on its own
axis), and one ``lax.map`` encodes them all. The result of each is then given back its shape
and axis, bitwise what :func:`~ciera_jax.collective.gather.encode` returns for it alone.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.collective import bitfields
from ciera_jax.collective import DEFAULT_CODE_BITS
import ciera_jax.collective.gather as collective
from ciera_jax.collective import validation
from ciera_jax.collective import exponent_mode
from ciera_jax.collective import word_mode
from ciera_jax.collective.cache import WordCache


def signature(x: jax.Array, cache, lead: int) -> tuple:
    """What shards must share to be encoded together: leading (layer) dims, element count per
    layer, dtype and cache kind (its stored dtype too)."""
    stored = cache.words if isinstance(cache, WordCache) else cache.exp
    return (x.shape[:lead], math.prod(x.shape[lead:]), str(x.dtype), type(cache).__name__,
            str(stored.dtype))


def encode_same_size(xs: list, caches: list, axis_name, *, axes: list, lead: int = 0,
                     impl: str = "auto", code_bits: int = DEFAULT_CODE_BITS,
                     names: list | None = None) -> list:
    """``xs``: shards with ``lead`` leading layer dims and the same :func:`signature`;
    ``caches``: theirs (stacked like them); ``axes``: each one's gather axis (of one layer).
    Returns each one's ``Encoded`` / ``WordEncoded`` (stacked like it)."""
    names = names or [f"tensor{i}" for i in range(len(xs))]
    if len({signature(x, c, lead) for x, c in zip(xs, caches)}) != 1:
        raise ValueError(f"encode_same_size: {names} differ in size, dtype or cache kind")
    word = isinstance(caches[0], WordCache)
    n_ranks = validation.axis_size(axis_name, names[0])

    def flat(x, cache, axis, name):
        """One layer: (shard, cached slice) flat, the priming flag, the shard's checksum."""
        v = collective.local_view(x, cache, axis_name, axis, name)
        # carried as bits: XLA:CPU may copy a bf16 array through float32 (quiets NaN payloads)
        return (bitfields.to_bits(v.x).reshape(-1), v.cached.reshape(-1), cache.primed,
                v.checksum)

    rows = []
    for x, c, ax, name in zip(xs, caches, axes, names):
        one = lambda x, c, ax=ax, name=name: flat(x, c, ax, name)  # noqa: E731
        for _ in range(lead):
            one = jax.vmap(one)
        rows.append(one(x, c))
    per = math.prod(xs[0].shape[:lead])  # rows per tensor
    stacked = jax.tree.map(lambda *a: jnp.concatenate(
        [b.reshape((per,) + b.shape[lead:]) for b in a]), *rows)

    dtype = xs[0].dtype

    def body(row):
        bits_n, cached_n, primed, csum = row
        x_n = bitfields.from_bits(bits_n, dtype)
        if word:
            return word_mode.encode(x_n, cached_n, primed, 0, n_ranks, csum, impl, code_bits,
                                      lambda i: cached_n[i])
        return exponent_mode.encode(x_n, cached_n, primed, 0, n_ranks, csum, impl)

    encoded = lax.map(body, stacked)
    out = []
    for j, (x, ax) in enumerate(zip(xs, axes)):
        e = jax.tree.map(lambda a: a[j * per:(j + 1) * per].reshape(
            x.shape[:lead] + a.shape[1:]), encoded)
        layer = jax.ShapeDtypeStruct(x.shape[lead:], x.dtype)
        out.append(_shaped(e, x.shape[lead:], validation.normalize_axis(layer, ax, names[j])))
    return out


def _shaped(e, shard_shape: tuple, axis: int):
    """A flat shard's Encoded -> the shard's own (its shape and gather axis): the same bytes."""
    if isinstance(e, word_mode.WordEncoded):
        return dataclasses.replace(e, axis=axis, shard_shape=tuple(shard_shape))
    payload = e.payload.reshape(e.payload.shape[:-1] + tuple(shard_shape))
    return dataclasses.replace(e, payload=payload, axis=axis)

"""Buckets: a gathering module's small compressed tensors gathered as ONE tensor.

A compressed gather costs a fixed few dozen ops and two or three collectives whatever its size,
so a layer of small tensors pays that cost per tensor, in compile time and on the clock. As FSDP
implementations flatten a layer's parameters, a bucket concatenates its members' flat shards
into one 1-D shard and views their caches as the cache of that 1-D tensor; one encode, one
agreement entry, one exchange and one self-check serve them all, and the full tensors and new
caches are cut back out. The bytes are those of the members' own gathers (the same codec over
the same words), the result bitwise the same.

Members share a gathering module, a stack, a compute dtype, a cache mode and the mesh axes they
stay split on; a tensor whose one layer has more than :data:`MAX_ELEMENTS` elements is gathered
alone (its fixed cost is paid back by its size, and joining it would copy it), and a bucket
holds at most :data:`MAX_BUCKET_ELEMENTS` per layer (the joined caches are a transient copy).
Layout of a bucket's full (1-D) tensor: rank-major, rank ``r``'s shard at ``[r*S, (r+1)*S)``,
each member's flat shard in member order inside it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.collective import cache as cache_lib
from ciera_jax.collective import bitfields, layout
from ciera_jax.collective.gradient import attach_gather_grad
from ciera_jax.fsdp.state.inventory import GatheredTensor
from ciera_jax.runtime.partition import kept_axes

MAX_ELEMENTS = 1 << 20  # one layer's full tensor; above it a tensor is gathered alone
# one layer of a bucket's full tensor: a gather holds a joined copy of its members' caches and
# of the new ones for a moment, so this bounds that transient memory (words: 2 B per element)
MAX_BUCKET_ELEMENTS = 1 << 21
KEY_MARK = "[bucket]"  # bucket keys: "<gatherer>/[bucket]<i>"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BucketEncoded:
    """A bucket's ``Encoded`` / ``WordEncoded`` and its ``members`` (keys, static): the
    tensors it gathers, in the order their flat shards are joined."""

    encoded: object
    members: tuple = dataclasses.field(metadata=dict(static=True))


def is_bucket(encoded) -> bool:
    return isinstance(encoded, BucketEncoded)


def unwrap(encoded):
    """The codec's ``Encoded`` inside a bucket's (or ``encoded`` itself)."""
    return encoded.encoded if is_bucket(encoded) else encoded


def groups(tensors: dict, caches: dict, axis_name: str, keys=None) -> dict:
    """``{bucket key: member keys}`` over the compressed tensors (``keys``; default: every
    tensor with a cache): members share a gathering module, stack, dtype, cache mode and
    kept mesh axes, have at most :data:`MAX_ELEMENTS` elements per layer, and number two or
    more; a group past :data:`MAX_BUCKET_ELEMENTS` fills another bucket, in model order.
    Deterministic: model order in, the same buckets out on every process."""
    keys = [k for k in tensors if k in caches] if keys is None else list(keys)
    by: dict = {}
    for k in keys:
        t, c = tensors[k], caches[k]
        if not (cache_lib.is_cache(c) and bitfields.is_compressible(t.dtype)
                and math.prod(t.shape) <= MAX_ELEMENTS):
            continue
        group = (t.gatherer, t.stack, np.dtype(t.dtype).str, c.mode,
                 kept_axes(t.spec, axis_name))
        bins = by.setdefault(group, [[]])
        size = sum(math.prod(tensors[m].shape) for m in bins[-1])
        if size + math.prod(t.shape) > MAX_BUCKET_ELEMENTS:
            bins.append([])
        bins[-1].append(k)
    joined = [(group[0], tuple(members)) for group, bins in by.items() for members in bins
              if len(members) > 1]
    return {f"{gatherer}/{KEY_MARK}{i}" if gatherer else f"{KEY_MARK}{i}": members
            for i, (gatherer, members) in enumerate(joined)}


def local_tensor(t: GatheredTensor, shard_shape, n_ranks: int) -> GatheredTensor:
    """``t`` with the full shape of this device's shard (one layer): what a bucket joins."""
    shape = list(shard_shape)
    shape[t.axis] *= n_ranks
    return dataclasses.replace(t, shape=tuple(shape), stack=0)


def tensor_of(key: str, members_t: list) -> GatheredTensor:
    """The bucket as a tensor of its own (one layer): 1-D, split on axis 0. ``members_t``:
    :func:`local_tensor` of each member."""
    first = members_t[0]
    n = sum(math.prod(t.shape) for t in members_t)
    return GatheredTensor(key, 0, (n,), first.dtype, 0, "", first.spec, first.gatherer)


def joined(key: str, members, tensors: dict, shards: dict, caches: dict, n_ranks: int,
           lead: int = 0):
    """A bucket as one tensor: ``(tensor, shard, cache, members_t)`` from its members'
    ``shards`` (``[L,] *shard``, ``lead`` leading layer dims) and caches; ``members_t``
    (:func:`local_tensor` of each member, one layer) cuts the results back out."""
    members_t = [local_tensor(tensors[k], shards[k].shape[lead:], n_ranks) for k in members]
    return (tensor_of(key, members_t), join_shards([shards[k] for k in members], lead),
            join_caches([caches[k] for k in members], members_t, n_ranks, lead), members_t)


# --------------------------------------------------------------------------- layout


def join_shards(shards: list, lead: int = 0) -> jax.Array:
    """Members' shards ([L,] *shard), ``lead`` leading dims kept -> the bucket's ([L,] S).
    Joined as bits: XLA:CPU may run a bf16 copy through float32, which quiets NaN payloads.
    No gradient flows through (see :func:`split_gathered`)."""
    dtype = shards[0].dtype
    bits = [bitfields.to_bits(lax.stop_gradient(s)) for s in shards]
    return bitfields.from_bits(jnp.concatenate(
        [b.reshape(b.shape[:lead] + (-1,)) for b in bits], axis=-1), dtype)


def split_gathered(full, members_t: list, shards: list, axis_name: str, n_ranks: int) -> list:
    """The bucket's gathered tensor (one layer) -> each member's full tensor, cut as bits and
    differentiating as an all-gather of its own shard."""
    parts = split_full(bitfields.to_bits(full), members_t, n_ranks)
    return [attach_gather_grad(s, bitfields.from_bits(b, full.dtype), axis_name, t.axis)
            for b, t, s in zip(parts, members_t, shards)]


def _shard_shape(t: GatheredTensor, n_ranks: int) -> tuple[int, ...]:
    shape = list(t.shape)
    shape[t.axis] //= n_ranks
    return tuple(shape)


def _per_layer(fn, x, lead: int):
    """``fn`` over ``x``'s ``lead`` leading (layer) dims."""
    for _ in range(lead):
        fn = jax.vmap(fn)
    return fn(x)


def join_full(fulls: list, members_t: list, n_ranks: int, lead: int = 0) -> jax.Array:
    """Members' full tensors ([L,] *shape) -> the bucket's full ([L,] N*S), rank-major."""
    rows = [_per_layer(lambda a, t=t: layout.full_to_rows(a, _shard_shape(t, n_ranks), t.axis,
                                                          n_ranks), f, lead)
            for f, t in zip(fulls, members_t)]
    joined = jnp.concatenate(rows, axis=-1)
    return joined.reshape(joined.shape[:lead] + (-1,))


def split_full(full, members_t: list, n_ranks: int, lead: int = 0) -> list:
    """The bucket's full ([L,] N*S) -> each member's full ([L,] *shape)."""
    rows = full.reshape(full.shape[:lead] + (n_ranks, -1))
    out, at = [], 0
    for t in members_t:
        n = math.prod(t.shape) // n_ranks
        out.append(_per_layer(lambda a, t=t: layout.rows_to_full(a, _shard_shape(t, n_ranks),
                                                                 t.axis),
                              rows[..., at:at + n], lead))
        at += n
    return out


def join_caches(caches: list, members_t: list, n_ranks: int, lead: int = 0):
    """Members' caches (one mode) -> the bucket's: their arrays joined like the full tensors,
    primed only where every member is."""
    first = caches[0]
    primed = jnp.all(jnp.stack([c.primed for c in caches]), axis=0)
    if isinstance(first, cache_lib.WordCache):
        words = join_full([c.words for c in caches], members_t, n_ranks, lead)
        return dataclasses.replace(first, words=words, primed=primed)
    exp = join_full([c.exp for c in caches], members_t, n_ranks, lead)
    return dataclasses.replace(first, exp=exp, primed=primed)


def split_cache(cache, members_t: list, n_ranks: int) -> list:
    """The bucket's new cache -> each member's (one layer)."""
    if isinstance(cache, cache_lib.WordCache):
        return [dataclasses.replace(cache, words=w)
                for w in split_full(cache.words, members_t, n_ranks)]
    return [dataclasses.replace(cache, exp=e) for e in split_full(cache.exp, members_t, n_ranks)]


SHARED_STATS = ("rung", "fallback", "verify_failed")


def split_stats(stats: dict, members_t: list) -> list:
    """The bucket's stats -> each member's: sizes and ``changed`` shared out by element
    count (the shares add up to the bucket's exactly; a member's ``changed`` is the bucket's
    rate, not its own count), the rest the bucket's."""
    sizes = np.array([math.prod(t.shape) for t in members_t], np.float64)
    ends = np.cumsum(sizes) / sizes.sum()
    out = [{k: stats[k] for k in SHARED_STATS if k in stats} for _ in members_t]
    for k, v in stats.items():
        if k in SHARED_STATS:
            continue
        v32 = jnp.asarray(v).astype(jnp.float32)
        bounds = [jnp.floor(v32 * np.float32(e)).astype(jnp.int32) for e in ends[:-1]]
        bounds = [jnp.int32(0)] + bounds + [jnp.asarray(v).astype(jnp.int32)]
        for i in range(len(members_t)):
            out[i][k] = bounds[i + 1] - bounds[i]
    return out

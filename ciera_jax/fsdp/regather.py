"""A backward pass's second gather of exponent-cache tensors: sign + mantissa only.

Between a step's forward and its backward the shards do not change, and the forward's gather
left in each exponent cache exactly the exponents of the full weights it delivered (what its
decode read: patched, healed or from a fallback). So the backward needs only the payload bytes:
one unconditional all-gather of 1 byte per bf16 element (3 per float32), merged with the cached
exponents. No escapes, patches, agreement, fallback or self-check, and no codec to compile
twice; the bits are those of the forward's gather. A bucket's members travel as one transfer.

Shape letters: N ranks, P payload planes, S elements of a bucket's joined shard.
"""

from __future__ import annotations

import jax
from jax import lax

try:  # experimental in jax 0.10; where a JAX has moved it, XLA picks the layout (the same bits)
    from jax.experimental.layout import Layout, with_layout_constraint
except ImportError:  # pragma: no cover - not in the JAX this project pins for CI
    Layout = with_layout_constraint = None

from ciera_jax.collective import bitfields
from ciera_jax.fsdp import buckets


def regather(tensors: dict, shards: dict, caches: dict, groups, axis_name: str,
             n_ranks: int) -> dict:
    """``{key: full}`` for every key of ``groups`` (tuples of keys; a tuple of two or more is
    a bucket: one transfer), each from its exponent cache (``caches[key].exp``, the full
    tensor's) and an all-gather of its shard's payload bytes."""
    fulls = {}
    for members in groups:
        if len(members) == 1:
            (k,) = members
            t = tensors[k]
            fulls[k] = bitfields.merge(_row_major(caches[k].exp),
                                       _payload_gather(shards[k], t.axis, axis_name), t.dtype)
            continue
        members_t = [buckets.local_tensor(tensors[k], shards[k].shape, n_ranks) for k in members]
        joined = buckets.join_shards([shards[k] for k in members])
        payloads = buckets.split_full(_payload_gather(joined, 0, axis_name), members_t, n_ranks,
                                      lead=1)
        for k, payload_Pxn in zip(members, payloads):
            fulls[k] = bitfields.merge(_row_major(caches[k].exp), payload_Pxn, tensors[k].dtype)
    return fulls


def _payload_gather(shard: jax.Array, axis: int, axis_name: str) -> jax.Array:
    """The full tensor's payload planes ``(P, *full)``: one tiled all-gather of the shard's."""
    _, payload_Pxn = bitfields.split(lax.stop_gradient(shard))
    return lax.all_gather(payload_Pxn, axis_name, axis=axis + 1, tiled=True)


def _row_major(exp: jax.Array) -> jax.Array:
    """A layer's cached exponents in the cache's own (row-major) layout. XLA:GPU lays an
    all-gather's result out with the gathered axis major; merged with it, the exponents would
    follow, and layout assignment would transpose the backward loop's whole cache stack once,
    before the loop, rather than a layer at a time in it (a whole stack's copy at once;
    ``tests/test_aot.py`` checks it)."""
    if with_layout_constraint is None:
        return exp
    return with_layout_constraint(exp, Layout(tuple(range(exp.ndim))))

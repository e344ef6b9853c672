"""A train step's CIERA phases over its whole inventory: encode every compressed tensor (at the
end of the previous step, off the critical path) and agree on all their demands with ONE
collective. :func:`~ciera_jax.fsdp.prepare` hands both to the model, whose gathers then
exchange each at its agreed rung.

When the agreement also runs at the end of the previous step, the host reads each tensor's
needed rung (:func:`needed_rungs`) before the step and fixes the rungs the step is compiled at
(:func:`fix_rungs`; a policy such as :class:`~ciera_jax.loop.rungs.RungPolicy` picks
them): the step then holds no agreement collective and no collective in a conditional but the
fallback's (:mod:`ciera_jax.collective.capacity`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ciera_jax.collective.gather as collective
from ciera_jax.collective import bitfields
from ciera_jax.collective import ExponentWire, WordWire
from ciera_jax.collective import capacity
from ciera_jax.fsdp import buckets, encode_group
from ciera_jax.fsdp.state.axes import AXIS, axis_size


def encode_tensors(tensors: dict, params: dict, caches: dict, compress: dict,
                   axis_name: str = AXIS, impl: str = "auto") -> dict:
    """Phase 1 for every compressed tensor (inside ``shard_map``): ``{key: Encoded}``, where
    a bucket of small tensors (:mod:`~ciera_jax.fsdp.buckets`) has one entry, keyed by bucket,
    holding a ``BucketEncoded``.

    ``params``: ``{key: local shard}`` (any float dtype; cast to the tensor's compute dtype);
    ``caches``: ``{key: cache}``; stacked tensors are encoded layer by layer, so their Encoded
    leaves carry the layer axis first. Tensors (or buckets) of one size and cache kind are
    encoded by one traced codec (:mod:`~ciera_jax.fsdp.encode_group`).
    """
    keys = [k for k in tensors if compress.get(k, False)]
    bucket_of = buckets.groups(tensors, caches, axis_name, keys)
    n_ranks = axis_size(axis_name)
    shards = {k: params[k].astype(tensors[k].dtype) for k in keys}
    units = {k: (tensors[k], shards[k], caches[k]) for k in keys}
    for key, members in bucket_of.items():
        stack = tensors[members[0]].stack
        t, shard, cache, _ = buckets.joined(key, members, tensors, shards, caches, n_ranks,
                                            lead=1 if stack else 0)
        units[key] = (dataclasses.replace(t, stack=stack), shard, cache)
        for k in members:
            del units[k]
    by_size: dict = {}  # tensors of one size and cache kind share one traced codec
    for key, (t, shard, cache) in units.items():
        lead = 1 if t.stack else 0
        by_size.setdefault(encode_group.signature(shard, cache, lead), []).append(key)
    out = {}
    for keys_g in by_size.values():
        if len(keys_g) == 1:
            done = [_encode_alone(*units[keys_g[0]], axis_name, impl)]
        else:
            done = encode_group.encode_same_size(
                [units[k][1] for k in keys_g], [units[k][2] for k in keys_g], axis_name,
                axes=[units[k][0].axis for k in keys_g],
                lead=1 if units[keys_g[0]][0].stack else 0, impl=impl, names=list(keys_g))
        for key, e in zip(keys_g, done):
            out[key] = buckets.BucketEncoded(e, bucket_of[key]) if key in bucket_of else e
    return {key: out[key] for key in units}  # model order


def _encode_alone(t, shard, cache, axis_name, impl):
    """One tensor's (or bucket's) encode; a stack layer by layer with ``lax.map`` over its
    bits (one traced body; a bf16 slice on XLA:CPU may run through float32 and quiet NaN
    payloads; vmap would turn the encode's branches into selects of all of them)."""
    def enc(s, c):
        return collective.encode(s, c, axis_name, axis=t.axis, impl=impl, name=t.key)

    if not t.stack:
        return enc(shard, cache)
    return lax.map(lambda bc: enc(bitfields.from_bits(bc[0], shard.dtype), bc[1]),
                   (bitfields.to_bits(shard), cache))


def agree_tensors(tensors: dict, encoded: dict, axis_name: str = AXIS) -> dict:
    """Phase 2: ONE ``agree`` (one ``pmax``) over the demand of every layer of every encoded
    tensor or bucket. Returns ``{key: agreed}`` (per layer for stacks)."""
    def stack(key):
        e = encoded[key]
        return tensors[e.members[0] if buckets.is_bucket(e) else key].stack

    flat, where = [], []
    for key, e in encoded.items():
        e = buckets.unwrap(e)
        for layer in range(stack(key)) if stack(key) else (None,):
            flat.append(e if layer is None else jax.tree.map(lambda a, i=layer: a[i], e))
            where.append(key)
    agreed = collective.agree(flat, axis_name) if flat else []
    out: dict = {}
    for key, a in zip(where, agreed):
        out.setdefault(key, []).append(a)
    return {k: (jnp.stack(v) if stack(k) else v[0]) for k, v in out.items()}


def priming_inputs(tensors: dict, encoded_shapes: dict, n_ranks: int) -> dict:
    """Host-side ``{key: Encoded}`` asking every tensor and bucket for a priming gather
    (:func:`ciera_jax.priming_encoded`), shaped like ``encoded_shapes`` (from
    ``jax.eval_shape`` of :func:`encode_tensors`): for fresh or restored caches."""
    out = {}
    for k, e in encoded_shapes.items():
        members = e.members if buckets.is_bucket(e) else (k,)
        n_local = sum(math.prod(tensors[m].shape) // n_ranks for m in members)
        primed = collective.priming_encoded(buckets.unwrap(e), n_local)
        out[k] = buckets.BucketEncoded(primed, members) if buckets.is_bucket(e) else primed
    return out


def needed_rungs(tensors: dict, encoded: dict, agreed: dict) -> dict:
    """``{key: int32 needed rung}`` (per layer for stacks): the smallest rung holding each
    tensor's or bucket's agreed demand, its wire's ``rungs`` above the top or for an unprimed
    cache. Rank-invariant, like ``agreed``: the host reads it to fix the next step's rungs."""
    out = {}
    for key, e in encoded.items():
        inner = buckets.unwrap(e)
        stacked = tensors[e.members[0] if buckets.is_bucket(e) else key].stack
        layer = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), inner)
                 if stacked else inner)
        out[key] = capacity.needed_rung(layer.wire, agreed[key])
    return out


def fix_rungs(agreed: dict, rungs: dict, needed: dict | None = None,
              exits: int | dict = 0, guaranteed: bool = False) -> dict:
    """``agreed`` with each key's rung fixed at ``rungs[key]`` (an int, or
    :data:`~ciera_jax.collective.capacity.PLAIN_RUNG`): what :func:`~ciera_jax.fsdp.prepare`
    takes for a step compiled at those rungs. ``needed``: :func:`needed_rungs` of the same
    agreement, when it was computed with it (the gathers then need not compute it again);
    ``exits``: word mode's overflow rungs (:func:`ciera_jax.collective.capacity.fix`), for
    every key or ``{key: exits}`` (a key left out: none); ``guaranteed``: the rungs hold
    every layer's demand (the host checked ``needed``): the step compiles no fallback and no
    conditional (:func:`ciera_jax.collective.capacity.fix`)."""
    missing = sorted(set(agreed) - set(rungs))
    if missing:
        raise ValueError(f"no rung for {missing}")
    return {k: capacity.fix(a, rungs[k], None if needed is None else needed[k],
                            exits.get(k, 0) if isinstance(exits, dict) else exits, guaranteed)
            for k, a in agreed.items()}


def unit_layers(tensors: dict, encoded_shapes: dict) -> dict:
    """``{key: layers}`` of each tensor and bucket (1 for one not stacked): how many times a
    step sends what :func:`wires` prices for one layer."""
    return {k: tensors[e.members[0] if buckets.is_bucket(e) else k].stack or 1
            for k, e in encoded_shapes.items()}


def wires(tensors: dict, encoded_shapes: dict, n_ranks: int) -> dict:
    """Host-side ``{key: ExponentWire | WordWire}`` of one layer of each tensor and bucket,
    from ``encoded_shapes`` (as :func:`priming_inputs` takes them): what a rung policy prices."""
    out = {}
    for k, e in encoded_shapes.items():
        members = e.members if buckets.is_bucket(e) else (k,)
        n_local = sum(math.prod(tensors[m].shape) // n_ranks for m in members)
        inner = buckets.unwrap(e)
        width = np.dtype(tensors[members[0]].dtype).itemsize
        out[k] = (WordWire(n_local, width, inner.code_bits)
                  if isinstance(inner, collective.WordEncoded) else ExponentWire(n_local, width))
    return out

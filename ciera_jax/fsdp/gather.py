"""The one gather every path of :mod:`ciera_jax.fsdp` calls: shards, caches and the setup in;
full weights, new caches and stats out, as values.

:func:`gather` runs inside ``shard_map`` (the user's, or the train step's); :func:`gather_region`
opens a ``shard_map`` of its own around it (a call under ``jit`` with the mesh set). The
caller says which tensors (:class:`~ciera_jax.fsdp.GatheredTensor`), the mode
(:class:`~ciera_jax.fsdp.state.setup.GatherSetup`), and, when a train step prepared them, each compressed tensor's ``Encoded`` and agreement; without
them a ``ciera`` gather encodes every tensor it has a cache for and agrees on all of them with
ONE collective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import ciera_jax.collective.gather as collective
import ciera_jax.collective.quantized as quantized
from ciera_jax.fsdp import buckets
from ciera_jax.fsdp.state.ahead import rank_spec
from ciera_jax.fsdp.state.axes import axis_bound, axis_size, invariant
from ciera_jax.fsdp.state.inventory import GatheredTensor
from ciera_jax.fsdp.state.setup import GatherSetup
from ciera_jax.runtime.partition import kept_axes, names_of, without_axis


def _gather_one(t: GatheredTensor, shard, gin, setup: GatherSetup, axis_name: str,
               region: bool = False):
    """Gather one layer's shard: (full, new cache or None, stats). ``gin``: (Encoded, cache,
    agreed) for a compressed gather, None for the mode's plain / int8 gather. Stats are summed
    (sizes, counts) or maxed (rung, fallback) over the other mesh axes the tensor stays split
    on; ``region``: in a ``shard_map`` of our own (no varying types), so per-rank counts are
    summed over the gather axis unconditionally. ``verify_failed`` stays per rank in a
    prepared step (it rides on the step's norm psum)."""
    ax = axis_name
    plain = jnp.int32(shard.size * shard.dtype.itemsize)
    new_cache = None
    if gin is not None:
        e, cache, agreed = gin
        full, new_cache, st = collective.exchange(shard, e, cache, agreed, ax, impl=setup.impl)
        failed = jnp.asarray(st["verify_failed"]).astype(jnp.int32)
        changed = jnp.asarray(st["changed"]).astype(jnp.int32)
        if not region:  # varying types tell what is still per rank
            changed = invariant(changed, ax, lax.psum)
            failed = failed if setup.prepared else invariant(failed, ax, lax.psum)
        stats = dict(sent_bytes=st["sent_bytes"], plain_bytes=st["plain_bytes"],
                     changed=changed, rung=st["rung"],
                     fallback=st["fallback"].astype(jnp.int32), verify_failed=failed)
    else:
        if setup.mode == "int8":
            full = quantized.int8_all_gather(shard, ax, axis=t.axis).astype(shard.dtype)
            sent = jnp.int32(quantized.wire_bytes(shard.size))
        else:
            full = collective.plain_all_gather(shard, ax, axis=t.axis)
            sent = plain
        stats = dict(sent_bytes=sent, plain_bytes=plain, changed=jnp.int32(0),
                     rung=jnp.int32(-1), fallback=jnp.int32(0), verify_failed=jnp.int32(0))
    stats["elements"] = jnp.int32(full.size)
    stats = {k: jnp.asarray(v).astype(jnp.int32) for k, v in stats.items()}
    others = tuple(a for a in kept_axes(t.spec, ax) if axis_bound(a))
    # One rank of the gather axis: its blocks on the other axes together. Sizes scale
    # statically; rung and fallback are agreed over every axis already; the per-rank counts
    # take ONE psum, after the gather (the barrier), so no device can enter it while another
    # still waits in the gather (collectives in different orders on different devices
    # deadlock).
    scale = int(np.prod([axis_size(a) for a in others])) if others else 1
    for k in ("sent_bytes", "plain_bytes", "elements"):
        stats[k] = stats[k] * scale
    sum_axes = ((ax,) if region and gin is not None else ()) + (others if gin is not None
                                                                else ())
    if sum_axes:
        counts = jnp.stack([stats["changed"], stats["verify_failed"]])
        full, counts = lax.optimization_barrier((full, counts))
        counts = lax.psum(counts, sum_axes)
        stats["changed"] = counts[0]
        if not setup.prepared:
            stats["verify_failed"] = counts[1]
    return full, new_cache, {k: lax.stop_gradient(v) for k, v in stats.items()}


def gather_inputs(tensors: dict, shards: dict, caches: dict, setup: GatherSetup, axis_name: str,
                  prepared: dict | None = None) -> dict:
    """``{key: (Encoded, cache, agreed) or None}``: a prepared step's (``prepared``: ``{key:
    (Encoded, agreed)}``, the keys it compresses), else, in ``ciera`` mode, every tensor with
    a cache encoded here and agreed on with ONE collective."""
    if prepared is not None:
        return {k: (buckets.unwrap(prepared[k][0]), caches[k], prepared[k][1])
                if k in prepared else None for k in tensors}
    if setup.mode != "ciera":
        return {k: None for k in tensors}
    enc = {k: collective.encode(lax.stop_gradient(shards[k]), caches[k], axis_name,
                                axis=t.axis, impl=setup.impl, name=t.key)
           for k, t in tensors.items() if caches.get(k) is not None}
    agreed = collective.agree(enc, axis_name) if enc else {}
    return {k: (enc[k], caches[k], agreed[k]) if k in enc else None for k in tensors}


def gather(tensors: dict, shards: dict, caches: dict, setup: GatherSetup, axis_name: str,
           prepared: dict | None = None, region: bool = False):
    """Gather a call's shards (inside ``shard_map``): ``(fulls, new_caches, stats)``, each
    ``{key: ...}``; ``new_caches`` holds the compressed tensors' only.

    Small compressed tensors of one gathering module go as one bucket
    (:mod:`~ciera_jax.fsdp.buckets`): a prepared step's buckets are its ``BucketEncoded``
    entries (keyed by bucket, not tensor), else they are formed here."""
    if prepared is not None:
        bucket_of = {k: e.members for k, (e, _) in prepared.items() if buckets.is_bucket(e)}
    elif setup.mode == "ciera":
        bucket_of = buckets.groups(tensors, caches, axis_name)
    else:
        bucket_of = {}
    n_ranks = axis_size(axis_name)
    joined_t, joined_s, joined_c, members_t = dict(tensors), dict(shards), dict(caches), {}
    for key, members in bucket_of.items():
        joined_t[key], joined_s[key], joined_c[key], members_t[key] = buckets.joined(
            key, members, tensors, shards, caches, n_ranks)
        for k in members:
            del joined_t[k], joined_s[k], joined_c[k]
    inputs = gather_inputs(joined_t, joined_s, joined_c, setup, axis_name, prepared)
    fulls, new_caches, stats = {}, {}, {}
    for k, t in joined_t.items():
        fulls[k], c, stats[k] = _gather_one(t, joined_s[k], inputs[k], setup, axis_name, region)
        if c is not None:
            new_caches[k] = c
    for key, members in bucket_of.items():
        mt = members_t[key]
        parts = zip(members, buckets.split_gathered(fulls.pop(key), mt,
                                                    [shards[k] for k in members], axis_name,
                                                    n_ranks),
                    buckets.split_cache(new_caches.pop(key), mt, n_ranks),
                    buckets.split_stats(stats.pop(key), mt))
        for k, full, cache, st in parts:
            fulls[k], new_caches[k], stats[k] = full, cache, st
    return ({k: fulls[k] for k in tensors}, new_caches, {k: stats[k] for k in tensors})


def gather_region(tensors: dict, shards: dict, caches: dict, setup: GatherSetup, axis_name: str,
                  ahead: dict | None = None):
    """:func:`gather` in a ``shard_map`` region of its own (under ``jit`` with the mesh set).
    Each shard comes in with its parameter's own spec (the gather axis and any other mesh
    axes, e.g. ``tp``); its full weight and cache leave gathered over the gather axis only,
    still split over the others; stats leave replicated. The rest of the model stays under
    sharding propagation (Auto axes) or sharding in types (Explicit axes). ``ahead``: ``{key:
    (Encoded per rank, agreed)}`` made before the step (:mod:`~ciera_jax.fsdp.state.ahead`):
    each ``Encoded`` comes in split over its leading rank axis, and is gathered as a prepared
    step's."""
    ax = axis_name
    shard_specs = {k: P(*t.spec) for k, t in tensors.items()}
    full_specs = {k: P(*without_axis(t.spec, ax)) for k, t in tensors.items()}
    cache_specs = {k: cache_specs_of(caches[k], tensors[k], ax) for k in caches}
    ahead_specs = {k: _ahead_spec(k, e, a, tensors) for k, (e, a) in (ahead or {}).items()}
    shards = {k: _to_spec(v, shard_specs[k]) for k, v in shards.items()}
    caches = {k: jax.tree.map(_to_spec, caches[k], cache_specs[k]) for k in caches}
    ahead = {k: jax.tree.map(_to_spec, ahead[k], ahead_specs[k]) for k in ahead_specs}

    def body(s, c, a):
        mine = {k: (jax.tree.map(lambda x: x[0], e), agreed) for k, (e, agreed) in a.items()}
        return gather(tensors, s, c, setup, ax, prepared=mine or None, region=True)

    return jax.shard_map(body, in_specs=(shard_specs, cache_specs, ahead_specs),
                         out_specs=(full_specs, cache_specs, P()),
                         check_vma=False)(shards, caches, ahead)


def _ahead_spec(key: str, encoded, agreed, tensors: dict):
    """In_specs of one key's inputs made ahead: the encoded leaves split on their rank axis
    (a bucket's: its first member's), the agreement replicated."""
    spec = rank_spec(tensors[encoded.members[0] if buckets.is_bucket(encoded) else key].spec)
    return (jax.tree.map(lambda _: spec, encoded), jax.tree.map(lambda _: P(), agreed))


def cache_specs_of(cache, t: GatheredTensor, axis_name: str, layers: bool = False):
    """Per leaf of one cache: leaves shaped like the tensor are split like its gathered
    weight (the parameter's spec without the gather axis), the rest (flags) replicated;
    ``layers``: every leaf has a whole layer axis first (a layer stack's cache)."""
    lead, kept = (None,) * layers, without_axis(t.spec, axis_name)
    return jax.tree.map(lambda leaf: P(*lead, *kept) if any(kept)
                        and jnp.ndim(leaf) == len(lead) + len(t.shape) else P(), cache)


def _to_spec(x, spec: P):
    """On a mesh with Explicit axes, ``x`` resharded to ``spec`` (its Explicit axes): a
    ``shard_map`` there takes inputs whose type carries exactly its in_specs. No-op on Auto
    axes (``shard_map`` reshards) and when ``x`` already has the layout."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = {a for a, k in zip(mesh.axis_names, mesh.axis_types)
                if k == jax.sharding.AxisType.Explicit}
    if not explicit:
        return x
    keep = []
    for e in spec:
        names = tuple(a for a in names_of(e) if a in explicit)
        keep.append(None if not names else names[0] if len(names) == 1 else names)
    target = P(*keep)
    current = getattr(jax.typeof(x), "sharding", None)
    if current is not None and tuple(current.spec) + (None,) * (jnp.ndim(x) - len(
            current.spec)) == tuple(target) + (None,) * (jnp.ndim(x) - len(target)):
        return x
    return jax.sharding.reshard(x, target)

"""Global-norm gradient clipping over sharded gradients: split leaves add their shards' squares
over the mesh axis, replicated leaves count once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.fsdp.state.axes import AXIS, invariant
from ciera_jax.fsdp.state.specs import is_split, spec_pairs


def global_sq_norm(tree, specs, axis_name: str = AXIS, *, also_sum=None):
    """Squared global L2 norm of a sharded pytree inside shard_map.

    ``specs`` (a prefix of ``tree``) says which leaves are split over ``axis_name``: those
    contribute the psum of their shards' squares; replicated leaves are counted once (they
    are the same on every rank). ``also_sum``: a small int32 vector summed over the axis in
    the same ``psum`` (e.g. the gathers' self-check failures), returned as a second value.
    """
    sharded, repl = jnp.float32(0), jnp.float32(0)
    for spec, sub in spec_pairs(specs, tree):
        sq = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(sub)),
                 jnp.float32(0))
        if is_split(spec, axis_name):
            sharded = sharded + sq
        else:
            repl = repl + sq
    if also_sum is None:
        return invariant(sharded, axis_name, lax.psum) + invariant(repl, axis_name)
    # One collective for both: counts ride as float32 (exact below 2**24).
    packed = jnp.concatenate([sharded[None], jnp.asarray(also_sum, jnp.float32).reshape(-1)])
    summed = invariant(packed, axis_name, lax.psum)
    return summed[0] + invariant(repl, axis_name), summed[1:].astype(jnp.int32)


def clip_by_global_norm(grads, specs, max_norm: float, axis_name: str = AXIS, *,
                        also_sum=None):
    """Scale ``grads`` so their global norm is at most ``max_norm``; returns (grads, norm), or
    (grads, norm, summed) with ``also_sum`` (see :func:`global_sq_norm`)."""
    sq = global_sq_norm(grads, specs, axis_name, also_sum=also_sum)
    sq, summed = sq if also_sum is not None else (sq, None)
    norm = jnp.sqrt(sq)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
    grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    return (grads, norm) if also_sum is None else (grads, norm, summed)

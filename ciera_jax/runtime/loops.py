"""A loop over layers whose trip count XLA cannot see: :func:`rolled_scan`, the compressed
layer loop of a prepared train step (:mod:`ciera_jax.fsdp.prepared`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.runtime.hlo import TRIPS_SCOPE
from ciera_jax.runtime.varying import varying_over, vma


def rolled_scan(body, init, xs_N: jax.Array):
    """``lax.scan(body, init, xs_N)`` for a 1-D ``xs_N`` (the layer indices), as a while loop
    whose trip count XLA cannot see (its bound passes an optimization barrier), so XLA:GPU's
    double buffering, which would unroll the body twice and peel an odd count's extra trip,
    leaves one copy of it: the layer loop prefetches the next layer itself (docs/aot.md). The
    count stays in the loop's name scope (``runtime.hlo.TRIPS_SCOPE``) for the reports. The
    price: XLA:GPU syncs the host on such a loop's condition every trip. ``body`` is traced
    once, under :func:`jax.jit`, for the output buffers and the loop. No reverse-mode
    derivative (a while loop): the layer loop runs it in its custom VJP's forward."""
    length = xs_N.shape[0]
    if length < 2:  # XLA inlines a scan of one trip: no loop to roll, none to sync on
        return lax.scan(body, init, xs_N)
    body = jax.jit(body)
    _, out_shapes = jax.eval_shape(body, init, xs_N[0])

    def empty(s):
        z = jnp.zeros((length,) + s.shape, s.dtype)
        return varying_over(z, vma(s))  # typed as the trips' outputs are

    def trip(state):
        i, carry, outs = state
        carry, out = body(carry, lax.dynamic_index_in_dim(xs_N, i, keepdims=False,
                                                         allow_negative_indices=False))
        outs = jax.tree.map(lambda o, v: lax.dynamic_update_index_in_dim(
            o, v, i, 0, allow_negative_indices=False), outs, out)
        return i + 1, carry, outs

    with jax.named_scope(f"{TRIPS_SCOPE}{length}"):
        bound = lax.optimization_barrier(jnp.int32(length))
        _, carry, outs = lax.while_loop(lambda state: state[0] < bound, trip,
                                        (jnp.int32(0), init, jax.tree.map(empty, out_shapes)))
    return carry, outs

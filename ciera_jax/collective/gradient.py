"""The one backward every gather shares: ``psum_scatter`` of the cotangent.

Every gather here (CIERA in both modes, plain bits, int8) computes its result off the gradient
path and attaches it to the shard with :func:`attach_gather_grad`, so gradients are bitwise
those of ``lax.all_gather`` whatever travelled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def attach_gather_grad(x, full, axis_name, axis):
    """Returns ``full`` (computed without gradient); differentiates as an all-gather of x."""
    del x
    return full


def _attach_fwd(x, full, axis_name, axis):
    del x
    return full, None


def _attach_bwd(axis_name, axis, _, ct_full):
    dx = lax.psum_scatter(ct_full, axis_name, scatter_dimension=axis, tiled=True)
    return dx, jnp.zeros_like(ct_full)


attach_gather_grad.defvjp(_attach_fwd, _attach_bwd)

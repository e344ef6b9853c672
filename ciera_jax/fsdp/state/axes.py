"""Mesh axes as a decorated call sees them: is the gather axis bound (inside ``shard_map``), in
the ambient mesh (under ``jit`` with ``jax.set_mesh``), or nowhere; and making per-rank scalars
rank-invariant. No other fsdp module is imported here, so every one can import it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.runtime import partition
from ciera_jax.runtime.varying import vma

AXIS = partition.AXIS  # the gather axis: the fsdp modules take it from here
MANUAL, REGION, UNSHARDED = "manual", "region", "unsharded"


def axis_bound(axis_name: str) -> bool:
    """Is ``axis_name`` a manual axis here (inside ``jax.shard_map`` over it)?"""
    try:
        lax.axis_size(axis_name)
        return True
    except (NameError, KeyError, ValueError):
        return False


def placement(axis_name: str, where: str) -> str:
    """How a decorated call at ``where`` gathers over ``axis_name``.

    ``MANUAL``: inside the user's ``shard_map`` over the axis; ``REGION``: under ``jit`` with a
    mesh holding the axis (the call opens its own ``shard_map`` for the gathers);
    ``UNSHARDED``: no mesh at all (the parameters are whole: the reference path). A mesh without
    the axis is an error.
    """
    if axis_bound(axis_name):
        return MANUAL
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return UNSHARDED
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{where}: the gather axis {axis_name!r} is not an axis of the mesh "
            f"{tuple(mesh.axis_names)}; name one of them in @gathered(axis_name=...) or build "
            f"the mesh with an {axis_name!r} axis")
    return REGION


def axis_size(axis_name: str) -> int:
    """Ranks on ``axis_name``, bound or in the ambient mesh."""
    if axis_bound(axis_name):
        return lax.axis_size(axis_name)
    return jax.sharding.get_abstract_mesh().shape[axis_name]


def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` varies (JAX's varying-manual-axes type), frozen."""
    return frozenset(vma(x))


def invariant(x, axis_name: str, reduce=lax.pmax):
    """Make a per-rank scalar rank-invariant (reduce it only if it still varies over the axis)."""
    x = jnp.asarray(x)
    return reduce(x, axis_name) if axis_name in varying_axes(x) else x

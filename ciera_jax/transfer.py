"""The transfers of a compressed gather: the main plane, unconditional, and escape sections
sized by a rank-invariant rung.

The main plane's all-gather sits in the step's top-level computation, so XLA can schedule it
asynchronously and overlap it with compute. The escape section is a few max-capacity buffers;
:func:`gather_section` all-gathers a static prefix of each, as one transfer chosen by
``lax.switch`` on the agreed rung, and its branches hold nothing but that transfer, slices and
pads of the small buffers.

Shape letters: N ranks, L bytes per rank, C a capacity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def gather_rows(buf_L: jax.Array, axis_name) -> jax.Array:
    """(L,) per rank -> (N, L), rank-major, the same on every rank."""
    return lax.all_gather(buf_L, axis_name, axis=0, tiled=False, to="invarying")


def _to_bytes(a: jax.Array) -> jax.Array:
    if a.dtype.itemsize == 1:
        return lax.bitcast_convert_type(a, jnp.uint8)
    return lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)


def _from_bytes(rows_NxB: jax.Array, dtype, count: int) -> jax.Array:
    if np.dtype(dtype).itemsize == 1:
        return lax.bitcast_convert_type(rows_NxB, dtype)
    return lax.bitcast_convert_type(
        rows_NxB.reshape(rows_NxB.shape[0], count, np.dtype(dtype).itemsize), dtype)


def _prefixes(parts, *, sizes: tuple[int, ...], axis_name):
    """One transfer: the first ``sizes[i]`` entries of every part, as bytes, in one gather;
    back as (N, len(part)) per part, zero past the prefix."""
    n_ranks = lax.axis_size(axis_name)
    out = [jnp.zeros((n_ranks, p.shape[0]), p.dtype) for p in parts]
    if any(sizes):
        rows = gather_rows(jnp.concatenate([_to_bytes(p[:k]) for p, k in zip(parts, sizes) if k]),
                           axis_name)
        at = 0
        for i, (p, k) in enumerate(zip(parts, sizes)):
            if k:
                nb = k * p.dtype.itemsize
                got = _from_bytes(rows[:, at:at + nb], p.dtype, k)
                out[i] = jnp.pad(got, ((0, 0), (0, p.shape[0] - k)))
                at += nb
    return [varying_like(o, parts, axis_name) for o in out]  # every branch typed alike


def gather_section(parts, sizes_per_part, rung: jax.Array, axis_name):
    """All-gather the escape section: for the agreed ``rung``, the first
    ``sizes_per_part[i][rung]`` entries of every rank's ``parts[i]`` (each as long as its top
    size), in one transfer. Returns (N, len(part)) per part, zero past the prefix. ``rung``
    must be rank-invariant; each branch is one all-gather of a static size."""
    parts = list(parts)
    n_rungs = len(sizes_per_part[0])
    branches = [functools.partial(_prefixes, sizes=tuple(s[k] for s in sizes_per_part),
                                  axis_name=axis_name) for k in range(n_rungs)]
    if n_rungs == 1:
        return branches[0](parts)
    return lax.switch(rung, branches, parts)


def pick_rung(caps: tuple[int, ...], agreed: jax.Array):
    """(rung, overflow): the smallest capacity that holds ``agreed``, and whether even the top
    is too small (the gather then falls back to plain, and the rung is 0: send nothing)."""
    over = jnp.sum(agreed > jnp.asarray(caps, jnp.int32)).astype(jnp.int32)
    overflow = over == len(caps)
    return jnp.where(overflow, 0, over), overflow


def section_bytes(sizes: tuple[int, ...], rung: jax.Array) -> jax.Array:
    """int32: the bytes of the rung's prefix (``sizes``: bytes per rung)."""
    return jnp.asarray(sizes, jnp.int32)[rung]


def vma(x) -> set:
    """The mesh axes ``x`` varies over (its type's manual-axis varying set)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # JAX 0.10's type; older ones have .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def varying_like(x, operands, axis_name) -> jax.Array:
    """``x`` typed to vary over every mesh axis ``operands`` vary over, but the gather's: both
    sides of a conditional then return the same type, whatever the inputs vary over."""
    want = set().union(*(vma(a) for a in jax.tree.leaves(operands))) - {axis_name}
    missing = tuple(sorted(want - vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

"""The transfers of a compressed gather: the main plane, unconditional, and escape sections
sized by a rank-invariant rung.

The main plane's all-gather sits in the step's top-level computation, so XLA can schedule it
asynchronously and overlap it with compute. The escape section is a few max-capacity buffers;
:func:`gather_section` all-gathers a static prefix of each, as one transfer chosen by
``lax.switch`` on the agreed rung, and its branches hold nothing but that transfer, a slice
and a pad.

Shape letters: N ranks, L bytes per rank, C a capacity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax import selfcheck


def gather_rows(buf_L: jax.Array, axis_name) -> jax.Array:
    """(L,) per rank -> (N, L), rank-major, the same on every rank."""
    return lax.all_gather(buf_L, axis_name, axis=0, tiled=False, to="invarying")


def gather_main(plane_L: jax.Array, bits: jax.Array, fallback: jax.Array, csum: jax.Array,
                axis_name):
    """The main transfer, unconditional: every rank's plane (uint8) and checksum; returns
    (rows (N, L), every rank's checksum (N,)).

    On a fallback step (``fallback``: rank-invariant) the same bytes carry the first L bytes
    of the shard's bits instead, so the plain gather that follows sends only the rest
    (:func:`plain_rest`) and a fallback step costs what a plain gather does.
    """
    head = _to_bytes(bits.reshape(-1))[:plane_L.shape[0]]
    plane = jnp.where(fallback, head, plane_L)
    return selfcheck.split_checksums(gather_rows(selfcheck.with_checksum(plane, csum),
                                                 axis_name))


def plain_rest(main_NxL: jax.Array, bits: jax.Array, axis_name) -> jax.Array:
    """The fallback's transfer: the bytes of the shard's bits past what the main transfer
    carried; returns every rank's bits (N, n) in the bits' dtype."""
    shard_bytes = _to_bytes(bits.reshape(-1))
    rest = gather_rows(shard_bytes[main_NxL.shape[1]:], axis_name)
    rows = jnp.concatenate([main_NxL, rest], axis=1)
    return _from_bytes(rows, bits.dtype, bits.size)


def _to_bytes(a_N: jax.Array) -> jax.Array:
    """A flat array's little-endian bytes, flat."""
    return lax.bitcast_convert_type(a_N, jnp.uint8).reshape(-1)


def _from_bytes(rows_NxB: jax.Array, dtype, count: int) -> jax.Array:
    if np.dtype(dtype).itemsize == 1:
        return lax.bitcast_convert_type(rows_NxB, dtype)
    return lax.bitcast_convert_type(
        rows_NxB.reshape(rows_NxB.shape[0], count, np.dtype(dtype).itemsize), dtype)


def _prefix(buf_B, *, size: int, axis_name):
    """One branch: all-gather the first ``size`` bytes of every rank's buffer, zero-padded."""
    n_ranks = lax.axis_size(axis_name)
    if size == 0:
        rows = jnp.zeros((n_ranks, buf_B.shape[0]), buf_B.dtype)
    else:
        rows = jnp.pad(gather_rows(buf_B[:size], axis_name), ((0, 0), (0, buf_B.shape[0] - size)))
    return varying_like(rows, buf_B, axis_name)  # every branch typed alike


def gather_section(parts, sizes_per_part, rung: jax.Array, axis_name):
    """All-gather the escape section: for the agreed ``rung``, the first
    ``sizes_per_part[i][rung]`` entries of every rank's ``parts[i]`` (each as long as its top
    size), in one transfer. Returns (N, len(part)) per part, zero past the prefix. ``rung``
    must be rank-invariant.

    The parts are laid out rung by rung: what rung 1 adds to every part, then what rung 2
    adds, and so on, so every rung's content is a prefix of one byte buffer, and each branch
    of the switch is one slice, one all-gather of a static size and one pad.
    """
    n_rungs = len(sizes_per_part[0])
    pieces, at = [], 0  # (part, first, stop, byte offset), in buffer order
    prefix = [0]
    for k in range(1, n_rungs):
        for i, (part, sizes) in enumerate(zip(parts, sizes_per_part)):
            first, stop = sizes[k - 1], sizes[k]
            if stop > first:
                pieces.append((i, first, stop, at))
                at += (stop - first) * part.dtype.itemsize
        prefix.append(at)
    n_ranks = lax.axis_size(axis_name)
    if at == 0:
        return [jnp.zeros((n_ranks, p.shape[0]), p.dtype) for p in parts]
    buf = jnp.concatenate([_to_bytes(parts[i][a:b]) for i, a, b, _ in pieces])
    branches = [functools.partial(_prefix, size=size, axis_name=axis_name) for size in prefix]
    rows = lax.switch(rung, branches, buf)
    out = []
    for i, part in enumerate(parts):
        got = [_from_bytes(rows[:, off:off + (b - a) * part.dtype.itemsize], part.dtype, b - a)
               for j, a, b, off in pieces if j == i]
        out.append(jnp.concatenate(got, axis=1) if got
                   else jnp.zeros((n_ranks, part.shape[0]), part.dtype))
    return out


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

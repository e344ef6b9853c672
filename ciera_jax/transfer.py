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

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax import selfcheck
from ciera_jax.varying import varying_like


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


@dataclasses.dataclass(frozen=True)
class Section:
    """Every rank's escape section as gathered: byte rows (N, B), zero past the agreed rung's
    prefix, and where each part's entries lie in them (``pieces``: per part, (first, stop, byte
    offset) of each run of entries)."""

    rows: jax.Array
    pieces: tuple
    dtypes: tuple

    def read(self, part: int, slot_RxS: jax.Array) -> jax.Array:
        """Entries ``slot_RxS`` of ``part`` in every row (any value where the slot is past the
        part's top capacity: mask it)."""
        pieces = self.pieces[part]
        itemsize = np.dtype(self.dtypes[part]).itemsize
        if not pieces:
            return jnp.zeros(slot_RxS.shape, self.dtypes[part])
        firsts = np.asarray([p[0] for p in pieces], np.int32)
        offsets = np.asarray([p[2] for p in pieces], np.int32)
        k = jnp.sum(slot_RxS[..., None] >= firsts[1:], axis=-1)  # which run holds the slot
        at = jnp.asarray(offsets)[k] + (slot_RxS - jnp.asarray(firsts)[k]) * itemsize
        at = jnp.clip(at, 0, self.rows.shape[1] - itemsize)
        word = jnp.zeros(slot_RxS.shape, jnp.uint32)
        for b in range(itemsize):
            byte = jnp.take_along_axis(self.rows, at + b, axis=1)
            word |= byte.astype(jnp.uint32) << (8 * b)
        unsigned = jnp.dtype(f"uint{8 * itemsize}")
        return lax.bitcast_convert_type(word.astype(unsigned), self.dtypes[part])


def gather_section(parts, sizes_per_part, rung: jax.Array, axis_name) -> Section:
    """All-gather the escape section: for the agreed ``rung``, the first
    ``sizes_per_part[i][rung]`` entries of every rank's ``parts[i]`` (each as long as its top
    size), in one transfer. ``rung`` must be rank-invariant.

    The parts are laid out rung by rung: what rung 1 adds to every part, then what rung 2
    adds, and so on, so every rung's content is a prefix of one byte buffer, and each branch
    of the switch is one slice, one all-gather of a static size and one pad. Receivers read
    entries in place (:meth:`Section.read`): nothing is copied out part by part.
    """
    n_rungs = len(sizes_per_part[0])
    pieces = [[] for _ in parts]  # per part: (first, stop, byte offset)
    order, at = [], 0
    prefix = [0]
    for k in range(1, n_rungs):
        for i, (part, sizes) in enumerate(zip(parts, sizes_per_part)):
            first, stop = sizes[k - 1], sizes[k]
            if stop > first:
                pieces[i].append((first, stop, at))
                order.append(part[first:stop])
                at += (stop - first) * part.dtype.itemsize
        prefix.append(at)
    dtypes = tuple(p.dtype for p in parts)
    n_ranks = lax.axis_size(axis_name)
    if at == 0:
        return Section(jnp.zeros((n_ranks, 0), jnp.uint8), tuple(map(tuple, pieces)), dtypes)
    buf = jnp.concatenate([_to_bytes(p) for p in order])
    branches = [functools.partial(_prefix, size=size, axis_name=axis_name) for size in prefix]
    return Section(lax.switch(rung, branches, buf), tuple(map(tuple, pieces)), dtypes)


def pick_rung(caps: tuple[int, ...], agreed: jax.Array):
    """(rung, overflow): the smallest capacity that holds ``agreed``, and whether even the top
    is too small (the gather then falls back to plain, and the rung is 0: send nothing)."""
    over = jnp.sum(agreed > jnp.asarray(caps, jnp.int32)).astype(jnp.int32)
    overflow = over == len(caps)
    return jnp.where(overflow, 0, over), overflow


def section_bytes(sizes: tuple[int, ...], rung: jax.Array) -> jax.Array:
    """int32: the bytes of the rung's prefix (``sizes``: bytes per rung)."""
    return jnp.asarray(sizes, jnp.int32)[rung]

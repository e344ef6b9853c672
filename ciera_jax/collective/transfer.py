"""The transfers of a compressed gather: the main plane, unconditional, and escape sections
sized by a rank-invariant rung.

The main plane's all-gather sits in the step's top-level computation, so XLA can schedule it
asynchronously and overlap it with compute. The escape section is a few max-capacity buffers.
With the rung fixed when the step is compiled (:mod:`ciera_jax.collective.capacity`),
:func:`send_fixed` sends the rung's prefix of each behind the main plane in the SAME
all-gather: one unconditional transfer per tensor. With a traced rung, :func:`gather_section`
all-gathers a static prefix of each, end to end in one transfer, in the branch of a
``lax.switch`` on the agreed rung, and its branches hold nothing but that transfer, slices and
a pad.

Shape letters: N ranks, L bytes per rank, C a capacity.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.codec import bitfields
from ciera_jax.codec.wire import CHECKSUM_BYTES
from ciera_jax.collective import capacity, selfcheck
from ciera_jax.runtime.varying import varying_like


class Sent(NamedTuple):
    """What a compressed gather's ``send`` put on the wire, read by its ``decode`` (or, on an
    overflow, by the fallback's :func:`plain_rest`)."""

    rows: jax.Array  # the main transfer's rows (N, L + CHECKSUM_BYTES): plane, fixed section
    sections: tuple  # a traced rung's section rows per level (N, C); () for a fixed rung
    rung: Any  # int (fixed when compiled) or int32
    overflow: jax.Array  # bool, rank-invariant: the plain fallback finishes the gather
    section_bytes: jax.Array  # int32: the escape section's bytes sent
    exit: Any = None  # int32 at a fixed rung with overflow rungs: capacity.exit_index
    ladder: tuple = ()  # those overflow rungs (static)
    taken: Any = None  # int32: the rung whose section travelled, when an exit may differ

    @property
    def rung_sent(self):
        """The rung whose capacity the escapes had: ``rung``, or an overflow's exit rung."""
        return self.rung if self.taken is None else self.taken


def gather_rows(buf_L: jax.Array, axis_name) -> jax.Array:
    """(L,) per rank -> (N, L), rank-major, the same on every rank."""
    return lax.all_gather(buf_L, axis_name, axis=0, tiled=False, to="invarying")


def send_fixed(plane_L: jax.Array, parts, sizes, shard: jax.Array, fallback: jax.Array,
               csum: jax.Array, axis_name, align: int = 0) -> jax.Array:
    """The main plane, the checksum and the first ``sizes[i]`` entries of each of ``parts``
    (a static rung's section), in ONE unconditional all-gather. Returns the rows (N, T +
    CHECKSUM_BYTES): what travelled, checksum tails included, for :func:`read_fixed` and
    :func:`plain_rest`.

    On a fallback step (``fallback``: rank-invariant) the same T bytes carry the first T bytes
    of the shard's bits instead, so the plain gather that follows sends only the rest
    (:func:`plain_rest`) and a fallback step costs what a plain gather does. ``fallback=None``:
    no fallback is compiled (a guaranteed rung), so the shard's head is never read.

    ``align``: zeros before the checksum make each row a multiple of ``align`` bytes
    (:func:`padding` of them), so a decode can read the plane in place in blocks of that size.
    """
    pieces = [plane_L] + [bitfields.le_bytes(bitfields.to_bits(p[:size]))
                          for p, size in zip(parts, sizes) if size]
    pad = padding(sum(p.shape[0] for p in pieces), align)
    if pad:
        pieces.append(jnp.zeros((pad,), jnp.uint8))
    buf = jnp.concatenate(pieces) if len(pieces) > 1 else plane_L
    if fallback is not None:
        buf = jnp.where(fallback, _head_bytes(shard, buf.shape[0]), buf)
    return gather_rows(selfcheck.with_checksum(buf, csum), axis_name)


def padding(length: int, align: int) -> int:
    """Zero bytes after ``length`` bytes of a wire row that make it, with its checksum, a
    multiple of ``align`` bytes (0: no alignment)."""
    return -(length + CHECKSUM_BYTES) % align if align else 0


def read_fixed(rows: jax.Array, plane_len: int, dtypes, sizes, lengths):
    """What :func:`send_fixed`'s rows hold: (every rank's checksum (N,), the plane's rows
    (N, plane_len), each part's rows (N, lengths[i]) in ``dtypes[i]``, zero past its prefix).
    Slices of the rows, read in place where they are used (no copy of the gathered wire)."""
    at, out = plane_len, []
    for dtype, size, length in zip(dtypes, sizes, lengths):
        width = np.dtype(dtype).itemsize
        piece = bitfields.from_le_bytes(rows[:, at:at + size * width], dtype, size)
        at += size * width
        out.append(jnp.pad(piece, ((0, 0), (0, length - size))))
    return selfcheck.sent_checksums(rows), rows[:, :plane_len], out


# The functions whose transfers run only on a fallback step (an overflow, a fresh cache): a
# compiled program's collectives under them are off the steady path (``ciera aot`` tells them
# apart by their stack).
FALLBACK_FUNCTIONS = ("plain_rest", "overflow_rest")


def plain_rest(main_rows: jax.Array, bits: jax.Array, axis_name) -> jax.Array:
    """The fallback's transfer: the bytes of the shard's bits past what the main transfer
    carried (``main_rows``: its rows, checksum tails included); returns every rank's bits
    (N, n) in the bits' dtype."""
    main_NxL = selfcheck.without_checksums(main_rows)
    shard_bytes = _to_bytes(bits.reshape(-1))
    if main_NxL.shape[1] >= shard_bytes.shape[0]:  # a tiny shard: the main transfer held it
        return _from_bytes(main_NxL[:, :shard_bytes.shape[0]], bits.dtype, bits.size)
    rest = gather_rows(shard_bytes[main_NxL.shape[1]:], axis_name)
    rows = jnp.concatenate([main_NxL, rest], axis=1)
    return _from_bytes(rows, bits.dtype, bits.size)


def overflow_rest(parts, sent_sizes, sizes_per_rung, index, axis_name) -> list[jax.Array]:
    """An overflow's transfer (word mode, a few rungs above its fixed rung): of each of
    ``parts``, the entries from ``sent_sizes[i]`` (what the main transfer carried) up to
    ``sizes_per_rung[index][i]``, all parts end to end in ONE all-gather, in the branch of a
    switch on ``index`` (rank-invariant) that holds nothing but that transfer. Returns every
    rank's (N, top - sent_sizes[i]) per part (top: the last rung's size), entries past the
    rung's unspecified."""
    sizes = [tuple(r[i] - a for r in sizes_per_rung) for i, a in enumerate(sent_sizes)]
    return gather_section(parts, sizes, index, axis_name, starts=sent_sizes)


def _head_bytes(shard: jax.Array, n_bytes: int) -> jax.Array:
    """The first ``n_bytes`` bytes of the shard's words, read from only as many words (zeros
    past the shard's end). Little-endian by shifts: a size-changing bitcast of the shard's
    head would be a copy kernel of its own on XLA:GPU; shifts fuse into the wire's build."""
    width = np.dtype(shard.dtype).itemsize
    words = bitfields.to_bits(shard.reshape(-1)[:-(-n_bytes // width)])
    head = bitfields.le_bytes(words)[:n_bytes]
    return jnp.pad(head, (0, n_bytes - head.shape[0]))


def _to_bytes(a_N: jax.Array) -> jax.Array:
    """A flat array's little-endian bytes, flat, by a bitcast: the fallback's and the section
    switch's branches hold transfers and bitcasts only, no arithmetic (unlike the shifts of
    :func:`~ciera_jax.codec.bitfields.le_bytes`, which fuse where the wire is built)."""
    return lax.bitcast_convert_type(a_N, jnp.uint8).reshape(-1)


def _from_bytes(rows_NxB: jax.Array, dtype, count: int) -> jax.Array:
    """:func:`_to_bytes` undone per row: (N, count) words of ``dtype``."""
    if np.dtype(dtype).itemsize == 1:
        return lax.bitcast_convert_type(rows_NxB, dtype)
    return lax.bitcast_convert_type(
        rows_NxB.reshape(rows_NxB.shape[0], count, np.dtype(dtype).itemsize), dtype)


def _prefixes(byte_parts, *, sizes, starts, length, axis_name):
    """One branch: every rank's ``sizes[i]`` bytes of each of ``byte_parts`` from
    ``starts[i]``, end to end, in ONE all-gather, zero-padded to ``length``: (N, length)
    uint8. The slices are the branch's own: made outside, each would be a kernel and a buffer
    on every step."""
    pieces = [part[start:start + size] for part, size, start in zip(byte_parts, sizes, starts)
              if size]
    if not pieces:
        rows = jnp.zeros((lax.axis_size(axis_name), length), jnp.uint8)
    else:
        rows = gather_rows(jnp.concatenate(pieces), axis_name)
        rows = jnp.pad(rows, ((0, 0), (0, length - rows.shape[1])))
    return varying_like(rows, byte_parts, axis_name)  # every branch typed alike


def gather_section(parts, sizes_per_part, rung: jax.Array, axis_name, starts=None):
    """All-gather the escape section: for the agreed ``rung``, the first
    ``sizes_per_part[i][rung]`` entries of every rank's ``parts[i]`` from entry ``starts[i]``
    (default 0). Returns (N, top size) per part; entries past the rung's prefix are
    unspecified (the next part's bytes: receivers read only the slots the agreement covers).
    ``rung`` must be rank-invariant.

    One ``lax.switch`` on the rung; each branch holds nothing but ONE transfer (the rung's
    prefixes end to end, an all-gather of a static size and a pad), so the codec exists once,
    outside it; each part is then read at its offset for the agreed rung.
    """
    n_ranks = lax.axis_size(axis_name)
    if all(max(sizes) == 0 for sizes in sizes_per_part):
        return [jnp.zeros((n_ranks, p.shape[0]), p.dtype) for p in parts]
    widths = [np.dtype(p.dtype).itemsize for p in parts]
    byte_parts = [_to_bytes(p) for p in parts]
    byte_sizes = [tuple(w * s for s in sizes) for w, sizes in zip(widths, sizes_per_part)]
    byte_starts = [w * s for w, s in zip(widths, starts or [0] * len(parts))]
    spans = [max(sizes) for sizes in byte_sizes]  # bytes returned per part
    # Each part's offset per rung; the buffer holds any part's full span from any offset.
    offsets = np.cumsum([[0] * len(byte_sizes[0])] + byte_sizes[:-1], axis=0)
    length = int(max(offsets[i].max() + span for i, span in enumerate(spans)))
    branches = [functools.partial(_prefixes, sizes=sizes, starts=byte_starts, length=length,
                                  axis_name=axis_name)
                for sizes in zip(*byte_sizes)]
    rows_NxB = lax.switch(rung, branches, byte_parts)
    out = []
    for part, span, width, offset in zip(parts, spans, widths, offsets):
        at = jnp.asarray(offset, jnp.int32)[rung]
        piece = lax.dynamic_slice_in_dim(rows_NxB, at, span, axis=1,
                                         allow_negative_indices=False)
        out.append(_from_bytes(piece, part.dtype, span // width))
    return out


def pick_rung(caps: tuple[int, ...], agreed: jax.Array):
    """(rung, overflow): the smallest capacity that holds ``agreed``, and whether even the top
    is too small (the gather then falls back to plain, and the rung is 0: send nothing)."""
    over = capacity.exceeded(caps, agreed)
    overflow = over == len(caps)
    return jnp.where(overflow, 0, over), overflow


def section_bytes(sizes: tuple[int, ...], rung: jax.Array) -> jax.Array:
    """int32: the bytes of the rung's prefix (``sizes``: bytes per rung)."""
    return jnp.asarray(sizes, jnp.int32)[rung]

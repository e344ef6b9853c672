"""Fused exponent-mode decode + per-rank checksum: one read of the gathered exponents and
payload, one write of the weights, and the uint32 checksum of every rank's rebuilt shard
(exactly ``checksum.checksum_shards``) from the same pass.

Why it fuses: the checksum is ``sum_i fmix32(term_i ^ key(pos_i)) mod 2**32``, a sum of terms
that each depend on one word (float32) or one pair of words (bf16) and its global position
only. So each program sums its own terms, and a rank's checksum is the wrapping uint32 sum of
its programs' partial sums, in any order.

The one coupling is the bf16 pairing: term = ``lo | hi << 16``, where ``hi`` is ``lo``'s
partner half a dimension away (the last dimension when it is even, else the shard axis: see
``checksum._sums``). The kernel therefore views the flat tensor as (groups, 2, dist): each
program decodes ``block`` lo words and their ``block`` hi partners, so each term is complete
inside one program. Fusable when ``dist`` (or, unpaired, a rank's shard) is a whole number of
blocks of at least one warpgroup (128 elements): :func:`fusable`. On another gather axis the
groups are the rows of the last dimensions (pairs within a row), a row lies in one rank's shard,
and each program computes its rows' global positions from their (before, rank, shard axis)
index: the checksum's order, with no transpose. Anything else takes the unfused path (decode
kernel, then the jnp checksum), same values.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ciera_jax.codec import checksum, bitfields
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import (Operand, Pairs, WARPGROUP, check_backend, resolve,
                                       stream_call)
from ciera_jax.kernels.decode import decode_body, decode_pallas
from ciera_jax.kernels.encode import BLOCK


def decode_checksum_reference(exp, payload_Pxn, dtype, n_ranks: int, *, axis: int = 0,
                              seed: int = 0):
    """The pure-jnp pair the fused kernel must match bit for bit: ``(bitfields.merge(...),
    checksum.checksum_shards(full, axis, n_ranks))``."""
    full = bitfields.merge(exp, payload_Pxn, dtype)
    return full, checksum.checksum_shards(full, axis, n_ranks, seed=seed)


def fusable(shape, dtype, n_ranks: int, *, axis: int = 0, block: int = BLOCK):
    """``(Pairs layout, block, paired, rows)`` for the fused kernel, or None when the tensor
    takes the unfused path (sizes that do not split into whole blocks). ``rows``: on a gather
    axis other than 0, (dims before it, ranks, a rank's part of it) flattened, whose index a
    group (a row of the last dimensions) is; else None."""
    if not shape or math.prod(shape) == 0:
        return None
    axis %= len(shape)
    if shape[axis] % n_ranks:
        return None
    if axis:
        return _fusable_rows(shape, dtype, n_ranks, axis, block)
    n = math.prod(shape)
    d, post = shape[0] // n_ranks, math.prod(shape[1:])
    n_local = d * post
    itemsize = bitfields.word_format(dtype).word.itemsize
    if itemsize == 2 and post % 2 == 0:  # pairs along the last dims: lo, hi halves of a row
        groups, dist, paired = n // post, post // 2, True
    elif itemsize == 2 and d % 2 == 0:  # pairs along the shard axis: halves of a rank's shard
        groups, dist, paired = n_ranks, n_local // 2, True
    else:  # one word per term: any grouping that keeps ranks apart
        dist, paired = _pow2_factor(n_local // 2 if n_local % 2 == 0 else 0, block), False
        groups = n // (2 * dist) if dist else 0
    blk = _pow2_factor(dist, block)
    if blk < WARPGROUP or (not paired and n_local % (2 * dist)):
        return None
    return Pairs(groups, dist), blk, paired, None


def _fusable_rows(shape, dtype, n_ranks: int, axis: int, block: int):
    """:func:`fusable` off axis 0: pairs (or, for 4-byte words, lo and hi terms) within each
    row of the dims after the gather axis, as the checksum pairs them there."""
    pre, post = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    if post % 2:
        return None
    blk = _pow2_factor(post // 2, block)
    if blk < WARPGROUP:
        return None
    paired = bitfields.word_format(dtype).word.itemsize == 2
    rows = (pre, n_ranks, shape[axis] // n_ranks)
    return Pairs(math.prod(shape) // post, post // 2), blk, paired, rows


def _pow2_factor(m: int, cap: int) -> int:
    """The largest power of two that divides ``m`` and is at most ``cap`` (0 for m == 0)."""
    return 0 if m <= 0 else min(m & -m, cap)


def decode_checksum_body(blk, exp, planes, *, fmt, layout: Pairs, block: int, paired: bool,
                         seed: int, rows=None):
    """One program: (lo, hi) exponent and payload blocks -> ((lo, hi) words, [partial sum])."""
    u32 = jnp.uint32
    w_lo = decode_body(exp[0], [p[0] for p in planes], fmt=fmt)
    w_hi = decode_body(exp[1], [p[1] for p in planes], fmt=fmt)
    per_group = layout.dist // block
    g, j = blk.index // per_group, blk.index % per_group
    start = g * (2 * layout.dist)  # a group's first position: its flat index ...
    if rows is not None:  # ... or, off axis 0, in the checksum's (rank, axis, before) order
        pre, ranks, d = rows
        post = 2 * layout.dist
        b, r, i = g // (ranks * d), (g // d) % ranks, g % d
        start = r * (pre * d * post) + i * (pre * post) + b * post
    pos = (start + j * block).astype(u32) + blk.lanes  # global lo positions
    if paired:
        terms = [(w_lo.astype(u32) | (w_hi.astype(u32) << u32(16)), pos)]
    else:
        terms = [(w_lo.astype(u32), pos), (w_hi.astype(u32), pos + u32(layout.dist))]
    key = lambda p: p * u32(checksum.GOLDEN) + u32(seed & 0xFFFFFFFF)  # noqa: E731
    partial = sum(jnp.sum(checksum.fmix32(t ^ key(p)), dtype=u32) for t, p in terms)
    return (w_lo, w_hi), [partial]


def decode_checksum_pallas(exp, payload_Pxn, dtype, n_ranks: int, *, axis: int = 0,
                           seed: int = 0, block: int = BLOCK, backend: str | None = None,
                           interpret: bool = False, payload_rows: bool = False):
    """Fused :func:`decode_checksum_reference` (raises ValueError where not :func:`fusable`).
    ``payload_rows``: ``payload_Pxn`` is the payload's rank rows (N, P, n) as they arrived,
    read in place off axis 0 (each row of the last dims lies whole in one rank's row), so
    they need no move to the full layout; or, off axis 0, the wire's rows (N, L) whose first
    P * n bytes are the payload planes, L a multiple of :func:`row_align` (what follows the
    planes is not read)."""
    fmt = bitfields.word_format(dtype)
    backend = check_backend(backend)
    shape, P = exp.shape, fmt.payload_bytes
    plan = fusable(shape, dtype, n_ranks, axis=axis, block=block)
    if plan is None:
        raise ValueError(f"decode_checksum: shape {shape} (axis {axis}, {n_ranks} ranks) does "
                         "not split into fused blocks; use decode_checksum(...) for a fallback")
    layout, blk, paired, rows = plan
    n = math.prod(shape) // n_ranks
    want = (n_ranks, P, n) if payload_rows else (P, *shape)
    row_groups = P * n // (2 * layout.dist)  # a rank's row, in groups
    if payload_rows and rows is not None and payload_Pxn.ndim == 2:  # the wire's rows
        width = payload_Pxn.shape[1]
        if (payload_Pxn.shape[0] != n_ranks or width < P * n or width % (2 * layout.dist)):
            raise ValueError(f"wire rows must be ({n_ranks}, L) with L >= {P * n} a multiple "
                             f"of {2 * layout.dist}, got {payload_Pxn.shape}")
        want, row_groups = payload_Pxn.shape, width // (2 * layout.dist)
    if payload_Pxn.shape != want:
        raise ValueError(f"payload_Pxn must have shape {want}, got {payload_Pxn.shape}")
    view = (layout.groups, 2, layout.dist)
    payload = payload_Pxn.astype(jnp.uint8)
    if not payload_rows:
        planes, args = [Operand(jnp.uint8, planes=P)], [payload.reshape(P, *view)]
    elif rows is None:  # axis 0: the rank rows are the full layout, plane by plane
        planes, args = [Operand(jnp.uint8, planes=P)], [rank_rows_to_planes(payload, view)]
    else:  # one operand per plane, each group read where its rank's row holds it
        planes = [Operand(jnp.uint8, groups=_row_group(rows, row_groups, k)) for k in range(P)]
        args = [payload.reshape(-1, 2, layout.dist)] * P
    call = stream_call(
        lambda b, e, *p: decode_checksum_body(
            b, e, p[0] if not payload_rows or rows is None else list(p), fmt=fmt,
            layout=layout, block=blk, paired=paired, seed=seed, rows=rows),
        [Operand(jnp.uint8), *planes],
        [Operand(fmt.word), Operand(jnp.uint32, per_block=1)],
        layout=layout, block=blk, backend=backend, interpret=interpret, with_block=True,
        name=f"ciera_decode_checksum_{fmt.dtype.name}")
    words, partials = call(exp.astype(jnp.uint8).reshape(view), *args)
    # programs in (before, rank, the rest) order; on axis 0 nothing comes before
    pre = rows[0] if rows is not None else 1
    sums = jnp.sum(partials.reshape(pre, n_ranks, -1), axis=(0, 2), dtype=jnp.uint32)
    return bitfields.from_bits(words.reshape(shape), fmt.dtype), sums


def rank_rows_to_planes(payload_NxPxn, view):
    """Axis 0's rank rows (N, P, n) as the kernel's planes (P, *view): a transpose only
    where there are several planes (each rank's n elements are contiguous in the full
    layout)."""
    return jnp.moveaxis(payload_NxPxn, 1, 0).reshape(payload_NxPxn.shape[1], *view)


def _row_group(rows, row_groups: int, plane: int):
    """Where group g of the full layout (a row of the last dims, index (before, rank, a
    rank's part of the axis)) lies in the rank rows (N, P, before, part), each rank's row
    ``row_groups`` groups long: its group there."""
    pre, ranks, d = rows

    def group(g):
        b, r, i = g // (ranks * d), (g // d) % ranks, g % d
        return r * row_groups + (plane * pre + b) * d + i

    return group


def row_align(shape, dtype, n_ranks: int, *, axis: int = 0, impl: str = "auto") -> int:
    """Bytes a wire row must be a multiple of for :func:`decode_checksum` to read the payload
    planes in place from the wire's rows (``payload_rows``), or 0 where it does not (an
    unfused decode, axis 0, where the planes' rank rows are the full layout already)."""
    c = resolve(impl)
    plan = fusable(shape, dtype, n_ranks, axis=axis) if c.kind == "pallas" else None
    if plan is None or plan[3] is None:
        return 0
    return 2 * plan[0].dist


def decode_checksum(exp, payload_Pxn, dtype, n_ranks: int, *, axis: int = 0, seed: int = 0,
                    impl: str = "auto", wire_rows=None):
    """Decode and per-rank checksums: fused where the impl is a Pallas kernel and the shape is
    :func:`fusable`, else the decode (kernel or jnp) followed by the jnp checksum.
    ``wire_rows``: the wire's rows (N, L) whose heads are the payload planes, L a multiple of
    :func:`row_align` (nonzero): the fused kernel reads the planes there, and
    ``payload_Pxn`` (which then may be None) is not read."""
    c = resolve(impl)
    if wire_rows is not None:
        return decode_checksum_pallas(exp, wire_rows, dtype, n_ranks, axis=axis, seed=seed,
                                      backend=c.backend, interpret=c.interpret,
                                      payload_rows=True)
    if c.kind == "pallas" and fusable(exp.shape, dtype, n_ranks, axis=axis):
        return decode_checksum_pallas(exp, payload_Pxn, dtype, n_ranks, axis=axis, seed=seed,
                                      backend=c.backend, interpret=c.interpret)
    if c.kind == "pallas" and _layout.num_elements(exp.shape):
        full = decode_pallas(exp, payload_Pxn, dtype, backend=c.backend, interpret=c.interpret)
        return full, checksum.checksum_shards(full, axis, n_ranks, seed=seed)
    return decode_checksum_reference(exp, payload_Pxn, dtype, n_ranks, axis=axis, seed=seed)

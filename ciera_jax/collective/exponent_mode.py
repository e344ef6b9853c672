"""Exponent mode: the payload (sign + mantissa) travels, the exponent stays in the cache.

Sender (:func:`encode`, no collective): split the shard into exponent and payload planes, flag
the exponents that differ from this rank's slice of the cache, and pack what locates them and
their new values: the flags 32 to a uint32 word, the nonzero words in order with a summary bit
per word, and the new exponents in position order, each at its top capacity.

Receiver: :func:`send`'s transfers (the payload plane, the checksum and, at a fixed rung, the
flags and the exponents in one unconditional all-gather; a traced rung sends those in the
section switch, :mod:`ciera_jax.codec.wire`), then :func:`decode`: the flag words are
rebuilt from the summary (escapes of escapes, a dense pass over 1/32 of the tensor), one fill
puts every flagged exponent in place of the cached one, one decode merges exponents and
payload, one self-check compares every rank's shard with the checksum it sent.

Shape letters as in :mod:`ciera_jax.codec.escapes`: N ranks, n elements per shard, P payload planes,
W flag words, S summary words, C and K capacities.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax import kernels
from ciera_jax.codec import bitfields, escapes, two_level
from ciera_jax.collective import capacity, selfcheck, transfer
from ciera_jax.codec.layout import full_index, full_to_rows, gathered_shape, rows_to_full
from ciera_jax.codec.wire import ExponentWire, flag_words

INT32_MAX = np.iinfo(np.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Encoded:
    """What one rank sends for one exponent-mode tensor, made before the gather (it depends only
    on the shard and the cache, so it can be made at the end of the previous step).

    ``payload``: uint8 (P, *shard shape); ``summary``: uint32 (S,), a bit per flag word: is it
    nonzero; ``flag_words``: uint32 (C,), the nonzero flag words in order, at the top capacity;
    ``patch_exp``: uint8 (K,), the new exponents of the flagged elements in position order, at
    the top capacity; ``count``: exponents changed in this shard; ``demand``: ``count``, or
    int32 max when the cache is unprimed; ``checksum``: uint32 of the shard's true words.
    """

    payload: jax.Array
    summary: jax.Array
    flag_words: jax.Array
    patch_exp: jax.Array
    count: jax.Array
    demand: jax.Array
    checksum: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    n_ranks: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(self.payload.shape[1:])

    @property
    def full_shape(self) -> tuple[int, ...]:
        return gathered_shape(self.shard_shape, self.axis, self.n_ranks)

    @property
    def wire(self) -> ExponentWire:
        n = int(np.prod(self.shard_shape))
        return ExponentWire(n, self.payload.shape[0] + 1)


def encode(x, cached_exp, primed, axis: int, n_ranks: int, csum, impl: str) -> Encoded:
    """``x``: this rank's shard; ``cached_exp``: its slice of the cached exponents."""
    _, payload, changed = kernels.encode(x, cached_exp, impl=impl)  # exponents: read below
    wire = ExponentWire(x.size, x.dtype.itemsize)
    changed_N = changed.reshape(-1)
    flags_W = escapes.pack_flags(changed_N[None])[0]
    nonzero_W = flags_W != 0
    summary_S = escapes.pack_flags(nonzero_W[None])[0]
    # One scan for both packs: the flags before each word (where its changed exponents go)
    # and the nonzero words before it (where it goes); the first's total is the count.
    running_2xW = escapes.running_count(jnp.stack([flags_W, nonzero_W.astype(flags_W.dtype)]))
    listed_C = escapes.pack_nonzero(flags_W, wire.word_caps[-1], running_2xW[1])
    x_N = x.reshape(-1)  # the new exponents read at the changed elements only
    patch_exp = kernels.escape_pack(
        escapes.PerElement(x.size, jnp.uint8, lambda i: bitfields.exponent(x_N[i])), flags_W,
        wire.caps[-1], impl=impl, running_W=running_2xW[0])
    # An unprimed cache knows no exponent: all of them count as changed.
    changes = running_2xW[0, -1] if flags_W.shape[0] else 0  # an empty shard has no words
    count = jnp.where(primed, changes, x.size).astype(jnp.int32)
    demand = jnp.where(primed, count, jnp.int32(INT32_MAX))
    return Encoded(payload, summary_S, listed_C, patch_exp, count, demand, csum, axis, n_ranks)


def _parts(e: Encoded):
    """The section's parts and their sizes per rung: summary words, nonzero flag words, new
    exponents."""
    wire = e.wire
    return ([e.summary, e.flag_words, e.patch_exp],
            [tuple(wire.summary_words if c else 0 for c in wire.caps), wire.word_caps, wire.caps])


def row_align(e: Encoded, dtype, impl: str) -> int:
    """Bytes each wire row is a multiple of (0: any length): where the fused decode reads the
    payload planes in place from the rows (:func:`ciera_jax.kernels.row_align`); a strided
    slice of them would be a copy of the payload."""
    return kernels.row_align(e.full_shape, dtype, e.n_ranks, axis=e.axis, impl=impl)


def send(e: Encoded, agreed, shard, axis_name, impl: str = "auto") -> transfer.Sent:
    """The gather's transfers. ``agreed``: the agreed demand, or a
    :class:`~ciera_jax.collective.capacity.FixedRung` (the section then rides in the main
    transfer at a static size; a traced rung sends it in the section switch). Rows are
    aligned for the decode ``impl`` runs (:func:`row_align`); the padding counts as sent."""
    wire = e.wire
    parts, sizes = _parts(e)
    align = row_align(e, shard.dtype, impl)
    fixed = capacity.is_fixed(agreed)
    at = [s[agreed.rung] for s in sizes] if fixed else []
    widths = [np.dtype(p.dtype).itemsize for p in parts]
    pad = transfer.padding(e.payload.size + sum(w * a for w, a in zip(widths, at)), align)
    if fixed:
        rung = agreed.rung
        # a guaranteed rung compiles no fallback: nothing decides one
        overflow = None if agreed.guaranteed else capacity.overflows(wire, agreed)
        rows = transfer.send_fixed(e.payload.reshape(-1), parts, at, shard, overflow,
                                   e.checksum, axis_name, align)
        overflow = jnp.bool_(False) if overflow is None else overflow
        return transfer.Sent(rows, (), rung, overflow,
                             transfer.section_bytes(wire.section_sizes, rung) + pad)
    rung, overflow = transfer.pick_rung(wire.caps, agreed)
    rows = transfer.send_fixed(e.payload.reshape(-1), [], [], shard, overflow, e.checksum,
                               axis_name, align)
    sections = transfer.gather_section(parts, sizes, rung, axis_name)
    return transfer.Sent(rows, tuple(sections), rung, overflow,
                         transfer.section_bytes(wire.section_sizes, rung) + pad)


def _received(e: Encoded, sent: transfer.Sent):
    """What arrived: (every rank's checksum (N,), the payload planes' rows (N, P * n), the
    summary, the listed flag words and the new exponents, per rank)."""
    wire = e.wire
    parts, sizes = _parts(e)
    at = [] if sent.sections else [s[sent.rung] for s in sizes]  # a traced rung's came apart
    sent_N, plane_NxL, fixed = transfer.read_fixed(
        sent.rows, e.payload.size, [p.dtype for p in parts], at,
        [wire.summary_words, max(at[1], 1), max(at[2], 1)] if at else [])
    return sent_N, plane_NxL, sent.sections or fixed


def decode(e: Encoded, sent: transfer.Sent, cache_exp, dtype, impl: str,
           in_branch: bool = False):
    """The tensor from what arrived and the cached exponents: ``(full, its exponents (the new
    cache), failed shards)``. Meaningless on an overflow. ``in_branch``: it runs in a
    conditional's branch, of which the cached exponents are an operand
    (:func:`_new_exponents`)."""
    n, n_planes = e.wire.n, e.payload.shape[0]
    sent_N, plane_NxL, (summary_NxS, listed_NxC, patch_NxK) = _received(e, sent)
    cap_N = jnp.full((e.n_ranks,), jnp.asarray(e.wire.caps, jnp.int32)[sent.rung])
    exp_full = _new_exponents(e, cache_exp, summary_NxS, listed_NxC, patch_NxK, cap_N, impl,
                              in_branch)
    # One pass: the weights and every rank's checksum of them (fused on GPU where it can be).
    # The fused kernel reads the payload planes in place from the wire's rows, which the
    # sender aligned for it (:func:`row_align`); else they move to the full layout first.
    if row_align(e, dtype, impl):
        full, got_N = kernels.decode_checksum(exp_full, None, dtype, e.n_ranks, axis=e.axis,
                                              impl=impl, wire_rows=sent.rows)
    else:
        payload_full = rows_to_full(plane_NxL.reshape(e.n_ranks, n_planes, n),
                                    e.shard_shape, e.axis)
        full, got_N = kernels.decode_checksum(exp_full, payload_full, dtype, e.n_ranks,
                                              axis=e.axis, impl=impl)
    # The new cache is the exponents the decode read (bitwise exponent(full)), so no pass
    # over the full tensor is needed to make it.
    return full, exp_full, selfcheck.failed_shards(full, sent_N, e.axis, got_N)


def _new_exponents(e: Encoded, cache_exp, summary_NxS, listed_NxC, patch_NxK, cap_N, impl,
                   in_branch: bool):
    """The cached exponents (full layout) with every rank's changed ones set. Outside a
    conditional, where the escapes take one dense pass (an accelerator, short rows) and no
    escape kernel, the listed flag words place them in place, straight into the cache's full
    layout (:func:`two_level.place`: no dense flag words, no rank rows; the cache's buffer
    becomes the new cache). Else, and in a branch (whose operand XLA:GPU would copy in and out
    around a write in place), the flag words are rebuilt (1/32 of the tensor: dense) and filled
    over the cache's rank rows (escapes.fill, or the escape kernel)."""
    n = e.wire.n
    if (not in_branch and kernels.escape_impl(impl) == "xla"
            and escapes.walk_for(n) == "dense"):
        s = e.shard_shape[e.axis]
        return two_level.place(
            cache_exp, summary_NxS, listed_NxC, patch_NxK, cap_N, n,
            lambda r, i: full_index(i, e.shard_shape, e.axis, e.n_ranks, r * s))
    flags_NxW = escapes.expand_dense(listed_NxC, summary_NxS, flag_words(n))
    exp_Nxn = kernels.escape_fill_exponents(
        full_to_rows(cache_exp, e.shard_shape, e.axis, e.n_ranks), flags_NxW, patch_NxK, cap_N,
        impl=impl)
    return rows_to_full(exp_Nxn, e.shard_shape, e.axis)

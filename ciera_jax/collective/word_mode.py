"""Word mode: each element sends a ``b``-bit code of its word's move since the cached word.

``d = ord(new) - ord(cached)`` (:mod:`ciera_jax.codec.wordcodec`); ``|d| <= code_limit(b)`` travels
in the code plane, anything else is an escape (the top code) whose value travels out of line in
position order: level 1, an int8 ``d`` (or ``LEVEL2``: see level 2), level 2, the raw word.

Sender (:func:`encode`, no collective): deltas, codes, both escape levels packed at their top
capacities, the counts the agreement needs. Receiver: :func:`send`'s transfers (the code
plane, the checksum and, at a fixed rung, both levels in one unconditional all-gather; a
traced rung sends the levels in the section switch, :mod:`ciera_jax.codec.wire`), then
:func:`receive` (one dense decode against the cache), :func:`fill` (one fill of the escapes)
and :func:`check` (one self-check); at a fixed rung with overflow rungs,
:func:`overflow_exit` finishes a demand above it in the fallback's conditional.

Shape letters: N ranks, n elements per shard, W flag words, C a capacity.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax import kernels
from ciera_jax.codec import bitfields, escapes, wordcodec
from ciera_jax.collective import capacity, selfcheck, transfer
from ciera_jax.codec.layout import gathered_shape, rows_to_full
from ciera_jax.codec.wire import WordWire
from ciera_jax.codec.word_ladder import (CODE_BITS, ESCAPES, EXP_CHANGED, LEVEL1_LIMIT, LEVEL2,
                                         RAW, code_limit, escape_code)

INT32_MAX = np.iinfo(np.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WordEncoded:
    """What one rank sends for one word-mode tensor, made before the gather.

    ``codes``: uint8, the packed ``b``-bit code plane; ``level1``: int8 (C1,), ``level2``: words
    (C2,), both at their top capacities; ``counts``: int32 (3,): escapes, raw words (``|d| >
    127``) and changed exponents in this shard; ``demand``: ``counts``, or int32 max when the
    cache is unprimed; ``checksum``: uint32 of the shard's true words.
    """

    codes: jax.Array
    level1: jax.Array
    level2: jax.Array
    counts: jax.Array
    demand: jax.Array
    checksum: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    n_ranks: int = dataclasses.field(metadata=dict(static=True))
    code_bits: int = dataclasses.field(metadata=dict(static=True))
    shard_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def full_shape(self) -> tuple[int, ...]:
        return gathered_shape(self.shard_shape, self.axis, self.n_ranks)

    @property
    def wire(self) -> WordWire:
        return WordWire(int(np.prod(self.shard_shape)), self.level2.dtype.itemsize,
                        self.code_bits)

    @property
    def count(self) -> jax.Array:
        """Changed exponents in this shard (as :attr:`Encoded.count`)."""
        return self.counts[..., EXP_CHANGED]


def encode(x, cached_words, primed, axis: int, n_ranks: int, csum, impl: str,
           code_bits: int, cached_at) -> WordEncoded:
    """``x``: this rank's shard; ``cached_words``: its slice of the cached words;
    ``cached_at(i)``: the cached word of the shard's flat elements ``i``, read in place (what
    the escapes read)."""
    wire = WordWire(x.size, x.dtype.itemsize, code_bits)
    d, counts = kernels.word_encode(x, cached_words, impl=impl)
    d = d.reshape(-1)
    # The escapes (level 1) and the raw words among them (level 2): the two levels' flags,
    # their one running count and their packs, each made for both rows at once.
    flags_2xW = escapes.pack_flags(jnp.stack([wordcodec.beyond(d, code_limit(code_bits)),
                                              wordcodec.beyond(d, LEVEL1_LIMIT)]))
    running_2xW = escapes.running_count(flags_2xW)
    # The loop over escapes computes both levels' values at the escapes only, from the shard
    # and the cache (neither the deltas nor the cached slice made whole for it); a dense walk
    # takes them whole, level 1 from the deltas the kernel made (not a gather of the cache).
    x_N = x.reshape(-1)
    level1, level2 = kernels.escape_pack_rows(
        [escapes.PerElement(x.size, jnp.int8, lambda i: _level1(
            wordcodec.delta(bitfields.to_bits(x_N[i]), cached_at(i))), lambda: _level1(d)),
         escapes.PerElement(x.size, bitfields.to_bits(x_N[:1]).dtype,
                            lambda i: bitfields.to_bits(x_N[i]),
                            lambda: bitfields.to_bits(x_N))],
        flags_2xW, [wire.caps1[-1], wire.caps2[-1]], running_2xW, impl=impl)
    codes = wordcodec.pack_codes(wordcodec.codes_of(d, code_bits), code_bits)
    counts = jnp.stack([counts[CODE_BITS.index(code_bits)], counts[wordcodec.RAW],
                        counts[wordcodec.EXP_CHANGED]])
    demand = jnp.where(primed, counts, jnp.int32(INT32_MAX))
    return WordEncoded(codes, level1, level2, counts, demand, csum, axis, n_ranks, code_bits,
                       tuple(x.shape))


def _level1(d):
    """An escape's level-1 entry: its move as int8, or LEVEL2 (see level 2)."""
    return jnp.where(wordcodec.beyond(d, LEVEL1_LIMIT), LEVEL2, d).astype(jnp.int8)


def send(e: WordEncoded, agreed, shard, axis_name, impl: str = "auto") -> transfer.Sent:
    """The gather's transfers. ``agreed``: the agreed demand vector, or a
    :class:`~ciera_jax.collective.capacity.FixedRung` (the section then rides in the main
    transfer at a static size; a traced rung sends it in the section switch,
    :mod:`ciera_jax.codec.wire`). ``impl``: as exponent mode's send; word mode's decode reads
    its rows at any length."""
    del impl
    wire = e.wire
    if capacity.is_fixed(agreed):
        rung = agreed.rung
        ladder = wire.overflow_rungs(rung, agreed.exits)
        if ladder:  # an overflow within the ladder still sends words
            exit_ = capacity.exit_index(wire, agreed)
            plain = exit_ > len(ladder)
            taken = rung + jnp.where(plain, 0, exit_)  # the rung whose section travels in all
        else:  # a guaranteed rung compiles no fallback: nothing decides one
            exit_, taken = None, None
            plain = None if agreed.guaranteed else capacity.overflows(wire, agreed)
        rows = transfer.send_fixed(e.codes, [e.level1, e.level2], _sizes(wire, rung), shard,
                                   plain, e.checksum, axis_name)
        plain = jnp.bool_(False) if plain is None else plain
        return transfer.Sent(rows, (), rung, plain, transfer.section_bytes(
            wire.section_sizes, rung if taken is None else taken), exit_, ladder, taken)
    rung1, over1 = transfer.pick_rung(wire.caps1, agreed[ESCAPES])
    rung2, over2 = transfer.pick_rung(wire.caps2, agreed[RAW])
    overflow = over1 | over2
    rung = jnp.where(overflow, 0, jnp.maximum(rung1, rung2))
    rows = transfer.send_fixed(e.codes, [], [], shard, overflow, e.checksum, axis_name)
    sections = transfer.gather_section([e.level1, e.level2], [wire.caps1, wire.caps2], rung,
                                       axis_name)
    return transfer.Sent(rows, tuple(sections), rung, overflow,
                         transfer.section_bytes(wire.section_sizes, rung))


def _sizes(wire: WordWire, rung: int) -> list[int]:
    return [wire.caps1[rung], wire.caps2[rung]]


class Received(NamedTuple):
    """What a word gather's decode made of the transfers before its fill of the escapes."""

    checksums_N: jax.Array  # every rank's checksum of its true words
    dense_Nxn: jax.Array  # each element's cached word moved by its code (escapes: by the top)
    escape_NxW: jax.Array  # the escape flags, packed
    levels: tuple  # (level 1 (N, C1), level 2 (N, C2)) as they arrived
    # the escape flags' running count per word: the fill's, and an overflow exit's without a
    # prefix sum of its own (unused by the Triton fill, and then not compiled)
    running_NxW: jax.Array


def receive(e: WordEncoded, sent: transfer.Sent, cache_words, impl: str) -> Received:
    """The checksums, the code plane decoded against the cache and the escape levels."""
    wire, b = e.wire, e.code_bits
    at = () if sent.sections else _sizes(wire, sent.rung)  # a traced rung's came apart
    sent_N, plane_NxL, fixed = transfer.read_fixed(
        sent.rows, e.codes.shape[0], [e.level1.dtype, e.level2.dtype], at,
        [max(c, 1) for c in at])
    codes_Nxn = wordcodec.unpack_codes(plane_NxL, b, wire.n)
    # the cache's rank rows, read in place by the kernel where it can (no transpose of it)
    dense_Nxn = kernels.word_decode_rows(cache_words, codes_Nxn, b, e.shard_shape, e.axis,
                                         impl=impl)
    esc_NxW, running_NxW = escapes.pack_and_run(codes_Nxn == escape_code(b))
    return Received(sent_N, dense_Nxn, esc_NxW, tuple(sent.sections or fixed), running_NxW)


def fill(e: WordEncoded, got: Received, level1_NxC, level2_NxC, limit, impl: str,
         walk: str | None = None):
    """The words: the dense words with the first ``limit`` escapes of each row set from the
    levels. ``walk="dense"``: one pass over every element on the jnp path (an overflow's exit:
    rare, and a fraction of the loop's program)."""
    b = e.code_bits
    # An escape's dense word is its cached word moved by the escape code's offset, so the loop
    # over escapes reads where it writes and never touches the cache.
    escape_offset = escape_code(b) - code_limit(b)
    limit_N = jnp.full((e.n_ranks,), limit, jnp.int32)
    values_at = escape_words(level1_NxC, level2_NxC, escape_offset)
    init = jnp.zeros((e.n_ranks,), jnp.int32)
    if walk is not None:
        bits_Nxn = escapes.fill(got.dense_Nxn, got.escape_NxW, limit_N, values_at, init, walk,
                                got.running_NxW)
    else:
        bits_Nxn = kernels.escape_fill_words(
            got.dense_Nxn, got.escape_NxW, limit_N, level1_NxC, level2_NxC,
            escape_offset=escape_offset, level2_code=LEVEL2, values_at=values_at, init=init,
            impl=impl, running_RxW=got.running_NxW)
    return rows_to_full(bits_Nxn, e.shard_shape, e.axis)


def check(e: WordEncoded, got: Received, words, dtype) -> jax.Array:
    """The self-check of the rebuilt words: shards whose checksum differs from the sender's."""
    return selfcheck.failed_shards(bitfields.from_bits(words, dtype), got.checksums_N, e.axis)


def overflow_exit(e: WordEncoded, sent: transfer.Sent, got: Received, impl: str, axis_name):
    """At a fixed rung with overflow rungs (``sent.ladder``): the fallback branch
    that finishes an overflow to one of them, ``() -> words``, or None. A switch on the rung
    (``sent.exit``) whose branches hold only the transfer of the escapes past the fixed prefix
    up to that rung's capacities (:func:`transfer.overflow_rest`); one dense fill then sets
    them. The self-check runs once, after the fallback's conditional."""
    wire, ladder = e.wire, sent.ladder
    if not ladder:
        return None
    sent_sizes = _sizes(wire, sent.rung)

    def finish():
        rest = transfer.overflow_rest([e.level1, e.level2], sent_sizes,
                                      [_sizes(wire, r) for r in ladder], sent.exit - 1,
                                      axis_name)
        levels = [jnp.concatenate([level[:, :size], r], axis=1)
                  for level, size, r in zip(got.levels, sent_sizes, rest)]
        limit = jnp.asarray(wire.caps1, jnp.int32)[sent.rung + sent.exit]
        return fill(e, got, *levels, limit, impl, walk="dense")

    return finish


def escape_words(level1_NxC, level2_NxC, escape_offset: int):
    """``values_at`` for :func:`ciera_jax.codec.escapes.fill`: the escapes' words, each row's dense
    word moved by level 1's int8 (less the escape code's offset), or level 2's raw word (level
    2 holds the raw words of level 1's LEVEL2 entries, in their order; the carry counts them)."""

    def escaped(slot, dense, live, raw_before_N):
        move = escapes.take(level1_NxC, slot)
        raw = (move == LEVEL2) & live
        raw_W = escapes.pack_flags(raw)
        running_W = escapes.running_count(raw_W)
        raw_rank = raw_before_N[:, None] + escapes.ranks(raw_W, slot.shape[1], running_W)
        moved = wordcodec.apply_delta(dense, move.astype(jnp.int32) - escape_offset)
        words = jnp.where(raw, escapes.take(level2_NxC, raw_rank), moved)
        return words, raw_before_N + running_W[:, -1]

    return escaped

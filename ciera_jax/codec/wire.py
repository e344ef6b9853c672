"""The wire formats, in one table: what a compressed gather of one tensor sends, per rank.

Every compressed gather has two parts (:mod:`ciera_jax.collective.gather`):

- the **main plane**, whose size is fixed by the tensor alone, so its all-gather sits outside
  any conditional and XLA can run it asynchronously under compute: exponent mode's payload
  (sign + mantissa: ``n * (word_bytes - 1)`` bytes), word mode's ``b``-bit code plane
  (``ceil(n*b/8)`` bytes); both end with the sender's 4-byte checksum;
- the **escape section**, small and sized by a capacity rung that the step's one agreement
  (``pmax`` of every rank's counts) picks: a ``lax.switch`` chooses among all-gathers of a
  static prefix of each max-capacity buffer, and nothing else lives in its branches. Exponent
  mode sends which exponents changed as a two-level bitmap (the changed-bit of every element
  packed in uint32 flag words; of those only the nonzero ones, in order, with one bit per flag
  word saying which are nonzero) and the new exponents in position order; a rung holding ``K``
  exponents holds ``min(K, W)`` flag words, since each nonzero word holds a change. Word mode
  sends level 1 (an int8 move per escape, or ``LEVEL2``) and level 2 (the raw word of each
  ``LEVEL2`` escape), level 2 sized at 1/16 of level 1 on the rungs up to a quarter of the
  shard and at 1/8 above (:data:`LEVEL2_SHARES`).

Above the top rung, or on an unprimed cache, the gather falls back to a plain all-gather of the
bits (the one conditional with a large transfer, taken on rare steps). The main transfer
carries the head of the bits on such a step, so it costs plain's bytes and the checksum.

A train step can fix each tensor's rung when it is compiled instead (the host knows the demand
of the next step: the end of this one encoded and agreed on it): the escape section then
travels at that rung's static size inside the main transfer, and no collective sits in a
conditional but the fallback's. :data:`PLAIN_RUNG` fixes a plain gather of the bits (a priming
step, a tensor whose demand is above the top rung). :meth:`ExponentWire.bytes_at` prices both.

Capacities are fractions of the shard's ``n`` elements. This module is pure Python: the
collective, the cost model, the simulator and the benchmarks all price these numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

CHECKSUM_BYTES = 4  # every compressed gather sends a uint32 checksum of the shard's words
AGREEMENT_BYTES = 4  # one int32 count in the step's pmax
FLAG_WORD_BITS = 32  # the bitmap travels as uint32 words
INT8_BLOCK = 256  # the lossy baseline (ZeRO++ qwZ style): blockwise absmax int8
INT8_SCALE_BYTES = 4  # one float32 scale per block
PLAIN_RUNG = -1  # a rung fixed at compile time that gathers the tensor plainly

# Changed exponents one rank may send (0: nothing changed on any rank).
EXPONENT_CAPACITIES = (0.0, 1 / 2048, 1 / 1024, 1 / 512, 1 / 256, 1 / 128, 1 / 64, 1 / 32,
                       1 / 16, 1 / 8, 1 / 4)
# Word mode: escapes (|d| > code limit); raw words (|d| > 127) get LEVEL2_SHARES of as many.
# Up to every element escaping, so warm-up, where escapes are densest, still travels as words
# (cheaper than exponent mode or plain there too). Steps of at most 1.5x from n/32 up, where
# the steady state and the peak learning rate sit, 2x below: each rung is a branch of the
# section's switch, and branches cost compile time, so the ladder is as coarse as it can be
# without sending more (priced on small's recorded counts, weight_stability --from-counts).
LEVEL1_CAPACITIES = (0.0, 1 / 64, 1 / 32, 1 / 16, 3 / 32, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2,
                     3 / 4, 1.0)
# Raw words a rung holds, as a share of its escapes, by the rung's size (up to that share of
# the shard's elements). Raw words are a small share of the escapes from warm-up to the end
# (small's and tiny's recorded counts), a larger one at the top rungs' warm-up. 1/16 on the low
# rungs, where a train run spends its steady state, sends less than 1/8 would there, with the
# rungs its raw words then need.
LEVEL2_SHARES = ((1 / 4, 1 / 16), (1.0, 1 / 8))
# Overflow rungs (``exits``, ``ciera train --overflow-rungs``, on by default): a word tensor
# whose demand is above its fixed rung by up to this many rungs still travels as words; the
# fallback's conditional sends the escapes past the fixed prefix at the needed rung's size and
# fills them. A program's one rung then costs a drifting demand (warm-up, peak, decay) what
# each step's own rung would, up to padding (small's policy replay at one program), for a fill
# and a small switch in the fallback, off the steady path. Each switch costs compile time, so
# only the units carrying most of the word bytes get them
# (``ciera_jax.loop.rungs.EXIT_SHARE``).
OVERFLOW_RUNGS = 3
DEFAULT_CODE_BITS = 3  # the word-delta study: the best single width across phases
CODE_BITS_CHOICES = (2, 3, 4)


def capacities(n: int, fractions) -> tuple[int, ...]:
    """The rungs for a shard of ``n`` elements: strictly increasing, each at most ``n``."""
    out = []
    for f in fractions:
        c = min(n, math.ceil(n * f))
        if not out or c > out[-1]:
            out.append(c)
    return tuple(out)


def level2_share(escapes: int, n: int) -> float:
    """Raw words a level-1 capacity of ``escapes`` (of a shard of ``n``) comes with, per
    escape (:data:`LEVEL2_SHARES`)."""
    return next(share for upto, share in LEVEL2_SHARES if escapes <= math.ceil(n * upto))


def rung_for(caps: tuple[int, ...], count: int) -> int | None:
    """Index of the smallest capacity holding ``count``; None above the top."""
    return next((i for i, c in enumerate(caps) if count <= c), None)


def flag_words(n: int) -> int:
    """uint32 words that hold one flag per element of ``n``."""
    return -(-n // FLAG_WORD_BITS)


def code_bytes(n: int, code_bits: int) -> int:
    return -(-n * code_bits // 8)


class _FixedRungs:
    """What a wire sends with its rung fixed when the step is compiled (both modes)."""

    n: int
    word_bytes: int

    @property
    def plain_bytes(self) -> int:
        return self.n * self.word_bytes

    @property
    def rungs(self) -> int:
        """Rungs of the ladder (exponent mode's ``caps``, word mode's ``caps1``)."""
        return len(self.ladder)

    def bytes_at(self, rung: int, need: int, exits: int = 0) -> int:
        """Bytes one rank sends with the rung fixed at ``rung`` when the agreed demand needs
        rung ``need`` (:attr:`rungs`: above the top, or unprimed): the fixed section, or on an
        overflow :meth:`overflow_bytes` (``exits``: overflow rungs compiled);
        :data:`PLAIN_RUNG`: a plain gather."""
        if rung == PLAIN_RUNG:
            return self.plain_bytes
        if not 0 <= rung < self.rungs:
            raise ValueError(f"rung {rung} is outside 0..{self.rungs - 1} (or PLAIN_RUNG)")
        if need > rung:
            return self.overflow_bytes(rung, need, exits)
        return self.main_bytes + self.section_bytes(rung)

    def overflow_rungs(self, rung: int, exits: int) -> tuple[int, ...]:
        """The rungs above a fixed ``rung`` that an overflow still sends at, with ``exits``
        compiled (exponent mode: none, every overflow is a plain fallback)."""
        return ()

    def overflow_bytes(self, rung: int, need: int, exits: int = 0) -> int:
        """Bytes one rank sends with the rung fixed at ``rung`` when the demand needs rung
        ``need > rung``: the escapes at ``need``'s size when it is one of
        :meth:`overflow_rungs`, else the fallback's plain bytes."""
        if need in self.overflow_rungs(rung, exits):
            return self.main_bytes + self.section_bytes(need)
        return self.fallback_bytes


@dataclasses.dataclass(frozen=True)
class ExponentWire(_FixedRungs):
    """Exponent mode for a shard of ``n`` elements of ``word_bytes``-byte words."""

    n: int
    word_bytes: int

    @functools.cached_property
    def caps(self) -> tuple[int, ...]:
        """Changed exponents a rung holds."""
        return capacities(self.n, EXPONENT_CAPACITIES)

    @property
    def ladder(self) -> tuple[int, ...]:
        return self.caps

    @functools.cached_property
    def word_caps(self) -> tuple[int, ...]:
        """Nonzero flag words a rung holds (each holds a change: never more than ``caps``)."""
        return tuple(min(c, flag_words(self.n)) for c in self.caps)

    @functools.cached_property
    def summary_words(self) -> int:
        """uint32 words of the one-bit-per-flag-word summary."""
        return flag_words(flag_words(self.n))

    @property
    def main_bytes(self) -> int:
        return self.n * (self.word_bytes - 1) + CHECKSUM_BYTES

    @property
    def fallback_bytes(self) -> int:
        """A fallback step: the main transfer carries the head of the bits, a plain one the
        rest; the checksum still travels."""
        return self.n * self.word_bytes + CHECKSUM_BYTES

    def section_bytes(self, rung: int) -> int:
        """Nothing when no rank changed an exponent, else the summary, the rung's flag words
        and exponents."""
        cap = self.caps[rung]
        return 4 * (self.summary_words + self.word_caps[rung]) + cap if cap else 0

    @functools.cached_property
    def section_sizes(self) -> tuple[int, ...]:
        return tuple(self.section_bytes(k) for k in range(len(self.caps)))

    def sent_bytes(self, changed: int) -> int:
        """Bytes one rank sends when the most changed exponents on any rank is ``changed``
        (above the top rung: the shard's bits and the checksum)."""
        k = rung_for(self.caps, changed)
        if k is None:
            return self.fallback_bytes
        return self.main_bytes + self.section_bytes(k)


@dataclasses.dataclass(frozen=True)
class WordWire(_FixedRungs):
    """Word mode for a shard of ``n`` elements: ``code_bits``-bit codes plus escapes."""

    n: int
    word_bytes: int
    code_bits: int = DEFAULT_CODE_BITS

    def __post_init__(self):
        if self.code_bits not in CODE_BITS_CHOICES:
            raise ValueError(f"code_bits must be one of {CODE_BITS_CHOICES}, "
                             f"got {self.code_bits!r}")

    @functools.cached_property
    def caps1(self) -> tuple[int, ...]:
        """Escapes a rung holds (level 1)."""
        return capacities(self.n, LEVEL1_CAPACITIES)

    @property
    def ladder(self) -> tuple[int, ...]:
        return self.caps1

    @functools.cached_property
    def caps2(self) -> tuple[int, ...]:
        """Raw words a rung holds (level 2): :data:`LEVEL2_SHARES` of its escapes."""
        return tuple(math.ceil(c * level2_share(c, self.n)) for c in self.caps1)

    @property
    def main_bytes(self) -> int:
        return code_bytes(self.n, self.code_bits) + CHECKSUM_BYTES

    @property
    def fallback_bytes(self) -> int:
        return self.n * self.word_bytes + CHECKSUM_BYTES

    def section_bytes(self, rung: int) -> int:
        return self.caps1[rung] + self.caps2[rung] * self.word_bytes

    @functools.cached_property
    def section_sizes(self) -> tuple[int, ...]:
        return tuple(self.section_bytes(k) for k in range(len(self.caps1)))

    def overflow_rungs(self, rung: int, exits: int) -> tuple[int, ...]:
        """Up to ``exits`` rungs above ``rung``, within the ladder: an overflow to one of them
        sends the escapes past the fixed prefix (both levels' slots up to that rung's
        capacities) in the fallback's conditional."""
        if exits < 0:
            raise ValueError(f"exits must be >= 0, got {exits}")
        if rung == PLAIN_RUNG:
            return ()
        return tuple(range(rung + 1, min(rung + exits, self.rungs - 1) + 1))

    def rung(self, escapes: int, raw: int) -> int | None:
        """The smallest rung holding both counts; None above the top."""
        k1, k2 = rung_for(self.caps1, escapes), rung_for(self.caps2, raw)
        return None if k1 is None or k2 is None else max(k1, k2)

    def sent_bytes(self, escapes: int, raw: int) -> int:
        """Bytes one rank sends when the most escapes (``|d| > code limit``) on any rank is
        ``escapes`` and the most raw words (``|d| > 127``) is ``raw`` (above the top rung:
        the shard's bits and the checksum)."""
        k = self.rung(escapes, raw)
        if k is None:
            return self.fallback_bytes
        return self.main_bytes + self.section_bytes(k)


def agreement_bytes(mode: str) -> int:
    """Counts one tensor adds to the step's agreement: changed exponents, or escapes, raw
    words and changed exponents."""
    return AGREEMENT_BYTES * (3 if mode == "word" else 1)


def int8_wire_bytes(n_local: int) -> int:
    """Bytes one rank sends in an int8 gather: codes padded to whole blocks + a scale each."""
    return -(-n_local // INT8_BLOCK) * (INT8_BLOCK + INT8_SCALE_BYTES)

"""The wire formats, in one table: what a compressed gather of one tensor sends, per rank.

Every compressed gather has two parts (:mod:`ciera_jax.collective`):

- the **main plane**, whose size is fixed by the tensor alone, so its all-gather sits outside
  any conditional and XLA can run it asynchronously under compute: exponent mode's payload
  (sign + mantissa: ``n * (word_bytes - 1)`` bytes), word mode's ``b``-bit code plane
  (``ceil(n*b/8)`` bytes); both end with the sender's 4-byte checksum;
- the **escape sections**, small and sized by capacity rungs that the step's one agreement
  (``pmax`` of every rank's counts) picks: a ``lax.switch`` chooses among all-gathers of static
  prefixes of one max-capacity buffer, and nothing else lives in its branches. Exponent mode
  sends which exponents changed as a two-level bitmap (the changed-bit of every element packed
  in uint32 flag words; of those, only the nonzero words, in order, and one bit per flag word
  saying which are nonzero) and the new exponents in position order; word mode sends level 1
  (an int8 move per escape, or ``LEVEL2``) and level 2 (the raw word of each ``LEVEL2``
  escape).

Above the top rung, or on an unprimed cache, the gather falls back to a plain all-gather of the
bits (the one conditional with a large transfer, taken on rare steps); the main plane has
travelled by then, so such a step sends ``main + plain`` bytes.

Capacities are fractions of the shard's ``n`` elements. This module is pure Python: the
collective, the cost model, the simulator and the benchmarks all price these numbers.
"""

from __future__ import annotations

import dataclasses
import math

CHECKSUM_BYTES = 4  # every compressed gather sends a uint32 checksum of the shard's words
AGREEMENT_BYTES = 4  # one int32 count in the step's pmax
FLAG_WORD_BITS = 32  # the bitmap travels as uint32 words

# Changed exponents one rank may send (0: nothing changed on any rank), and the nonzero flag
# words (32 elements each) that locate them, as a share of the flag words.
EXPONENT_CAPACITIES = (0.0, 1 / 2048, 1 / 1024, 1 / 512, 1 / 256, 1 / 128, 1 / 64, 1 / 32,
                       1 / 16, 1 / 8, 1 / 4)
FLAG_WORD_CAPACITIES = (0.0, 1 / 256, 1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
# Word mode: escapes (|d| > code limit) and raw words (|d| > 127).
LEVEL1_CAPACITIES = (0.0, 1 / 256, 1 / 128, 1 / 64, 1 / 32, 3 / 64, 1 / 16, 3 / 32, 1 / 8,
                     3 / 16, 1 / 4, 3 / 8, 1 / 2)
LEVEL2_CAPACITIES = (0.0, 1 / 4096, 1 / 1024, 1 / 256, 1 / 64, 1 / 16, 1 / 4)
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


def rung_for(caps: tuple[int, ...], count: int) -> int | None:
    """Index of the smallest capacity holding ``count``; None above the top."""
    return next((i for i, c in enumerate(caps) if count <= c), None)


def flag_words(n: int) -> int:
    """uint32 words that hold one flag per element of ``n``."""
    return -(-n // FLAG_WORD_BITS)


def code_bytes(n: int, code_bits: int) -> int:
    return -(-n * code_bits // 8)


@dataclasses.dataclass(frozen=True)
class ExponentWire:
    """Exponent mode for a shard of ``n`` elements of ``word_bytes``-byte words."""

    n: int
    word_bytes: int

    @property
    def caps(self) -> tuple[int, ...]:
        """Changed exponents a rung holds."""
        return capacities(self.n, EXPONENT_CAPACITIES)

    @property
    def word_caps(self) -> tuple[int, ...]:
        """Nonzero flag words a rung holds."""
        return capacities(flag_words(self.n), FLAG_WORD_CAPACITIES)

    @property
    def summary_words(self) -> int:
        """uint32 words of the one-bit-per-flag-word summary."""
        return flag_words(flag_words(self.n))

    @property
    def main_bytes(self) -> int:
        return self.n * (self.word_bytes - 1) + CHECKSUM_BYTES

    @property
    def flag_sizes(self) -> tuple[int, ...]:
        """uint32 words of the flag section per rung: the summary and the nonzero words."""
        return tuple(self.summary_words + c if c else 0 for c in self.word_caps)

    def sent_bytes(self, changed: int, nonzero_words: int) -> int:
        """Bytes one rank sends when the most changed exponents on any rank is ``changed`` and
        the most nonzero flag words is ``nonzero_words``. Above the top rungs the main plane
        has travelled too, then the plain fallback."""
        k, kw = rung_for(self.caps, changed), rung_for(self.word_caps, nonzero_words)
        if k is None or kw is None:
            return self.main_bytes + self.n * self.word_bytes
        return self.main_bytes + 4 * self.flag_sizes[kw] + self.caps[k]


@dataclasses.dataclass(frozen=True)
class WordWire:
    """Word mode for a shard of ``n`` elements: ``code_bits``-bit codes plus escapes."""

    n: int
    word_bytes: int
    code_bits: int = DEFAULT_CODE_BITS

    def __post_init__(self):
        if self.code_bits not in CODE_BITS_CHOICES:
            raise ValueError(f"code_bits must be one of {CODE_BITS_CHOICES}, "
                             f"got {self.code_bits!r}")

    @property
    def caps1(self) -> tuple[int, ...]:
        return capacities(self.n, LEVEL1_CAPACITIES)

    @property
    def caps2(self) -> tuple[int, ...]:
        return capacities(self.n, LEVEL2_CAPACITIES)

    @property
    def main_bytes(self) -> int:
        return code_bytes(self.n, self.code_bits) + CHECKSUM_BYTES

    def level1_bytes(self, rung: int) -> int:
        return self.caps1[rung]

    def level2_bytes(self, rung: int) -> int:
        return self.caps2[rung] * self.word_bytes

    @property
    def level1_sizes(self) -> tuple[int, ...]:
        return tuple(self.level1_bytes(k) for k in range(len(self.caps1)))

    @property
    def level2_sizes(self) -> tuple[int, ...]:
        return tuple(self.level2_bytes(k) for k in range(len(self.caps2)))

    def sent_bytes(self, escapes: int, raw: int) -> int:
        """Bytes one rank sends when the most escapes (``|d| > code limit``) on any rank is
        ``escapes`` and the most raw words (``|d| > 127``) is ``raw`` (above the top rungs:
        the main plane, then the plain fallback)."""
        k1, k2 = rung_for(self.caps1, escapes), rung_for(self.caps2, raw)
        if k1 is None or k2 is None:
            return self.main_bytes + self.n * self.word_bytes
        return self.main_bytes + self.level1_bytes(k1) + self.level2_bytes(k2)


def agreement_bytes(mode: str) -> int:
    """Counts one tensor adds to the step's agreement: changed exponents and nonzero flag
    words, or escapes, raw words and changed exponents."""
    return AGREEMENT_BYTES * (3 if mode == "word" else 2)

"""Word mode's capacity ladder: the wire format's static sizes, in one place.

Word mode sends, per element of a shard of ``n`` elements, a ``b``-bit code of the word's move
since the cached word, ``d = ord(new) - ord(cached)`` (``ord``: the monotone integer of the word,
negatives as ``-magnitude - 1``, so +0 and -0 stay distinct). Codes hold ``|d| <= code_limit(b)``;
the top code value (``2**b - 1``) is the escape. Escape positions are implied: the i-th escape
of the code plane takes slot i of level 1 (an int8 delta for ``|d| <= 127``; ``LEVEL2`` there
means "see level 2"), and the j-th ``LEVEL2`` slot takes slot j of level 2 (the raw word).

A rung fixes ``b`` and both capacities as fractions of ``n`` (powers of two), so every shape is
static; the step's one agreement collective picks the cheapest rung that holds every rank's
escapes. Pure Python: the collective, the planner, the simulator and the studies all price the
same rungs.

    wire bytes of one rank = ceil(n*b/8) + level1_capacity + level2_capacity * word_bytes
"""

from __future__ import annotations

import dataclasses
import math

LEVEL1_LIMIT = 127  # |d| a level-1 int8 delta holds
LEVEL2 = -128  # the level-1 value that sends the escape on to level 2
CODE_BITS = (2, 3, 4)


def code_limit(code_bits: int) -> int:
    """Largest |d| a ``code_bits``-bit code holds without escaping (1, 3, 7 for 2, 3, 4)."""
    return 2 ** (code_bits - 1) - 1


def escape_code(code_bits: int) -> int:
    return 2 ** code_bits - 1


@dataclasses.dataclass(frozen=True)
class WordRung:
    """One preset of the word-mode wire: code width and the two escape capacities."""

    code_bits: int
    level1_frac: float  # escapes (any |d| > code_limit) this rung holds, as a share of n
    level2_frac: float  # raw words (|d| > 127, or not representable) it holds

    def level1_capacity(self, n: int) -> int:
        return _capacity(n, self.level1_frac)

    def level2_capacity(self, n: int) -> int:
        return min(_capacity(n, self.level2_frac), self.level1_capacity(n))

    def code_bytes(self, n: int) -> int:
        return -(-n * self.code_bits // 8)

    def wire_bytes(self, n: int, word_bytes: int) -> int:
        """Bytes one rank sends for a shard of ``n`` elements of ``word_bytes``-byte words."""
        return (self.code_bytes(n) + self.level1_capacity(n)
                + self.level2_capacity(n) * word_bytes)

    def fits(self, n: int, escapes: int, raw: int) -> bool:
        """Does this rung hold ``escapes`` escapes (at this code width) of which ``raw`` go raw?"""
        return escapes <= self.level1_capacity(n) and raw <= self.level2_capacity(n)


def _capacity(n: int, frac: float) -> int:
    return max(1, math.ceil(n * frac)) if frac > 0 else 0


# Chosen from the word-delta study (shared/studies/word_delta): steady state escapes
# P(|d|>1) ~ 0.14-0.26, P(|d|>3) ~ 0.06-0.12, P(|d|>7) ~ 0.03-0.06, P(|d|>127) ~ 0.2-0.3%;
# peak LR P(|d|>7) ~ 0.2, P(|d|>127) ~ 1.5%. Ordered by bytes per weight (bf16 figures).
WORD_LADDER: tuple[WordRung, ...] = (
    WordRung(2, 1 / 8, 1 / 512),  # 0.379 B/weight: the cosine tail
    WordRung(3, 1 / 16, 1 / 512),  # 0.441
    WordRung(3, 1 / 8, 1 / 256),  # 0.508
    WordRung(4, 1 / 32, 1 / 512),  # 0.535
    WordRung(4, 1 / 16, 1 / 256),  # 0.570: steady state
    WordRung(4, 1 / 8, 1 / 128),  # 0.641
    WordRung(4, 1 / 4, 1 / 64),  # 0.781: peak LR
    WordRung(4, 1 / 4, 1 / 32),  # 0.813
)


def cheapest_fit(n: int, word_bytes: int, escapes_by_bits: dict[int, int], raw: int,
                 ladder=WORD_LADDER) -> int | None:
    """Index of the cheapest rung holding the escapes (``escapes_by_bits[b]``: elements with
    ``|d| > code_limit(b)``; ``raw``: elements with ``|d| > 127``), or None above the top."""
    best = None
    for i, r in enumerate(ladder):
        if r.fits(n, escapes_by_bits[r.code_bits], raw):
            if best is None or r.wire_bytes(n, word_bytes) < ladder[best].wire_bytes(n, word_bytes):
                best = i
    return best

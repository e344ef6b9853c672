"""Word mode's code constants: code widths, limits, the escape code and level-1 values.

Word mode sends, per element of a shard of ``n`` elements, a ``b``-bit code of the word's move
since the cached word, ``d = ord(new) - ord(cached)`` (``ord``: the monotone integer of the word,
negatives as ``-magnitude - 1``, so +0 and -0 stay distinct). Codes hold ``|d| <= code_limit(b)``;
the top code value (``2**b - 1``) is the escape. Escape positions are implied: the i-th escape
of the code plane takes slot i of level 1 (an int8 delta for ``|d| <= 127``; ``LEVEL2`` there
means "see level 2"), and the j-th ``LEVEL2`` slot takes slot j of level 2 (the raw word).

The capacities of both levels, and so the bytes on the wire, are in :mod:`ciera_jax.codec.wire`.
"""

from __future__ import annotations

LEVEL1_LIMIT = 127  # |d| a level-1 int8 delta holds
LEVEL2 = -128  # the level-1 value that sends the escape on to level 2
CODE_BITS = (2, 3, 4)
# A word tensor's demand vector (what its gather's agreement takes the max of): escapes at its
# code width, raw words (level 2), changed exponents.
ESCAPES, RAW, EXP_CHANGED = 0, 1, 2


def code_limit(code_bits: int) -> int:
    """Largest |d| a ``code_bits``-bit code holds without escaping (1, 3, 7 for 2, 3, 4)."""
    return 2 ** (code_bits - 1) - 1


def escape_code(code_bits: int) -> int:
    return 2 ** code_bits - 1

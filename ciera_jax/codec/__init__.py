"""Bit-level formats, pure functions of arrays (or pure Python tables): what one gather sends.

bitfields.py    bit split / merge per dtype (same-width bitcasts, shifts, masks)
wordcodec.py    word mode in pure jnp: order map, deltas, code packing, dense decode
word_ladder.py  word mode's code constants (code widths, limits, escape code, LEVEL2)
escapes.py      implied-position escapes: flags packed 32 to a word, ranks by popcount
checksum.py     the 32-bit position-mixing shard checksum
wire.py         the wire table: capacities (rungs) and bytes per mode, pure Python
layout.py       rank rows <-> the full tensor's layout, and a shard element's full index

Imports only :mod:`ciera_jax.runtime`; no collective, no module state.
"""

"""The compressed all-gather inside ``jax.shard_map``: its phases, transfers, caches and check.

gather.py           all_gather / all_gather_tree and the phases encode, agree, exchange
exponent_option.py  exponent mode: encode and exchange
word_option.py      word mode: encode and exchange
transfer.py         the main plane outside conditionals, the escape section, the fallback
capacity.py         FixedRung: the rung fixed when the step is compiled
selfcheck.py        the sender's checksum on the main plane; the receiver's check
validation.py       checks on what a caller passes
cache.py            ExponentCache, WordCache, init_cache
gradient.py         the one custom VJP every gather shares (backward: psum_scatter)
heal.py, faults.py  what a failed check does; corrupting one rank's cache for drills
quantized.py        the int8 blockwise gather (the lossy baseline)

Imports :mod:`ciera_jax.codec`, :mod:`ciera_jax.kernels` and :mod:`ciera_jax.runtime`. The
public names are exported by the top-level ``ciera_jax``.
"""

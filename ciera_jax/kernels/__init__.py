"""Pallas kernels for the hot path of the compressed all-gather, and the dispatch that picks them.

``encode`` / ``decode`` take ``impl="auto" | "xla" | "pallas"``; each kernel has its pure-jnp
reference beside it (``encode_reference``, ``decode_reference``; word mode: ``word_encode_*``,
``word_decode_*``) that the tests compare against. The GPU backend is chosen in ``backend.py``.
"""

from ciera_jax.kernels.decode import decode_pallas, decode_reference
from ciera_jax.kernels.dispatch import (IMPLS, decode, encode, resolve_impl, word_decode,
                                       word_encode)
from ciera_jax.kernels.encode import BLOCK, encode_pallas, encode_reference
from ciera_jax.kernels.word_decode import word_decode_pallas, word_decode_reference
from ciera_jax.kernels.word_encode import word_encode_pallas, word_encode_reference

__all__ = [
    "BLOCK",
    "IMPLS",
    "decode",
    "decode_pallas",
    "decode_reference",
    "encode",
    "encode_pallas",
    "encode_reference",
    "resolve_impl",
    "word_decode",
    "word_decode_pallas",
    "word_decode_reference",
    "word_encode",
    "word_encode_pallas",
    "word_encode_reference",
]

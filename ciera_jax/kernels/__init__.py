"""Pallas kernels for the hot path of the compressed all-gather, and the dispatch that picks them.

``encode`` / ``decode`` / ``word_encode`` / ``word_decode`` take ``impl="auto" | "xla" |
"pallas" | "mosaic" | "triton"``; each kernel has its pure-jnp reference beside it
(``encode_reference``, ``decode_reference``; word mode: ``word_encode_*``, ``word_decode_*``)
that the tests compare against, and a body shared by both Pallas GPU backends (Mosaic GPU,
Triton). Which backend runs where is decided in ``backend.py`` (see docs/kernels.md).
``decode_checksum_pallas`` is the fused decode + per-rank checksum option.
"""

from ciera_jax.kernels.backend import (BACKENDS, CUSTOM_CALL, available_backends, gpu_capability,
                                       lowering_for)
from ciera_jax.kernels.decode import decode_pallas, decode_reference
from ciera_jax.kernels.decode_checksum import (decode_checksum, decode_checksum_pallas,
                                               decode_checksum_reference, fusable)
from ciera_jax.kernels.dispatch import (IMPLS, decode, encode, resolve, resolve_impl,
                                        word_decode, word_encode)
from ciera_jax.kernels.encode import BLOCK, encode_pallas, encode_reference
from ciera_jax.kernels.word_decode import word_decode_pallas, word_decode_reference
from ciera_jax.kernels.word_encode import word_encode_pallas, word_encode_reference

__all__ = [
    "BACKENDS",
    "BLOCK",
    "CUSTOM_CALL",
    "IMPLS",
    "available_backends",
    "decode",
    "decode_checksum",
    "decode_checksum_pallas",
    "decode_checksum_reference",
    "decode_pallas",
    "decode_reference",
    "encode",
    "encode_pallas",
    "encode_reference",
    "fusable",
    "gpu_capability",
    "lowering_for",
    "resolve",
    "resolve_impl",
    "word_decode",
    "word_decode_pallas",
    "word_decode_reference",
    "word_encode",
    "word_encode_pallas",
    "word_encode_reference",
]

"""Pallas kernels for the hot path of the compressed all-gather, and the dispatch that picks them.

``encode`` / ``decode`` / ``word_encode`` / ``word_decode`` take ``impl="auto" | "xla" |
"pallas" | "mosaic" | "triton"``; each kernel has its pure-jnp reference beside it
(``encode_reference``, ``decode_reference``; word mode: ``word_encode_*``, ``word_decode_*``)
that the tests compare against, and a body shared by both Pallas GPU backends (Mosaic GPU,
Triton). Which backend runs where is decided in ``backend.py`` (see docs/kernels.md).
``decode_checksum_pallas`` is the fused decode + per-rank checksum option. The wire's escapes
(``escape_pack``, ``escape_fill_exponents``, ``escape_fill_words``) have Triton kernels
(``escape.py``; Mosaic GPU has no per-element gather/scatter) beside the jnp loops of
:mod:`ciera_jax.codec.escapes`.
"""

from ciera_jax.kernels.backend import (BACKENDS, CUSTOM_CALL, available_backends, gpu_capability,
                                       lowering_for)
from ciera_jax.kernels.decode import decode_pallas, decode_reference
from ciera_jax.kernels.decode_checksum import (decode_checksum, decode_checksum_pallas,
                                               decode_checksum_reference, fusable,
                                               row_align)
from ciera_jax.kernels.dispatch import (IMPLS, decode, encode, escape_fill_exponents,
                                        escape_fill_words, escape_impl, escape_pack,
                                        escape_pack_rows, resolve,
                                        resolve_impl, word_decode, word_decode_rows, word_encode)
from ciera_jax.kernels.encode import BLOCK, encode_pallas, encode_reference
from ciera_jax.kernels.escape import (ESCAPE_BLOCK, fill_exponents_pallas, fill_words_pallas,
                                      pack_pallas)
from ciera_jax.kernels.word_decode import (word_decode_pallas, word_decode_reference,
                                           word_decode_rows_pallas)
from ciera_jax.kernels.word_encode import word_encode_pallas, word_encode_reference

__all__ = [
    "BACKENDS",
    "BLOCK",
    "CUSTOM_CALL",
    "ESCAPE_BLOCK",
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
    "escape_fill_exponents",
    "escape_fill_words",
    "escape_impl",
    "escape_pack",
    "escape_pack_rows",
    "fill_exponents_pallas",
    "fill_words_pallas",
    "fusable",
    "gpu_capability",
    "lowering_for",
    "pack_pallas",
    "resolve",
    "resolve_impl",
    "row_align",
    "word_decode",
    "word_decode_pallas",
    "word_decode_reference",
    "word_decode_rows",
    "word_decode_rows_pallas",
    "word_encode",
    "word_encode_pallas",
    "word_encode_reference",
]

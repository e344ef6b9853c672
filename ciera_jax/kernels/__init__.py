"""Pallas kernels for the hot path of the compressed all-gather, and the dispatch that picks them.

``encode`` / ``decode`` take ``impl="auto" | "xla" | "pallas"``; each kernel has its pure-jnp
reference beside it (``encode_reference``, ``decode_reference``) that the tests compare against.
"""

from ciera_jax.kernels.decode import decode_pallas, decode_reference
from ciera_jax.kernels.dispatch import IMPLS, decode, encode, resolve_impl
from ciera_jax.kernels.encode import BLOCK, encode_pallas, encode_reference

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
]

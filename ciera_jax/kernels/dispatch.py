"""Picks the implementation of the codec hot path: the Pallas kernels on GPU, fused jnp elsewhere.

``impl``: ``"xla"`` is the pure-jnp reference (``codec.split`` / ``codec.merge``, which XLA
fuses); ``"pallas"`` is the Pallas kernel, run with ``interpret=True`` when the default backend
is not a GPU (that is how the tests exercise the kernel bodies on CPU); ``"auto"`` is pallas on
GPU and xla everywhere else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ciera_jax.kernels.decode import decode_pallas, decode_reference
from ciera_jax.kernels.encode import encode_pallas, encode_reference
from ciera_jax.kernels.word_decode import word_decode_pallas, word_decode_reference
from ciera_jax.kernels.word_encode import word_encode_pallas, word_encode_reference

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str) -> tuple[str, bool]:
    """``impl`` -> (``"xla"`` or ``"pallas"``, interpret?)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown codec impl {impl!r}; expected one of {IMPLS}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu else "xla"
    return impl, impl == "pallas" and not on_gpu


def encode(x: jnp.ndarray, cache_exp: jnp.ndarray, *, impl: str = "auto"):
    """``x`` (bf16/float32, any shape) and its cached exponents -> ``(exp, payload_Pxn, changed)``.

    ``exp``: uint8, ``x.shape``; ``payload_Pxn``: uint8, ``(P, *x.shape)`` as ``codec.split``
    (P=1 bf16, P=3 float32); ``changed``: bool, ``exp != cache_exp``.
    """
    impl, interpret = resolve_impl(impl)
    if cache_exp.shape != x.shape:
        raise ValueError(f"cache_exp shape {cache_exp.shape} != x shape {x.shape}")
    if impl == "xla":
        return encode_reference(x, cache_exp)
    return encode_pallas(x, cache_exp, interpret=interpret)


def decode(exp: jnp.ndarray, payload_Pxn: jnp.ndarray, dtype, *, impl: str = "auto"):
    """Exactly ``codec.merge(exp, payload_Pxn, dtype)``, any shape."""
    impl, interpret = resolve_impl(impl)
    if impl == "xla":
        return decode_reference(exp, payload_Pxn, dtype)
    return decode_pallas(exp, payload_Pxn, dtype, interpret=interpret)


def word_encode(x: jnp.ndarray, cached_bits: jnp.ndarray, *, impl: str = "auto"):
    """Word mode: ``x`` and this rank's cached words -> ``(d, demand)`` (see
    :func:`ciera_jax.kernels.word_encode_reference`)."""
    impl, interpret = resolve_impl(impl)
    if cached_bits.shape != x.shape:
        raise ValueError(f"cached words shape {cached_bits.shape} != x shape {x.shape}")
    if impl == "xla":
        return word_encode_reference(x, cached_bits)
    return word_encode_pallas(x, cached_bits, interpret=interpret)


def word_decode(cached_bits: jnp.ndarray, codes: jnp.ndarray, code_bits: int, *,
                impl: str = "auto"):
    """Word mode's dense rebuild ``ord⁻¹(ord(cached) + code - limit)``, any shape."""
    impl, interpret = resolve_impl(impl)
    if impl == "xla":
        return word_decode_reference(cached_bits, codes, code_bits)
    return word_decode_pallas(cached_bits, codes, code_bits, interpret=interpret)

"""Picks the implementation of the codec hot path: Pallas kernels on a GPU, fused jnp elsewhere.

``impl`` (see the table in ``backend.py``): ``"xla"`` is the pure-jnp reference
(``codec.split`` / ``codec.merge``, which XLA fuses); ``"pallas"`` is the Pallas kernel on the
backend that suits the GPU (Mosaic GPU on compute capability 9.0+, Triton below), run in that
backend's CPU interpreter when there is no GPU (how the tests exercise the kernel bodies);
``"mosaic"`` / ``"triton"`` force a backend; ``"auto"`` is Mosaic GPU on Hopper and newer and
xla everywhere else (Ampere included).

The escapes (``escape_pack``, ``escape_fill_exponents``, ``escape_fill_words``) have Triton
kernels only (Mosaic GPU has no per-element gather or scatter: ``kernels/escape.py``). They run
wherever ``impl`` resolves to the Triton backend (``"triton"``; ``"pallas"`` below Hopper and,
interpreted, on CPU); everywhere else, ``"auto"`` included, they are the jnp path of
:mod:`ciera_jax.codec.escapes`, whose walk :func:`ciera_jax.codec.escapes.walk_for` fixes at trace time
(one dense pass on a GPU; the loop over escapes only on CPU, for long rows).
"""

from __future__ import annotations

import jax.numpy as jnp

from ciera_jax.codec import escapes
from ciera_jax.codec.layout import full_to_rows
from ciera_jax.kernels.backend import IMPLS, available_backends, resolve
from ciera_jax.kernels.decode import decode_pallas, decode_reference
from ciera_jax.kernels.encode import encode_pallas, encode_reference
from ciera_jax.kernels.escape import fill_exponents_pallas, fill_words_pallas, pack_pallas
from ciera_jax.kernels.word_decode import (reads_in_place, word_decode_pallas,
                                           word_decode_reference, word_decode_rows_pallas)
from ciera_jax.kernels.word_encode import word_encode_pallas, word_encode_reference

__all__ = ["IMPLS", "decode", "encode", "escape_fill_exponents", "escape_fill_words",
           "escape_impl", "escape_pack", "escape_pack_rows", "resolve", "resolve_impl",
           "word_decode", "word_decode_rows", "word_encode"]


def resolve_impl(impl: str) -> tuple[str, bool]:
    """``impl`` -> (``"xla"`` or ``"pallas"``, interpret?); :func:`resolve` also names the
    backend."""
    c = resolve(impl)
    return c.kind, c.interpret


def _pallas(impl: str):
    c = resolve(impl)
    return None if c.kind == "xla" else dict(backend=c.backend, interpret=c.interpret)


def encode(x: jnp.ndarray, cache_exp: jnp.ndarray, *, impl: str = "auto"):
    """``x`` (bf16/float32, any shape) and its cached exponents -> ``(exp, payload_Pxn, changed)``.

    ``exp``: uint8, ``x.shape``; ``payload_Pxn``: uint8, ``(P, *x.shape)`` as ``codec.split``
    (P=1 bf16, P=3 float32); ``changed``: bool, ``exp != cache_exp``.
    """
    kw = _pallas(impl)
    if cache_exp.shape != x.shape:
        raise ValueError(f"cache_exp shape {cache_exp.shape} != x shape {x.shape}")
    if kw is None:
        return encode_reference(x, cache_exp)
    return encode_pallas(x, cache_exp, **kw)


def decode(exp: jnp.ndarray, payload_Pxn: jnp.ndarray, dtype, *, impl: str = "auto"):
    """Exactly ``codec.merge(exp, payload_Pxn, dtype)``, any shape."""
    kw = _pallas(impl)
    if kw is None:
        return decode_reference(exp, payload_Pxn, dtype)
    return decode_pallas(exp, payload_Pxn, dtype, **kw)


def word_encode(x: jnp.ndarray, cached_bits: jnp.ndarray, *, impl: str = "auto"):
    """Word mode: ``x`` and this rank's cached words -> ``(d, demand)`` (see
    :func:`ciera_jax.kernels.word_encode_reference`)."""
    kw = _pallas(impl)
    if cached_bits.shape != x.shape:
        raise ValueError(f"cached words shape {cached_bits.shape} != x shape {x.shape}")
    if kw is None:
        return word_encode_reference(x, cached_bits)
    return word_encode_pallas(x, cached_bits, **kw)


def word_decode(cached_bits: jnp.ndarray, codes: jnp.ndarray, code_bits: int, *,
                impl: str = "auto"):
    """Word mode's dense rebuild ``ord⁻¹(ord(cached) + code - limit)``, any shape."""
    kw = _pallas(impl)
    if kw is None:
        return word_decode_reference(cached_bits, codes, code_bits)
    return word_decode_pallas(cached_bits, codes, code_bits, **kw)


def word_decode_rows(cached_full: jnp.ndarray, codes_Nxn: jnp.ndarray, code_bits: int,
                     shard_shape, axis: int, *, impl: str = "auto"):
    """:func:`word_decode` of the cache's rank rows (``full_to_rows(cached_full)``) and the
    codes' (N, n): the kernel reads the cache in place where its blocks allow
    (:func:`~ciera_jax.kernels.word_decode.reads_in_place`), else the rows are made first."""
    kw = _pallas(impl)
    if kw is not None and reads_in_place(shard_shape, axis):
        return word_decode_rows_pallas(cached_full, codes_Nxn, code_bits, shard_shape, axis,
                                       **kw)
    cached_Nxn = full_to_rows(cached_full, shard_shape, axis, codes_Nxn.shape[0])
    return word_decode(cached_Nxn, codes_Nxn, code_bits, impl=impl)


def escape_impl(impl: str) -> str:
    """What runs the escapes for ``impl`` here: ``"triton"`` (the kernels, interpreted off
    GPU) where ``impl`` resolves to the Triton backend and this JAX has it, else ``"xla"``."""
    c = resolve(impl)
    triton = c.kind == "pallas" and c.backend == "triton" and "triton" in available_backends()
    return "triton" if triton else "xla"


def _escape_pallas(impl: str):
    """Keyword arguments of the Triton escape kernels, or None for the jnp loops."""
    if escape_impl(impl) == "xla":
        return None
    return dict(interpret=resolve(impl).interpret)


def escape_pack(values, words_W: jnp.ndarray, capacity: int, *, impl: str = "auto",
                running_W=None):
    """Exactly ``escapes.pack(values, words_W, capacity)``: the flagged values in position
    order in a (capacity,) buffer, zeros after the last. ``values``: (n,) or
    :class:`ciera_jax.codec.escapes.PerElement`; ``running_W``: the flags' running count, when
    the caller has it (the jnp path's; the Triton kernel counts its own)."""
    kw = _escape_pallas(impl)
    if kw is None:
        return escapes.pack(values, words_W, capacity, running_W=running_W)
    if isinstance(values, escapes.PerElement):
        values = values.whole()
    return pack_pallas(values, words_W, capacity, **kw)


def escape_pack_rows(values: list, words_RxW: jnp.ndarray, capacities: list[int],
                     running_RxW: jnp.ndarray, *, impl: str = "auto") -> list:
    """:func:`escape_pack` of each row of flags (one length) at its capacity: on the jnp
    path ``escapes.pack_rows`` (the rows' bitmaps and ranks made together); the Triton
    kernel packs each row."""
    kw = _escape_pallas(impl)
    if kw is None:
        return escapes.pack_rows(values, words_RxW, capacities, running_RxW)
    return [escape_pack(v, w, c, impl=impl) for v, w, c in zip(values, words_RxW, capacities)]


def escape_fill_exponents(cached_Rxn: jnp.ndarray, flags_RxW: jnp.ndarray,
                          section_RxK: jnp.ndarray, limit_R: jnp.ndarray, *,
                          impl: str = "auto"):
    """Exponent mode's receiver, exactly ``escapes.fill`` of each row's section values in order
    (slots below ``limit_R``) over ``cached_Rxn``."""
    kw = _escape_pallas(impl)
    if kw is None:
        return escapes.fill(cached_Rxn, flags_RxW, limit_R,
                            lambda slot, _, __, c: (escapes.take(section_RxK, slot), c))
    return fill_exponents_pallas(cached_Rxn, flags_RxW, section_RxK, limit_R, **kw)


def escape_fill_words(dense_Rxn: jnp.ndarray, flags_RxW: jnp.ndarray, limit_R: jnp.ndarray,
                      level1_RxC: jnp.ndarray, level2_RxC: jnp.ndarray, *, escape_offset: int,
                      level2_code: int, values_at, init, impl: str = "auto", running_RxW=None):
    """Word mode's receiver: ``escapes.fill(dense_Rxn, flags_RxW, limit_R, values_at, init)``
    on the jnp path (``values_at``: the caller's rule, level 1's move or level 2's raw word;
    ``running_RxW``: the flags' running count, when the caller has it); the Triton kernel
    applies the same rule from ``level1_RxC``, ``level2_RxC``, ``escape_offset`` and
    ``level2_code`` (see :func:`kernels.escape.fill_words_pallas`)."""
    kw = _escape_pallas(impl)
    if kw is None:
        return escapes.fill(dense_Rxn, flags_RxW, limit_R, values_at, init,
                            running_RxW=running_RxW)
    return fill_words_pallas(dense_Rxn, flags_RxW, level1_RxC, level2_RxC, limit_R,
                             escape_offset=escape_offset, level2_code=level2_code, **kw)

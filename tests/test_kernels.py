"""Exponent-mode Pallas kernels vs their pure-jnp references, bit for bit, on every backend.

Both Pallas GPU backends run the same kernel body. On CPU each runs in its own interpreter
(Mosaic GPU: ``InterpretGPUParams``, which simulates the kernel's threads and global refs;
Triton: the HLO interpreter). With ``JAX_PLATFORMS=cuda`` (``benchmarks/gpu_check.sh``) the same
tests compile and run the real kernels of both backends. Lowering for CUDA without a GPU is in
``test_cuda_lowering.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import bitdata
from ciera_jax.codec import bitfields
from ciera_jax import kernels as K

BLOCK = K.BLOCK
WORDS = {jnp.bfloat16: np.uint16, jnp.float32: np.uint32}
DTYPES = list(WORDS)
ON_GPU = jax.default_backend() == "gpu"
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(b not in K.available_backends(),
                                                     reason=f"no Pallas {b} in this JAX"))
            for b in K.BACKENDS]

# Words every codec must carry exactly: signed zeros, infinities, quiet and signalling NaNs with
# varied payloads and both signs, subnormals, smallest normal, max finite, ones.
SPECIAL_BF16 = [
    0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FA5, 0xFFD3, 0x7FFF,
    0xFFFF, 0x0001, 0x8001, 0x0055, 0x807F, 0x0080, 0x8080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80,
]
SPECIAL_F32 = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
    0xFF800001, 0x7FA5A5A5, 0xFFC12345, 0x7FFFFFFF, 0xFFFFFFFF, 0x00000001, 0x80000001,
    0x007FFFFF, 0x807FFFFF, 0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000,
    0xBF800000,
]
SPECIAL = {jnp.bfloat16: SPECIAL_BF16, jnp.float32: SPECIAL_F32}


def bits_of(x) -> np.ndarray:
    return np.asarray(bitfields.to_bits(x))


def adversarial_bits(dtype, n: int, seed: int = 0) -> np.ndarray:
    """Specials first (all of them once n is large enough), then random words, with
    ``bitdata``'s special words (NaN payloads, infs, signed zeros, subnormals) sprinkled in."""
    word = WORDS[dtype]
    rng = np.random.default_rng(seed)
    out = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    special = np.concatenate([np.asarray(SPECIAL[dtype], dtype=word),
                              bitdata.special_words(np.dtype(dtype))])
    k = min(n, len(special))
    out[:k] = special[:k]
    if n > 2 * len(special):  # sprinkle specials through the rest, so every block sees some
        idx = rng.integers(0, n, n // 8)
        out[idx] = special[rng.integers(0, len(special), idx.size)]
    return out


def make_x(bits: np.ndarray, dtype, shape=None) -> jax.Array:
    bits = bits if shape is None else bits.reshape(shape)
    return lax.bitcast_convert_type(jnp.asarray(bits), dtype)


def make_cache(x, mode: str, seed: int = 1) -> jax.Array:
    exp = np.asarray(bitfields.exponent(x))
    if mode == "same":
        return jnp.asarray(exp)
    if mode == "all_changed":
        return jnp.asarray(exp ^ np.uint8(0xFF))
    rng = np.random.default_rng(seed)
    cache = exp.copy()
    flip = rng.random(exp.shape) < 0.1
    cache[flip] = rng.integers(0, 256, int(flip.sum()), dtype=np.uint8)
    return jnp.asarray(cache)


def assert_encode_equal(got, want, x):
    exp, payload, changed = got
    exp_r, payload_r, changed_r = want
    P = bitfields.word_format(x.dtype).payload_bytes
    assert exp.dtype == jnp.uint8 and exp.shape == x.shape
    assert payload.dtype == jnp.uint8 and payload.shape == (P, *x.shape)
    assert changed.dtype == jnp.bool_ and changed.shape == x.shape
    np.testing.assert_array_equal(np.asarray(exp), np.asarray(exp_r))
    np.testing.assert_array_equal(np.asarray(payload), np.asarray(payload_r))
    np.testing.assert_array_equal(np.asarray(changed), np.asarray(changed_r))


def check_roundtrip(x, cache, backend=None, impl=None, **kw):
    """Encode and decode with the kernel (``backend``, interpreted off-GPU) or through the
    dispatch (``impl``); both must equal the jnp references, and decode must return ``x``."""
    if impl is not None:
        got = K.encode(x, cache, impl=impl)
    else:
        got = K.encode_pallas(x, cache, backend=backend, interpret=not ON_GPU, **kw)
    want = K.encode_reference(x, cache)
    assert_encode_equal(got, want, x)
    exp, payload, _ = want
    if impl is not None:
        y = K.decode(exp, payload, x.dtype, impl=impl)
    else:
        y = K.decode_pallas(exp, payload, x.dtype, backend=backend, interpret=not ON_GPU, **kw)
    y_ref = K.decode_reference(exp, payload, x.dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(bits_of(y), bits_of(y_ref))
    np.testing.assert_array_equal(bits_of(y), bits_of(x))  # lossless, every bit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("n", [7, 3 * BLOCK + 5])
def test_kernels_match_reference_1d(n, dtype, backend):
    x = make_x(adversarial_bits(dtype, n, seed=n), dtype)
    check_roundtrip(x, make_cache(x, "random"), backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_large_non_multiple_of_block(dtype):
    """Many programs and a ragged last block, on the backend ``impl="pallas"`` picks."""
    n = 2**18 + 17
    x = make_x(adversarial_bits(dtype, n, seed=3), dtype)
    check_roundtrip(x, make_cache(x, "random"), impl="pallas")


@pytest.mark.parametrize("backend", BACKENDS)
def test_changed_flags(backend):
    dtype = jnp.bfloat16
    x = make_x(adversarial_bits(dtype, 2 * BLOCK + 3, seed=7), dtype)
    for mode in ("same", "all_changed", "random"):
        cache = make_cache(x, mode)
        got = K.encode_pallas(x, cache, backend=backend, interpret=not ON_GPU)
        assert_encode_equal(got, K.encode_reference(x, cache), x)
        if mode == "same":
            assert not np.asarray(got[2]).any()
        elif mode == "all_changed":
            assert np.asarray(got[2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("shape", [(), (2, 3, 683)])
def test_shapes_rank_0_to_3(shape, dtype, backend):
    n = int(np.prod(shape))
    x = make_x(adversarial_bits(dtype, n, seed=n), dtype, shape)
    check_roundtrip(x, make_cache(x, "random"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("block", [128])
def test_small_blocks_many_programs(dtype, block, backend):
    """Blocks down to one warpgroup (Mosaic GPU then uses shorter vectors per thread)."""
    x = make_x(adversarial_bits(dtype, 5 * block + 3, seed=block), dtype, (5 * block + 3,))
    check_roundtrip(x, make_cache(x, "random"), backend, block=block)


def test_block_errors():
    x = jnp.zeros((512,), jnp.bfloat16)
    c = jnp.zeros((512,), jnp.uint8)
    with pytest.raises(ValueError, match="power of two"):
        K.encode_pallas(x, c, block=96, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="warpgroup"):
        K.encode_pallas(x, c, block=64, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="unknown Pallas backend"):
        K.encode_pallas(x, c, backend="cuda")


def test_empty():
    for dtype in DTYPES:
        x = jnp.zeros((0, 3), dtype)
        cache = jnp.zeros((0, 3), jnp.uint8)
        for impl in ("xla", "pallas", "mosaic", "triton"):
            exp, payload, changed = K.encode(x, cache, impl=impl)
            assert exp.shape == (0, 3) and changed.shape == (0, 3)
            assert payload.shape == (bitfields.word_format(dtype).payload_bytes, 0, 3)
            assert K.decode(exp, payload, dtype, impl=impl).shape == (0, 3)


@pytest.mark.parametrize("impl", ["pallas", "triton"])
def test_dispatch_under_jit(impl):
    dtype = jnp.bfloat16
    x = make_x(adversarial_bits(dtype, BLOCK + 9, seed=11), dtype)
    cache = make_cache(x, "random")
    enc = jax.jit(K.encode, static_argnames="impl")
    dec = jax.jit(K.decode, static_argnames=("dtype", "impl"))
    got = enc(x, cache, impl=impl)
    assert_encode_equal(got, K.encode_reference(x, cache), x)
    y = dec(got[0], got[1], dtype=x.dtype, impl=impl)
    np.testing.assert_array_equal(bits_of(y), bits_of(x))


@settings(max_examples=4, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(K.available_backends()),
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**32 - 1),
    cache_mode=st.sampled_from(["same", "all_changed", "random"]),
)
def test_property_adversarial_bits(dtype, backend, shape, seed, cache_mode):
    x = jnp.asarray(bitdata.adversarial(np.random.default_rng(seed), shape, np.dtype(dtype)))
    x = make_x(bitdata.bits_of(x), dtype)  # the same words, built from bits (no bf16 copy)
    check_roundtrip(x, make_cache(x, cache_mode, seed=seed % 1000), backend)


def test_bogus_impl_raises():
    x = jnp.zeros((4,), jnp.bfloat16)
    cache = jnp.zeros((4,), jnp.uint8)
    with pytest.raises(ValueError, match="unknown codec impl"):
        K.encode(x, cache, impl="bogus")
    exp, payload, _ = K.encode_reference(x, cache)
    with pytest.raises(ValueError, match="unknown codec impl"):
        K.decode(exp, payload, jnp.bfloat16, impl="bogus")


def test_shape_errors():
    x = jnp.zeros((4,), jnp.float32)
    with pytest.raises(ValueError):
        K.encode(x, jnp.zeros((5,), jnp.uint8), impl="xla")
    with pytest.raises(ValueError):
        K.decode_pallas(jnp.zeros((4,), jnp.uint8), jnp.zeros((1, 4), jnp.uint8), jnp.float32)
    with pytest.raises(TypeError):
        K.encode(jnp.zeros((4,), jnp.float16), jnp.zeros((4,), jnp.uint8), impl="pallas")


def test_dispatch_resolution():
    """The table in kernels/backend.py: here, and as on Hopper, Blackwell and Ampere."""
    from ciera_jax.kernels.backend import Choice

    if not ON_GPU:
        assert K.resolve("auto") == Choice("xla")
        # the interpreter that also runs inside a multi-device shard_map (backend.py's note)
        assert K.resolve("pallas") == Choice("pallas", "triton", interpret=True)
        assert K.resolve("mosaic") == Choice("pallas", "mosaic", interpret=True)
        assert K.resolve("triton") == Choice("pallas", "triton", interpret=True)
        assert K.resolve_impl("pallas") == ("pallas", True)
    assert K.resolve("xla") == Choice("xla")
    for cc in ("9.0", "10.0", (12, 0)):
        with K.lowering_for("cuda", capability=cc):
            assert K.resolve("auto") == Choice("pallas", "mosaic")
            assert K.resolve("pallas") == Choice("pallas", "mosaic")
            assert K.resolve("triton") == Choice("pallas", "triton")
            assert K.gpu_capability() >= (9, 0)
    with K.lowering_for("cuda", capability="8.0"):  # Ampere: jnp by default, Triton on request
        assert K.resolve("auto") == Choice("xla")
        assert K.resolve("pallas") == Choice("pallas", "triton")
        assert K.resolve("mosaic") == Choice("pallas", "mosaic")
    with pytest.raises(ValueError):
        with K.lowering_for("tpu"):
            pass

"""The fused decode + per-rank checksum kernel vs ``codec.merge`` + ``checksum.checksum_shards``
(bit for bit, both Pallas backends, interpreted on CPU), and the dispatch's unfused fallback."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ciera_jax.codec import checksum, bitfields
from ciera_jax.codec.layout import full_to_rows
from ciera_jax import kernels as K
from test_kernels import BACKENDS, ON_GPU, WORDS, adversarial_bits, bits_of, make_x

N = 8


def split_of(dtype, shape, seed=0):
    x = make_x(adversarial_bits(dtype, int(np.prod(shape)), seed=seed), dtype, shape)
    exp, payload = bitfields.split(x)
    return x, exp, payload


# (shape, how the bf16 pairing goes): pairs along the last dim, along the shard axis, none.
# (shape, gather axis, how the bf16 pairing goes): pairs along the last dim, along the shard
# axis, none; off axis 0 within the rows after the gather axis.
SHAPES = [((N * 4, 1024), 0, "last dim"), ((N * 512, 3), 0, "shard axis"),
          ((N * 2, 256 * 3), 0, "last dim, 3 blocks a row"),
          ((3, N * 2, 512), 1, "axis 1"), ((2, 3, N, 2, 256), 2, "axis 2 of 5")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(WORDS), ids=["bf16", "f32"])
@pytest.mark.parametrize("shape,axis", [s[:2] for s in SHAPES], ids=[s[2] for s in SHAPES])
def test_fused_matches_reference(shape, axis, dtype, backend):
    x, exp, payload = split_of(dtype, shape, seed=len(shape) + shape[-1])
    assert K.fusable(shape, dtype, N, axis=axis) is not None
    full, sums = K.decode_checksum_pallas(exp, payload, dtype, N, axis=axis, seed=11,
                                          backend=backend, interpret=not ON_GPU)
    full_ref, sums_ref = K.decode_checksum_reference(exp, payload, dtype, N, axis=axis, seed=11)
    np.testing.assert_array_equal(bits_of(full), bits_of(x))
    np.testing.assert_array_equal(bits_of(full), bits_of(full_ref))
    np.testing.assert_array_equal(np.asarray(sums), np.asarray(sums_ref))
    # and what each sender would have sent for its own shard
    shards = np.split(bits_of(x), N, axis=axis)
    want = [checksum.checksum_np(s, r * s.size, axis=axis, seed=11)
            for r, s in enumerate(shards)]
    np.testing.assert_array_equal(np.asarray(sums), np.asarray(want, np.uint32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(WORDS), ids=["bf16", "f32"])
@pytest.mark.parametrize("shape,axis", [s[:2] for s in SHAPES], ids=[s[2] for s in SHAPES])
def test_payload_read_in_rank_rows(shape, axis, dtype, backend):
    """The payload as it arrives (rank rows, N x P x n) gives the same words and sums as the
    payload moved to the full layout."""
    x, exp, payload = split_of(dtype, shape, seed=len(shape) + shape[-1] + 1)
    shard_shape = list(shape)
    shard_shape[axis] //= N
    P_ = payload.shape[0]
    rows = jnp.stack([full_to_rows(payload[k], tuple(shard_shape), axis, N)
                      for k in range(P_)], axis=1)  # (N, P, n)
    full, sums = K.decode_checksum_pallas(exp, rows, dtype, N, axis=axis, seed=11,
                                          backend=backend, interpret=not ON_GPU,
                                          payload_rows=True)
    full_ref, sums_ref = K.decode_checksum_reference(exp, payload, dtype, N, axis=axis, seed=11)
    np.testing.assert_array_equal(bits_of(full), bits_of(full_ref))
    np.testing.assert_array_equal(bits_of(full), bits_of(x))
    np.testing.assert_array_equal(np.asarray(sums), np.asarray(sums_ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(WORDS), ids=["bf16", "f32"])
@pytest.mark.parametrize("shape,axis", [s[:2] for s in SHAPES if s[1]], ids=[s[2] for s in SHAPES
                                                                             if s[1]])
def test_payload_read_in_wire_rows(shape, axis, dtype, backend):
    """The payload planes at the head of each wire row (N, L), other bytes behind them up to
    a multiple of row_align: the same words and sums, and nothing behind the planes read."""
    x, exp, payload = split_of(dtype, shape, seed=len(shape) + shape[-1] + 2)
    shard_shape = list(shape)
    shard_shape[axis] //= N
    P_ = payload.shape[0]
    planes = jnp.concatenate([full_to_rows(payload[k], tuple(shard_shape), axis, N)
                              for k in range(P_)], axis=1)  # (N, P * n)
    align = K.row_align(shape, dtype, N, axis=axis, impl="pallas")
    assert align and planes.shape[1] % align == 0
    tail = jnp.full((N, 2 * align - 5), 0xA5, jnp.uint8)  # a section, a checksum, padding
    rows = jnp.concatenate([planes, tail, jnp.zeros((N, 5), jnp.uint8)], axis=1)
    full, sums = K.decode_checksum_pallas(exp, rows, dtype, N, axis=axis, seed=11,
                                          backend=backend, interpret=not ON_GPU,
                                          payload_rows=True)
    full_ref, sums_ref = K.decode_checksum_reference(exp, payload, dtype, N, axis=axis, seed=11)
    np.testing.assert_array_equal(bits_of(full), bits_of(x))
    np.testing.assert_array_equal(np.asarray(sums), np.asarray(sums_ref))
    with pytest.raises(ValueError, match="a multiple of"):
        K.decode_checksum_pallas(exp, rows[:, 1:], dtype, N, axis=axis, backend=backend,
                                 interpret=not ON_GPU, payload_rows=True)


def test_rows_are_aligned_only_where_the_fused_decode_reads_them():
    assert K.row_align((3, N * 2, 512), jnp.bfloat16, N, axis=1, impl="pallas") == 512
    assert K.row_align((3, N * 2, 512), jnp.bfloat16, N, axis=1, impl="xla") == 0
    assert K.row_align((N * 4, 1024), jnp.bfloat16, N, axis=0, impl="pallas") == 0


def test_a_flipped_bit_changes_only_its_rank():
    dtype, shape = jnp.bfloat16, (N * 4, 1024)
    _, exp, payload = split_of(dtype, shape)
    _, clean = K.decode_checksum(exp, payload, dtype, N, impl="pallas")
    payload = payload.at[0, 3 * 4 + 1, 77].set(payload[0, 3 * 4 + 1, 77] ^ 1)  # rank 3's shard
    _, dirty = K.decode_checksum(exp, payload, dtype, N, impl="pallas")
    assert (np.asarray(clean) != np.asarray(dirty)).tolist() == [r == 3 for r in range(N)]


@pytest.mark.parametrize("shape,axis", [((N * 3, 5), 0), ((4, N * 256), 1)])
def test_unfusable_shapes_fall_back(shape, axis):
    """Odd sizes, and rows after the gather axis too short for a block: the dispatch decodes,
    then checksums in jnp."""
    for dtype in WORDS:
        x, exp, payload = split_of(dtype, shape)
        assert K.fusable(shape, dtype, N, axis=axis) is None
        with pytest.raises(ValueError, match="fused blocks"):
            K.decode_checksum_pallas(exp, payload, dtype, N, axis=axis, interpret=True)
        for impl in ("pallas", "xla"):
            full, sums = K.decode_checksum(exp, payload, dtype, N, axis=axis, impl=impl)
            np.testing.assert_array_equal(bits_of(full), bits_of(x))
            np.testing.assert_array_equal(np.asarray(sums),
                                          np.asarray(checksum.checksum_shards(x, axis, N)))

"""The gather checksum: matches its NumPy reference, catches every single-bit error and random
corruptions, locates each rank's shard in a rebuilt tensor, and runs in shard_map, jit and
Pallas (interpret mode on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from bitdata import BF16, F32, adversarial, bits_of, from_bits
from ciera_jax.codec.checksum import checksum, checksum_np, checksum_shards
from ciera_jax.runtime.devices import make_mesh

DTYPES = [BF16, F32]
# One compiled program per call instead of one per primitive: keeps the tests quick.
jit_checksum = jax.jit(checksum, static_argnames=("axis", "seed"))
jit_checksum_shards = jax.jit(checksum_shards, static_argnums=(1, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("shape, axis", [((4, 8, 6), 0), ((4, 8, 6), 1), ((4, 8, 6), 2),
                                         ((2, 8, 5), 0), ((2, 8, 5), 1), ((3, 5, 4), 2)])
def test_matches_reference_and_each_rank_shard(dtype, shape, axis):
    """Shapes cover 2-byte words paired on the last dim, on the shard axis, and unpaired."""
    rng = np.random.default_rng(axis)
    full = adversarial(rng, shape, dtype)
    n_ranks = 2
    got = np.asarray(jit_checksum_shards(jnp.asarray(full), axis, n_ranks))
    assert got.dtype == np.uint32 and got.shape == (n_ranks,)
    for r, shard in enumerate(np.split(full, n_ranks, axis=axis)):
        want = checksum_np(shard, r * shard.size, axis=axis)
        assert int(jit_checksum(jnp.asarray(shard), r * shard.size, axis=axis)) == want
        assert int(got[r]) == want
    assert int(jit_checksum(jnp.asarray(full), axis=axis)) == checksum_np(full, axis=axis)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_every_single_bit_flip_changes_the_checksum(dtype):
    """Exhaustive over a 64-element shard: 64 x 16 (bf16) or 64 x 32 (f32) flipped copies."""
    rng = np.random.default_rng(1)
    shard = adversarial(rng, (64,), dtype)
    bits = bits_of(shard)
    nbits = bits.dtype.itemsize * 8
    masks = (np.ones((), bits.dtype) << np.arange(nbits, dtype=bits.dtype))  # [B]
    onehot = np.eye(shard.size, dtype=bool)  # [E, E]
    flipped = bits[None, None] ^ np.where(onehot[:, None], masks[None, :, None], 0).astype(
        bits.dtype)  # [E, B, E]
    variants = from_bits(flipped.reshape(-1, shard.size), dtype)
    sums = np.asarray(jax.jit(jax.vmap(lambda w: checksum(w, 640)))(jnp.asarray(variants)))
    base = int(jit_checksum(jnp.asarray(shard), 640))
    assert sums.shape == (shard.size * nbits,)
    assert not np.any(sums == base)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_random_multi_element_corruptions_are_caught(dtype):
    rng = np.random.default_rng(2)
    shard = adversarial(rng, (256,), dtype)
    bits = bits_of(shard)
    variants = np.repeat(bits[None], 2000, axis=0)
    for v in variants:
        k = rng.integers(2, 9)
        pos = rng.choice(shard.size, size=k, replace=False)
        v[pos] ^= rng.integers(1, np.iinfo(bits.dtype).max, size=k, dtype=bits.dtype,
                               endpoint=True)
    sums = np.asarray(jax.jit(jax.vmap(lambda w: checksum(w, 0)))(
        jnp.asarray(from_bits(variants, dtype))))
    assert not np.any(sums == int(jit_checksum(jnp.asarray(shard), 0)))


def test_moved_words_and_swapped_shards_are_caught():
    rng = np.random.default_rng(3)
    full = adversarial(rng, (8, 16), BF16)
    ok = np.asarray(jit_checksum_shards(jnp.asarray(full), 0, 4))
    swapped = full.copy()
    swapped[[0, 1]] = full[[1, 0]]  # two rows inside rank 0's shard trade places
    assert np.asarray(jit_checksum_shards(jnp.asarray(swapped), 0, 4))[0] != ok[0]
    ranks = np.concatenate([full[2:4], full[0:2], full[4:]])  # ranks 0 and 1 trade shards
    got = np.asarray(jit_checksum_shards(jnp.asarray(ranks), 0, 4))
    assert got[0] != ok[0] and got[1] != ok[1] and np.array_equal(got[2:], ok[2:])


def test_seed_changes_the_sum():
    x = jnp.arange(32, dtype=jnp.uint32)
    assert int(jit_checksum(x, seed=1)) != int(jit_checksum(x, seed=0))


def test_gather_check_inside_shard_map_finds_the_corrupt_rank():
    """Each rank sends checksum(shard, rank * size); every receiver checks its rebuilt tensor.
    Rank 5 corrupts one bit of its copy after the gather: only rank 5 sees a mismatch, for
    the shard it corrupted."""
    mesh = make_mesh(8)
    full = adversarial(np.random.default_rng(4), (16, 24), BF16)

    def body(x):
        me = lax.axis_index("fsdp")
        sent = checksum(x, me * x.size, axis=1)
        sums_R = lax.all_gather(sent, "fsdp")
        bits = lax.all_gather(lax.bitcast_convert_type(x, jnp.uint16), "fsdp", axis=1,
                              tiled=True)
        bits = bits.at[3, 7].set(jnp.where(me == 5, bits[3, 7] ^ 0x0100, bits[3, 7]))
        got_R = checksum_shards(bits, 1, 8)
        return (got_R != sums_R)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "fsdp"), out_specs=P("fsdp")))
    bad = np.asarray(f(jnp.asarray(full)))  # [receiver, shard]
    want = np.zeros((8, 8), bool)
    want[5, 7 // 3] = True  # column 7 lies in rank 2's shard (3 columns each)
    assert np.array_equal(bad, want)


def test_runs_in_a_pallas_kernel():
    x = adversarial(np.random.default_rng(5), (8, 128), BF16)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.broadcast_to(checksum(x_ref[...], 1024), o_ref.shape)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.uint32),
                         interpret=True)(jnp.asarray(x))
    assert int(np.asarray(out)[0, 0]) == checksum_np(x, 1024)


def test_bad_input_names_the_tensor_and_the_fix():
    with pytest.raises(TypeError, match="checksum of shard: dtype bool"):
        checksum(jnp.zeros((4,), bool))
    with pytest.raises(ValueError, match="does not split into 3 ranks"):
        checksum_shards(jnp.zeros((8, 4), jnp.bfloat16), 0, 3)
    with pytest.raises(ValueError, match="scalar"):
        checksum(jnp.zeros((), jnp.float32))
    with pytest.raises(ValueError, match="axis 2 out of range"):
        checksum(jnp.zeros((4, 4), jnp.float32), axis=2)

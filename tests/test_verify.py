"""The gather checks itself: a corrupted cache or payload on one rank is caught in the gather
where it matters, in exponent and word mode, and a reset cache re-primes bitwise."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.collective import heal
from ciera_models.resilience import corrupt as faults
from bitdata import BF16, adversarial, bits_of, churn, from_bits, moved, weights, word_deltas
from harness import mesh_of

SHAPE = (64, 128)
N = 8
BAD_RANK = 3


def _per_rank(tree):
    return jax.tree.map(lambda v: jnp.asarray(v)[None], tree)


@functools.lru_cache(maxsize=None)
def _gather(mode: str):
    """(x, cache) -> (full per rank, new cache, stats per rank)."""
    mesh = mesh_of((N,), ("fsdp",))

    def body(x, cache):
        full, new_cache, st = ciera_jax.all_gather(x, cache, "fsdp")
        return full[None], new_cache, _per_rank(st)

    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                                       out_specs=(P("fsdp"), P(), P("fsdp")), check_vma=False))


@functools.lru_cache(maxsize=None)
def _gather_corrupt_wire():
    """Like :func:`_gather` (exponent mode), but rank BAD_RANK's payload is corrupted after
    encode, before it goes on the wire."""
    mesh = mesh_of((N,), ("fsdp",))

    def body(x, cache):
        e = ciera_jax.encode(x, cache, "fsdp")
        hit = lax.axis_index("fsdp") == BAD_RANK
        flat = e.payload.reshape(-1)
        flat = flat.at[7].set(jnp.where(hit, flat[7] ^ jnp.uint8(0x10), flat[7]))
        e = dataclasses.replace(e, payload=flat.reshape(e.payload.shape))
        full, new_cache, st = ciera_jax.exchange(x, e, cache, ciera_jax.agree(e, "fsdp"), "fsdp")
        return full[None], new_cache, _per_rank(st)

    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                                       out_specs=(P("fsdp"), P(), P("fsdp")), check_vma=False))


def _run(fn_mesh, x, cache):
    mesh, fn = fn_mesh
    x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("fsdp")))
    cache = jax.device_put(cache, NamedSharding(mesh, P()))
    full, new_cache, st = fn(x, cache)
    return np.asarray(full).reshape((N,) + SHAPE), new_cache, jax.tree.map(np.asarray, st)


def next_step(rng, x, mode, flip_signs=0.0):
    """Training-like churn for the mode: 1% of exponents change (exponent mode), or words move
    a few ulps with a tail of far moves (word mode), both with optional sign flips."""
    if mode == "exponent":
        return churn(rng, x, 0.01, flip_signs=flip_signs)
    bits = bits_of(moved(x, word_deltas(rng, x.shape)))
    bits = np.where(rng.random(x.shape) < flip_signs, bits ^ np.uint16(0x8000), bits)
    return from_bits(bits, x.dtype)


def _primed(mode, x):
    _, cache, st = _run(_gather(mode), x, ciera_jax.init_cache(SHAPE, BF16, mode=mode))
    assert (st["mode"] == 0).all() and (st["verify_failed"] == 0).all()
    return cache


def _device(rank):
    return mesh_of((N,), ("fsdp",)).devices.flat[rank]


def _check_only_bad_rank_failed(full, st, x):
    assert st["verify_failed"][BAD_RANK] >= 1, st["verify_failed"]
    others = [r for r in range(N) if r != BAD_RANK]
    assert (st["verify_failed"][others] == 0).all(), st["verify_failed"]
    for r in others:
        np.testing.assert_array_equal(bits_of(full[r]), bits_of(x))
    assert not np.array_equal(bits_of(full[BAD_RANK]), bits_of(x)), "the fault had no effect"


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_clean_gathers_never_fail(mode):
    rng = np.random.default_rng(0)
    x = adversarial(rng, SHAPE, BF16)
    cache = _primed(mode, x)
    for _ in range(3):
        x = next_step(rng, x, mode, flip_signs=0.01)
        full, cache, st = _run(_gather(mode), x, cache)
        assert (st["mode"] != 0).all() and (st["verify_failed"] == 0).all(), st
        for r in range(N):
            np.testing.assert_array_equal(bits_of(full[r]), bits_of(x))


def _exponent_bit(cache, x, rank_of_element):
    """Flip an exponent bit of an element of rank ``rank_of_element``'s shard, on BAD_RANK's
    copy: the element's exponent is taken from the cache in the next gather."""
    flat = SHAPE[1]
    pos = rank_of_element * (SHAPE[0] // N) * flat + 5

    def fn(a):
        a = a.reshape(-1).copy()
        a[pos] ^= np.asarray(1 << 3, a.dtype) if a.dtype == np.uint8 else np.asarray(1 << 10,
                                                                                       a.dtype)
        return a.reshape(SHAPE)

    return faults.corrupt_cache(cache, _device(BAD_RANK), fn)


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_one_flipped_cache_bit_is_caught_on_that_rank(mode):
    rng = np.random.default_rng(1)
    x = weights(rng, SHAPE, BF16)
    cache = _exponent_bit(_primed(mode, x), x, 0)  # in rank 0's part of BAD_RANK's copy
    full, _, st = _run(_gather(mode), x, cache)  # nothing changed: all from the cache
    _check_only_bad_rank_failed(full, st, x)


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_a_flipped_bit_in_the_ranks_own_part_is_repaired_by_its_encode(mode):
    """A rank encodes its shard against its own slice of the cache: a corrupted entry there
    looks like a change and travels as a patch / escape, so every rank rebuilds it right."""
    rng = np.random.default_rng(1)
    x = weights(rng, SHAPE, BF16)
    cache = _exponent_bit(_primed(mode, x), x, BAD_RANK)
    full, new_cache, st = _run(_gather(mode), x, cache)
    assert (st["verify_failed"] == 0).all() and (st["changed"][BAD_RANK] >= 1)
    for r in range(N):
        np.testing.assert_array_equal(bits_of(full[r]), bits_of(x))


def _zero_others_parts(a):
    """Zero every entry outside BAD_RANK's own slice (rows of the gather axis)."""
    rows = SHAPE[0] // N
    out = np.zeros_like(a)
    out[BAD_RANK * rows:(BAD_RANK + 1) * rows] = a[BAD_RANK * rows:(BAD_RANK + 1) * rows]
    return out


def _outside_own_slice(fn):
    """``fn`` applied to every part of a cache but BAD_RANK's own slice (which it encodes
    against)."""
    rows = SHAPE[0] // N
    own = slice(BAD_RANK * rows, (BAD_RANK + 1) * rows)

    def apply(a):
        out = np.array(fn(a))
        out[own] = a[own]
        return out

    return apply


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_random_flips_zeroed_and_stale_caches_are_caught(mode):
    rng = np.random.default_rng(2)
    x0 = weights(rng, SHAPE, BF16)
    x1 = next_step(rng, x0, mode)
    x2 = next_step(rng, x1, mode)
    cache0 = _primed(mode, x0)
    _, cache1, _ = _run(_gather(mode), x1, cache0)
    bad = _device(BAD_RANK)
    flips = np.random.default_rng(3)
    stale = np.asarray(getattr(cache0, faults.cache_data(cache0)))
    for damage in (lambda a: faults.flip_bits(a, flips, 40),
                   _zero_others_parts,
                   lambda a: stale):  # a cache from an older step, restored on one rank only
        broken = faults.corrupt_cache(cache1, bad, _outside_own_slice(damage))
        full, _, st = _run(_gather(mode), x2, broken)
        _check_only_bad_rank_failed(full, st, x2)


def test_word_mode_damage_in_the_senders_own_slice_fails_on_every_rank():
    """A word-mode sender encodes its moves against its own slice of the cache: damage there
    corrupts what it sends, so every rank fails that shard (the trainer then resets every
    cache, and the next gather re-primes them all). Exponent mode sends the true exponent of
    every element whose cached one differs, so damage there stays harmless."""
    rng = np.random.default_rng(9)
    x0 = weights(rng, SHAPE, BF16)
    x1 = next_step(rng, x0, "word")
    cache = _primed("word", x0)
    rows = SHAPE[0] // N
    own = BAD_RANK * rows * SHAPE[1] + 17  # an element in BAD_RANK's own slice

    def damage(a):
        a = a.copy()
        a.reshape(-1)[own] ^= np.uint16(1 << 3)
        return a

    full, cache1, st = _run(_gather("word"), x1, faults.corrupt_cache(cache, _device(BAD_RANK),
                                                                      damage))
    others = [r for r in range(N) if r != BAD_RANK]
    # The sender's own copy cancels its wrong move; every other rank fails that one shard.
    assert (st["verify_failed"][others] == 1).all() and st["verify_failed"][BAD_RANK] == 0, \
        st["verify_failed"]
    healed = heal.reset_failed(cache1, jnp.int32(1))
    full, _, st = _run(_gather("word"), next_step(rng, x1, "word"), healed)
    assert (st["mode"] == 0).all() and (st["verify_failed"] == 0).all()


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_a_wholly_zeroed_cache_falls_back_to_a_plain_gather(mode):
    """Zeroed everywhere, the rank's own slice says every element changed: the agreement
    takes the plain gather, which is exact and re-primes every cache."""
    rng = np.random.default_rng(6)
    x = weights(rng, SHAPE, BF16)
    cache = faults.corrupt_cache(_primed(mode, x), _device(BAD_RANK), np.zeros_like)
    full, _, st = _run(_gather(mode), x, cache)
    assert (st["mode"] == 0).all() and (st["verify_failed"] == 0).all()
    for r in range(N):
        np.testing.assert_array_equal(bits_of(full[r]), bits_of(x))


def test_a_corrupted_payload_is_caught_by_every_receiver():
    rng = np.random.default_rng(4)
    x = weights(rng, SHAPE, BF16)
    cache = _primed("exponent", x)
    full, _, st = _run(_gather_corrupt_wire(), x, cache)
    assert (st["verify_failed"] == 1).all(), st["verify_failed"]  # rank 3's shard, everywhere
    assert not any(np.array_equal(bits_of(full[r]), bits_of(x)) for r in range(N))


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_reset_failed_cache_reprimes_bitwise(mode):
    rng = np.random.default_rng(5)
    x = weights(rng, SHAPE, BF16)
    cache = _exponent_bit(_primed(mode, x), x, 0)
    _, _, st = _run(_gather(mode), x, cache)
    failed = int(st["verify_failed"].sum())
    assert failed >= 1
    healed = heal.reset_failed(cache, failed)
    full, new_cache, st = _run(_gather(mode), x, healed)
    assert (st["mode"] == 0).all() and (st["verify_failed"] == 0).all()  # a priming gather
    for r in range(N):
        np.testing.assert_array_equal(bits_of(full[r]), bits_of(x))
    full, _, st = _run(_gather(mode), x, new_cache)
    assert (st["mode"] != 0).all() and (st["verify_failed"] == 0).all()
    assert heal.reset_failed(new_cache, 0).primed


def test_keep_if_failed_keeps_the_old_state():
    old, new = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
    assert (heal.keep_if_failed(jnp.int32(1), old, new)["w"] == 0).all()
    assert (heal.keep_if_failed(jnp.int32(0), old, new)["w"] == 1).all()

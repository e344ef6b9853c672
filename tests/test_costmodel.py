"""The cost model prices what the gathers send: its wire bytes equal the ``sent_bytes`` the
gathers report (and, for int8, the bytes of the arrays the all-gathers carry), for plain, int8,
every exponent-mode rung and word-mode rung, on 8 emulated devices."""

import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.collective import quantized
from ciera_jax.codec.wire import (DEFAULT_CODE_BITS, INT8_SCALE_BYTES, ExponentWire, WordWire,
                                  agreement_bytes, int8_wire_bytes)
from ciera_jax.codec.word_ladder import code_limit

N = 8
ROWS, COLS = N * 512, 8  # 4096 elements per rank
N_LOCAL = ROWS * COLS // N
LINK = links.Profile("test", alpha_s=1e-6, beta_Bps=1e9, codec_Bps=1e9, agreement_s=1e-6)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("fsdp",))


@functools.lru_cache(maxsize=None)
def _step(mesh):
    def body(w, cache):
        full, cache, stats = ciera_jax.all_gather(w, cache, "fsdp")
        return full[None], cache, jax.tree.map(lambda v: v[None], stats)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                                 out_specs=(P("fsdp"), P(), P("fsdp"))))


def _gather(mesh, w, cache):
    full, cache, stats = _step(mesh)(jax.device_put(w, NamedSharding(mesh, P("fsdp"))), cache)
    np.testing.assert_array_equal(np.asarray(full)[0].view(np.uint16), w.view(np.uint16))
    return cache, jax.tree.map(np.asarray, stats)


def _base():
    rng = np.random.default_rng(0)
    # magnitudes in [1, 2): every exponent the same, room to move each word
    return (1.0 + rng.random((ROWS, COLS), dtype=np.float32) * 0.5).astype(ml_dtypes.bfloat16)


def _with_exponent_changes(w, k):
    """``w`` with the exponent of ``k`` random elements of every rank's shard changed."""
    bits = w.view(np.uint16).reshape(N, -1).copy()
    rng = np.random.default_rng(k)
    for r in range(N):
        bits[r, rng.choice(N_LOCAL, k, replace=False)] += 1 << 7
    return bits.reshape(w.shape).view(w.dtype)


def test_plain_priced_as_sent(mesh):
    w = _base()
    cache = ciera_jax.init_cache(w.shape, w.dtype)
    _, stats = _gather(mesh, w, cache)  # unprimed: the plain fallback (and the checksum)
    fallback = ExponentWire(N_LOCAL, 2).fallback_bytes
    assert np.all(stats["sent_bytes"] == fallback + agreement_bytes("exponent"))
    assert fallback == N_LOCAL * 2 + 4
    assert cm.gather_cost("plain", w.size, N, 2, LINK).wire_bytes == N * N_LOCAL * 2


@pytest.mark.parametrize("k", [0, 1, 3, 16, 100, 400, 1000, 1100, 3000])
def test_exponent_rungs_priced_as_sent(mesh, k):
    """Changes at random places, from none through every rung to above the top (fallback): the
    gather sends what the wire table says for the worst rank, and the cost model prices the
    same table."""
    w = _base()
    cache, _ = _gather(mesh, w, ciera_jax.init_cache(w.shape, w.dtype))  # prime
    _, stats = _gather(mesh, _with_exponent_changes(w, k), cache)
    assert np.all(stats["changed"] == k)
    wire = ExponentWire(N_LOCAL, 2)
    assert np.all(stats["sent_bytes"] == wire.sent_bytes(k) + agreement_bytes("exponent"))
    c = cm.gather_cost("ciera", w.size, N, 2, LINK, change_rate=k / N_LOCAL)
    assert c.fallback == bool(stats["fallback"][0])
    assert c.wire_bytes == N * wire.sent_bytes(k)


@pytest.mark.parametrize("n_local", [256, 1000, 4096])
def test_int8_priced_as_sent(mesh, n_local):
    """What the int8 gather's all-gathers carry (read off its jaxpr) is what the cost model
    prices and what ``quantized.wire_bytes`` reports: codes in whole blocks + float32 scales."""
    x = jax.ShapeDtypeStruct((N * n_local,), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("fsdp")))
    f = jax.shard_map(lambda s: quantized.int8_all_gather(s, "fsdp"), mesh=mesh,
                      in_specs=P("fsdp"), out_specs=P(), check_vma=False)
    jaxpr = jax.make_jaxpr(f)(x)
    carried = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "all_gather":
                a = eqn.invars[0].aval
                carried.append(math.prod(a.shape) * a.dtype.itemsize)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert len(carried) == 2  # codes and scales
    assert sum(carried) == quantized.wire_bytes(n_local) == int8_wire_bytes(n_local)
    assert cm.gather_cost("int8", N * n_local, N, 2, LINK).wire_bytes == N * sum(carried)
    assert INT8_SCALE_BYTES == np.dtype(quantized.SCALE_DTYPE).itemsize


def _word_moves(w, moves):
    """``w`` with, per rank, ``count`` elements moved by ``d`` ulps for each (d, count)."""
    bits = w.view(np.uint16).reshape(N, -1).copy()
    at = 0
    for d, count in moves:
        bits[:, at:at + count] += d
        at += count
    return bits.reshape(w.shape).view(w.dtype)


def _worst_counts(old, new):
    """The most escapes (|d| above the code limit) and raw words (|d| > 127) of any rank."""
    o = old.view(np.uint16).reshape(N, -1).astype(np.int64)
    n = new.view(np.uint16).reshape(N, -1).astype(np.int64)
    d = np.abs(n - o)  # positive words: ord(w) is the bits
    return (int((d > code_limit(DEFAULT_CODE_BITS)).sum(axis=1).max()),
            int((d > 127).sum(axis=1).max()))


WORD_CASES = [  # (d, count per rank) moves, from small churn to beyond the top rung
    [(1, 400)], [(2, 200)], [(5, 10)], [(5, 120), (200, 4)], [(5, 240), (200, 15)],
    [(9, 250), (200, 16)], [(9, 500), (300, 30)], [(9, 1000), (300, 60)],
    [(9, 1000), (300, 1100)], [(40, 3000)]]


def test_word_rungs_priced_as_sent(mesh):
    """Word caches: whichever rungs the gather picks (or the plain fallback), its sent bytes are
    the wire table's for the worst rank's counts, plus the tensor's counts in the agreement;
    the cost model prices the same table from escape rates."""
    w = _base()
    cache, _ = _gather(mesh, w, ciera_jax.init_cache(w.shape, w.dtype, mode="word"))
    wire, seen = WordWire(N_LOCAL, 2), set()
    for moves in WORD_CASES:
        new = _word_moves(w, moves)
        _, stats = _gather(mesh, new, cache)
        escapes, raw = _worst_counts(w, new)
        assert stats["sent_bytes"][0] == wire.sent_bytes(escapes, raw) + agreement_bytes("word")
        c = cm.gather_cost("word", w.size, N, 2, LINK,
                           word_rates=(escapes / N_LOCAL, raw / N_LOCAL))
        assert c.wire_bytes == N * wire.sent_bytes(escapes, raw)
        assert c.fallback == bool(stats["fallback"][0]), (moves, stats)
        seen.add((int(stats["mode"][0]), int(stats["capacity"][0])))
    assert len({cap for m, cap in seen if m == 2}) >= 5, seen  # many level-1 rungs
    assert any(m == 0 for m, _ in seen), "and the plain fallback"

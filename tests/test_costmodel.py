"""The cost model prices what the gathers send: its wire bytes equal the ``sent_bytes`` the
gathers report (and, for int8, the bytes of the arrays the all-gathers carry), for plain, int8,
every exponent-mode tier and every word-mode option, on 8 emulated devices."""

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
from ciera_jax import costmodel as cm
from ciera_jax import quantized, wordcodec
from ciera_jax.collective import AGREEMENT_BYTES
from ciera_jax.word_ladder import CODE_BITS, WORD_LADDER, code_limit

N = 8
ROWS, COLS = N * 512, 8  # 4096 elements per rank
N_LOCAL = ROWS * COLS // N
LINK = cm.Profile("test", alpha_s=1e-6, beta_Bps=1e9, codec_Bps=1e9, agreement_s=1e-6)


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
    """``w`` with the exponent of the first ``k`` elements of every rank's shard changed."""
    bits = w.view(np.uint16).reshape(N, -1).copy()
    bits[:, :k] += 1 << 7
    return bits.reshape(w.shape).view(w.dtype)


def test_plain_priced_as_sent(mesh):
    w = _base()
    cache = ciera_jax.init_cache(w.shape, w.dtype)
    _, stats = _gather(mesh, w, cache)  # unprimed: a plain gather of the bits
    assert np.all(stats["sent_bytes"] == N_LOCAL * 2 + AGREEMENT_BYTES)
    assert cm.gather_cost("plain", w.size, N, 2, LINK).wire_bytes == N * N_LOCAL * 2


@pytest.mark.parametrize("k", [0, 1, 3, 16, 100, 400, 1000, 2048, 3000])
def test_exponent_tiers_priced_as_sent(mesh, k):
    """One case per tier of the ladder (0, 1, 4, 16, 128 sparse; 512, 1024, 2048 bitmap) and
    one above the top (plain fallback)."""
    w = _base()
    cache, _ = _gather(mesh, w, ciera_jax.init_cache(w.shape, w.dtype))  # prime
    _, stats = _gather(mesh, _with_exponent_changes(w, k), cache)
    assert np.all(stats["changed"] == k)
    c = cm.gather_cost("ciera", w.size, N, 2, LINK, change_rate=k / N_LOCAL)
    assert c.fallback == bool(stats["fallback"][0])
    assert c.wire_bytes == N * (stats["sent_bytes"][0] - AGREEMENT_BYTES), (k, stats)


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
    assert sum(carried) == quantized.wire_bytes(n_local) == cm.int8_wire_bytes(n_local)
    assert cm.gather_cost("int8", N * n_local, N, 2, LINK).wire_bytes == N * sum(carried)
    assert cm.INT8_SCALE_BYTES == np.dtype(quantized.SCALE_DTYPE).itemsize


def _word_moves(w, moves):
    """``w`` with, per rank, ``count`` elements moved by ``d`` ulps for each (d, count)."""
    bits = w.view(np.uint16).reshape(N, -1).copy()
    at = 0
    for d, count in moves:
        bits[:, at:at + count] += d
        at += count
    return bits.reshape(w.shape).view(w.dtype)


def _expected_word_wire(old, new):
    """Per rank: the cheapest option that holds the demand, priced by the cost model."""
    o = old.view(np.uint16).reshape(N, -1).astype(np.int64)
    n = new.view(np.uint16).reshape(N, -1).astype(np.int64)
    d = np.abs(n - o)  # positive words: ord(w) is the bits
    esc = {b: int((d > code_limit(b)).sum(axis=1).max()) for b in CODE_BITS}
    raw = int((d > 127).sum(axis=1).max())
    exp_changed = int(((n >> 7) != (o >> 7)).sum(axis=1).max())
    prices = [cm.gather_cost("word", old.size, N, 2, LINK, word_rung=i).wire_bytes
              for i, r in enumerate(WORD_LADDER) if r.fits(N_LOCAL, esc[r.code_bits], raw)]
    exp = cm.gather_cost("ciera", old.size, N, 2, LINK, change_rate=exp_changed / N_LOCAL)
    prices.append(exp.wire_bytes)  # plain when it falls back
    return min(prices) / N


WORD_CASES = [  # (d, count per rank) moves, from small churn to beyond the top rung
    [(1, 400)], [(2, 200)], [(3, 250), (200, 4)], [(5, 120), (200, 8)],
    [(5, 240), (200, 15)], [(9, 250), (200, 16)], [(9, 500), (300, 30)],
    [(9, 1000), (300, 60)], [(9, 1000), (300, 120)], [(40, 3000)]]


@pytest.mark.slow  # compiling the word-mode gather (every rung a switch branch) takes ~2 min
def test_word_options_priced_as_sent(mesh):
    """Word caches: whichever option the gather picks (a word rung, an exponent tier, plain),
    its sent bytes are the cost model's price of the cheapest option that fits, plus the
    tensor's demand vector in the agreement."""
    w = _base()
    cache, _ = _gather(mesh, w, ciera_jax.init_cache(w.shape, w.dtype, mode="word"))
    seen = set()
    for moves in WORD_CASES:
        new = _word_moves(w, moves)
        _, stats = _gather(mesh, new, cache)
        assert stats["sent_bytes"][0] - _expected_word_wire(w, new) == (
            AGREEMENT_BYTES * wordcodec.N_DEMANDS), (moves, stats)
        seen.add((int(stats["mode"][0]), int(stats["code_bits"][0]), int(stats["capacity"][0])))
    assert {b for m, b, _ in seen if m == 2} == set(CODE_BITS)  # 2-, 3- and 4-bit rungs
    assert len(seen) >= 5 and any(m != 2 for m, _, _ in seen)  # and exponent-mode fallbacks

"""Word mode's gather is bitwise a plain all-gather on every branch, and picks the cheapest fit.

Steps carry the word cache; every rank's result is compared with ``lax.all_gather`` of the bits
and with the input, and the new cache with the gathered bits.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from bitdata import (BF16, F32, WORD, adversarial, bits_of, from_bits, moved, ord_np,
                     special_words, weights, word_deltas)
from harness import encode_vmap_matches_layerwise, gather_step, mesh_of, run_steps
from ciera_jax.collective.gather import MODE_EXPONENT, MODE_PLAIN, MODE_WORD
from ciera_jax.codec.wire import CHECKSUM_BYTES, DEFAULT_CODE_BITS, WordWire, agreement_bytes
from ciera_jax.codec.word_ladder import code_limit


def _step(mesh_shape=(8,), names=("fsdp",), axis_name="fsdp", axis=0, ndim=2, impl="xla"):
    """(x, word cache) -> (full per rank, uint gather per rank, new cache, stats per rank)."""
    return gather_step(tuple(mesh_shape), tuple(names), axis_name, axis, ndim, impl)


def run_exact(xs, names=("fsdp",), **kw):
    """Gather each tensor in turn through one carried word cache; check every bit; stats."""
    out = []
    for t, (full, ref, stats, cache) in enumerate(run_steps(xs, mode="word", mesh_names=names,
                                                            **kw)):
        want = bits_of(xs[t])
        for rank in range(full.shape[0]):
            np.testing.assert_array_equal(bits_of(full[rank]), ref[rank],
                                          err_msg=f"step {t} rank {rank}: differs from gather")
            np.testing.assert_array_equal(bits_of(full[rank]), want,
                                          err_msg=f"step {t} rank {rank}: differs from input")
        np.testing.assert_array_equal(np.asarray(cache.words), want, err_msg=f"step {t} cache")
        np.testing.assert_array_equal(bits_of(np.asarray(ciera_jax.cached_full(cache))), want)
        assert bool(cache.primed)
        out.append(stats)
    return out


# ----------------------------------------------------------------------------- data


def trajectory(rng, x0, scales):
    xs = [x0]
    for s in scales:
        xs.append(moved(xs[-1], word_deltas(rng, x0.shape, s)))
    return xs


SHAPE = (8 * 64, 64)  # 4096 elements per rank


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_twenty_steps_carried_cache_bitwise(dtype):
    """Realistic moves, a peak-LR step, an adversarial jump and back: 20 gathers, all exact."""
    rng = np.random.default_rng(0)
    scales = [1.0] * 6 + [8.0, 0.5, 0.2, 0.2] + [1.0] * 9
    xs = trajectory(rng, weights(rng, SHAPE, dtype), scales)
    xs[12] = adversarial(rng, SHAPE, dtype)  # every word jumps: plain, then word mode again
    stats = run_exact(xs)
    modes = [int(s["mode"][0]) for s in stats]
    assert modes[0] == MODE_PLAIN, "a fresh cache primes with a plain gather"
    # every word jumps to adversarial values and back: more raw words than the top rung holds
    assert modes[12] == MODE_PLAIN and modes[13] == MODE_PLAIN
    # step 7 moves 8x wider (peak LR): most elements escape, and the top rungs still hold them
    assert all(m == MODE_WORD for i, m in enumerate(modes) if i not in (0, 12, 13)), str(modes)
    for t in range(1, len(xs)):
        assert_priced(stats[t], xs[t - 1], xs[t])
    for s in stats:  # rank-invariant choice
        for k in ("mode", "rung", "code_bits", "capacity", "sent_bytes"):
            assert (s[k] == s[k][0]).all(), k
    ratio = [s["sent_bytes"][0] / s["plain_bytes"][0] for s in stats]
    assert max(ratio[i] for i in range(1, 7)) < 0.35, ratio


@pytest.mark.parametrize("loop", [False, True], ids=["dense", "either"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_special_words_every_move(dtype, loop):
    """NaN payloads (signalling too), ±inf, ±0, subnormals, max finite: moved to each other,
    by sign flips and by small moves across zero, all exact (word or raw escapes)."""
    rng = np.random.default_rng(1)
    sp = special_words(dtype)
    n = SHAPE[0] * SHAPE[1]
    base = from_bits(np.resize(sp, n).reshape(SHAPE), dtype)
    shuffled = from_bits(rng.permutation(np.resize(sp, n)).reshape(SHAPE), dtype)
    top = np.array(1 << (8 * np.dtype(WORD[dtype]).itemsize - 1), WORD[dtype])
    flipped = from_bits(bits_of(shuffled) ^ top, dtype)
    xs = [base, moved(base, rng.integers(-2, 3, SHAPE)), shuffled, flipped,
          moved(flipped, rng.integers(-1, 2, SHAPE)), base]
    run_exact(xs, loop=loop)


def test_every_element_escaping_and_sign_flips_fall_back():
    rng = np.random.default_rng(2)
    x0 = weights(rng, SHAPE, BF16)
    x1 = moved(x0, np.full(SHAPE, 100))  # every element escapes at level 1: the top rung
    x2 = from_bits(bits_of(x1) ^ np.uint16(0x8000), BF16)  # every sign flips: raw everywhere
    stats = run_exact([x0, x0, x1, x2, x2])
    modes = [int(s["mode"][0]) for s in stats]
    assert modes == [MODE_PLAIN, MODE_WORD, MODE_WORD, MODE_PLAIN, MODE_WORD], modes
    assert int(stats[2]["capacity"][0]) == N_LOCAL
    assert int(stats[4]["code_bits"][0]) == DEFAULT_CODE_BITS
    assert int(stats[4]["capacity"][0]) == 0, "nothing moved: no escape section"


# ----------------------------------------------------------------------------- choice

N_LOCAL = SHAPE[0] * SHAPE[1] // 8
WIRE = WordWire(N_LOCAL, 2)
AGREEMENT = agreement_bytes("word")


def word_counts(x_prev, x, code_bits=DEFAULT_CODE_BITS):
    """Per rank (escapes, raw words) of the move from ``x_prev`` to ``x`` (gather axis 0)."""
    def signed(v):
        w = ord_np(bits_of(v)).astype(np.int64)
        return w
    width = 1 << (8 * bits_of(x).dtype.itemsize)
    d = (signed(x) - signed(x_prev)) % width
    d = np.where(d >= width // 2, d - width, d)
    out = []
    for part in np.split(d, 8):
        out.append((int((np.abs(part) > code_limit(code_bits)).sum()), int((np.abs(part) > 127).sum())))
    return out


def assert_priced(stats, x_prev, x):
    """mode, capacity and sent_bytes are what the wire table says for the worst rank."""
    counts = word_counts(x_prev, x)
    escapes, raw = max(c[0] for c in counts), max(c[1] for c in counts)
    wire = WordWire(x.size // 8, bits_of(x).dtype.itemsize)
    plain = wire.rung(escapes, raw) is None
    assert int(stats["mode"][0]) == (MODE_PLAIN if plain else MODE_WORD)
    assert int(stats["sent_bytes"][0]) == wire.sent_bytes(escapes, raw) + AGREEMENT, stats


def _on_rank(rank, d_rank):
    """Moves that are zero everywhere except rank ``rank``'s shard (rows of the gather axis)."""
    d = np.zeros(SHAPE, np.int64)
    rows = SHAPE[0] // 8
    d[rank * rows:(rank + 1) * rows] = d_rank.reshape(rows, SHAPE[1])
    return d


def _escapes(count, raw=0, far=5):
    """``count`` elements moved by ``far`` (of which ``raw`` by 1000), at random places."""
    d = np.zeros(N_LOCAL, np.int64)
    pos = np.random.default_rng(count + raw).choice(N_LOCAL, count, replace=False)
    d[pos] = far
    d[pos[:raw]] = 1000
    return d


def _choice(d_rank):
    """Stats of the gather that moves rank 3's shard by ``d_rank`` after a primed step."""
    # Mantissa 0 everywhere: moves of < 128 ulps never change an exponent.
    x0 = from_bits(np.full(SHAPE, 0x3F80, np.uint16), BF16)
    x1 = moved(x0, _on_rank(3, d_rank))
    s = run_exact([x0, x0, x1])[2]
    assert_priced(s, x0, x1)
    return {k: int(v[0]) for k, v in s.items()}


@pytest.mark.parametrize("case", ["l1_at", "l1_over", "raw_at", "raw_over", "top_at",
                                  "raw_top_at", "raw_top_over"])
def test_capacity_boundaries_pick_the_next_rung(case):
    caps1, caps2 = WIRE.caps1, WIRE.caps2
    if case == "l1_at":  # exactly a level-1 capacity: it still fits
        s, want = _choice(_escapes(caps1[3])), (MODE_WORD, caps1[3])
    elif case == "l1_over":  # one more: the next rung
        s, want = _choice(_escapes(caps1[3] + 1)), (MODE_WORD, caps1[4])
    elif case == "raw_at":  # raw words exactly at a rung's level 2: that rung
        s, want = _choice(_escapes(caps2[2], raw=caps2[2])), (MODE_WORD, caps1[2])
    elif case == "raw_over":  # one more raw word: the next rung, though level 1 would fit
        s, want = _choice(_escapes(caps2[2] + 1, raw=caps2[2] + 1)), (MODE_WORD, caps1[3])
    elif case == "top_at":  # every element escapes: the top rung holds them all
        s, want = _choice(_escapes(caps1[-1])), (MODE_WORD, caps1[-1])
    elif case == "raw_top_at":
        s, want = _choice(_escapes(caps2[-1], raw=caps2[-1])), (MODE_WORD, None)
    else:  # more raw words than level 2's top: plain (the only way above the top rung)
        s, want = _choice(_escapes(caps2[-1] + 1, raw=caps2[-1] + 1)), (MODE_PLAIN, N_LOCAL)
    assert s["mode"] == want[0], s
    if want[1] is not None:
        assert s["capacity"] == want[1], s
    assert s["fallback"] == (s["mode"] == MODE_PLAIN)
    assert s["code_bits"] == (DEFAULT_CODE_BITS if s["mode"] == MODE_WORD else 0)


def test_wire_bytes_are_exact_per_branch():
    """The lowered program gathers the code plane + checksum, each rung's section in one
    transfer (level 1's int8 and level 2's words end to end, as bytes, at that rung's sizes),
    and in the fallback the rest of the bits; never bf16."""
    mesh = mesh_of((8,), ("fsdp",))
    cache = ciera_jax.init_cache(SHAPE, BF16, mode="word")

    def body(x, c):
        return ciera_jax.all_gather(x, c, "fsdp")[1]

    x = jax.device_put(jnp.zeros(SHAPE, BF16), NamedSharding(mesh, P("fsdp")))
    text = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                                 out_specs=P())).lower(x, cache).as_text()
    outs = re.findall(r"all_gather.*-> tensor<([\dx]+)x(\w+)>", text)
    sizes = {t: {int(shape.split("x")[-1]) for shape, tt in outs if tt == t} for _, t in outs}
    rest = 2 * N_LOCAL - (WIRE.main_bytes - CHECKSUM_BYTES)  # the fallback: bits past the head
    section = {c1 + 2 * c2 for c1, c2 in zip(WIRE.caps1[1:], WIRE.caps2[1:])}
    assert section == set(WIRE.section_sizes[1:])
    assert sizes.keys() == {"ui8"} and sizes["ui8"] == {WIRE.main_bytes, rest} | section, sizes
    assert len(outs) == len(WIRE.caps1) - 1 + 2, "one transfer per rung, main, rest"
    assert not any(t == "bf16" for _, t in outs)


# ----------------------------------------------------------------------------- meshes


def test_two_dimensional_mesh_gathers_over_the_outer_axis():
    rng = np.random.default_rng(3)
    xs = trajectory(rng, weights(rng, (16, 40), BF16), [1.0, 4.0, 0.0])
    run_exact(xs, mesh_shape=(2, 4), names=("data", "fsdp"), axis_name="data")


def test_agreement_spans_both_mesh_axes():
    """Two data rows gather different tensors over fsdp; the quiet row follows the busy one."""
    mesh = mesh_of((2, 4), ("data", "fsdp"))
    shape = (2, 64, 32)  # row r of "data" holds x[r], sharded over fsdp on axis 1

    def body(x, c):
        c = jax.tree.map(lambda a: a[0], c)
        full, new_c, st = ciera_jax.all_gather(x[0], c, "fsdp")
        return full[None, None], jax.tree.map(lambda v: v[None, None], st), \
            jax.tree.map(lambda a: a[None], new_c)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data", "fsdp"), P("data")),
                               out_specs=(P("data", "fsdp"), P("data", "fsdp"), P("data"))))
    rng = np.random.default_rng(4)
    x0 = weights(rng, shape, BF16)
    d = np.zeros(shape, np.int64)
    d[1, ::16] = 5  # row 1: 1/16 of its elements escape; row 0 does not move at all
    x1 = moved(x0, d)
    caches = jax.vmap(lambda _: ciera_jax.init_cache(shape[1:], BF16, mode="word"))(
        jnp.arange(2))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    for x in (x0, x1):
        full, stats, caches = fn(put(jnp.asarray(x), P("data", "fsdp")), put(caches, P("data")))
        full = np.asarray(full)
        for r in range(2):
            for f in range(4):
                np.testing.assert_array_equal(bits_of(full[r, f]), bits_of(x[r]))
    for k in ("mode", "rung", "code_bits"):
        v = np.asarray(stats[k])
        assert (v == v[0, 0]).all(), (k, v)
    # Row 0 alone would send no escape section; row 1's escapes size it for both rows.
    assert (np.asarray(stats["capacity"]) >= 64 * 32 // 4 // 16).all()


# ----------------------------------------------------------------------------- hypothesis


CASES = [((64,), 0), ((2, 3, 16), 2)]  # axis 1: test_phases_and_priming_encoded


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2**16),
       scales=st.lists(st.sampled_from([0.0, 0.3, 1.0, 6.0, 300.0]), min_size=1, max_size=3),
       dtype=st.sampled_from([BF16, F32]), adversarial_start=st.booleans())
def test_property_bitwise(case, seed, scales, dtype, adversarial_start):
    shape, axis = case
    rng = np.random.default_rng(seed)
    x0 = adversarial(rng, shape, dtype) if adversarial_start else weights(rng, shape, dtype)
    run_exact(trajectory(rng, x0, scales), axis=axis)


# ----------------------------------------------------------------------------- API


def test_mixed_tree_one_agreement_and_exact():
    mesh = mesh_of((8,), ("fsdp",))
    rng = np.random.default_rng(5)
    tree = {"w": weights(rng, (64, 16), F32), "e": weights(rng, (8, 8, 16), BF16),
            "ids": np.arange(16, dtype=np.int32)}
    modes = {"w": "word", "e": "exponent", "ids": "word"}
    caches = ciera_jax.init_cache_tree(tree, mode=modes)
    assert caches["w"].mode == "word" and caches["e"].mode == "exponent"

    def body(t, c):
        full, new_c, stats = ciera_jax.all_gather_tree(t, c, "fsdp")
        return jax.tree.map(lambda v: v[None], full), new_c, \
            jax.tree.map(lambda v: v[None], stats)

    spec = {k: P("fsdp") for k in tree}
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P()),
                       out_specs=({k: P("fsdp") for k in tree}, P(),
                                  {k: P("fsdp") for k in tree}))
    put = lambda: {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec[k]))  # noqa
                   for k, v in tree.items()}
    jaxpr = str(jax.make_jaxpr(fn)(put(), caches))
    assert len(re.findall(r"\bpmax\b", jaxpr)) == 1, "one agreement collective per call"
    jitted = jax.jit(fn)
    for step in range(3):
        full, caches, stats = jitted(put(), caches)
        for k, v in tree.items():
            for rank in range(8):
                np.testing.assert_array_equal(bits_of(np.asarray(full[k])[rank]), bits_of(v))
        tree = {k: (moved(v, word_deltas(rng, v.shape)) if v.dtype != np.int32 else v)
                for k, v in tree.items()}
    assert int(np.asarray(stats["w"]["mode"])[0]) == MODE_WORD
    assert int(np.asarray(stats["e"]["mode"])[0]) == MODE_EXPONENT
    assert int(np.asarray(stats["ids"]["mode"])[0]) == MODE_PLAIN


def test_phases_and_priming_encoded():
    """encode (one call), agree + exchange (the next) equal the one-call gather's bits and
    bytes; a host-side priming Encoded makes the exchange prime plainly."""
    mesh = mesh_of((8,), ("fsdp",))
    shape = (8, 16, 24)
    spec = P(None, "fsdp")
    enc_spec = P("fsdp")  # the Encoded, one per rank on a leading axis

    def encode(x, cache):
        return jax.tree.map(lambda a: a[None], ciera_jax.encode(x, cache, "fsdp", axis=1))

    def exchange(x, cache, e):
        e = jax.tree.map(lambda a: a[0], e)
        full, new_cache, st = ciera_jax.exchange(x, e, cache, ciera_jax.agree(e, "fsdp"), "fsdp")
        return full[None], new_cache, jax.tree.map(lambda v: v[None], st)

    enc = jax.jit(jax.shard_map(encode, mesh=mesh, in_specs=(spec, P()), out_specs=enc_spec))
    exc = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(spec, P(), enc_spec),
                                out_specs=(P("fsdp"), P(), P("fsdp"))))
    one = _step(axis=1, ndim=3)
    rng = np.random.default_rng(6)
    cache = ciera_jax.init_cache(shape, BF16, mode="word")
    x = weights(rng, shape, BF16)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    primer = ciera_jax.priming_encoded(jax.eval_shape(enc, put(jnp.asarray(x), spec), cache),
                                       x.size // 8)
    assert (primer.demand == np.iinfo(np.int32).max).all()
    full, _, st = exc(put(jnp.asarray(x), spec), cache, put(primer, enc_spec))
    assert (np.asarray(st["mode"]) == MODE_PLAIN).all()
    for step in range(4):
        xs = put(jnp.asarray(x), spec)
        full, new_cache, st = exc(xs, cache, enc(xs, cache))
        full_one, _, _, st_one = one(x, cache)
        assert (np.asarray(st["sent_bytes"]) == np.asarray(st_one["sent_bytes"])).all()
        assert int(np.asarray(st["mode"])[0]) == (MODE_PLAIN if step == 0 else MODE_WORD)
        for rank in range(8):
            np.testing.assert_array_equal(bits_of(np.asarray(full)[rank]), bits_of(x))
            np.testing.assert_array_equal(bits_of(np.asarray(full_one)[rank]), bits_of(x))
        cache = new_cache
        x = moved(x, word_deltas(rng, shape))


def test_encode_vmaps_over_stacked_layers():
    assert encode_vmap_matches_layerwise("word", seed=7)


def test_gradients_equal_plain_gather():
    """Forward and gradient of a loss nonlinear in the gathered words (a wrong word changes
    both), bitwise those of the plain gather: on the priming gather, then on the next step's
    word-coded one through the cache it left."""
    mesh = mesh_of((8,), ("fsdp",))
    rng = np.random.default_rng(8)
    # bf16, as weights travel: a word one unit off moves the loss and its gradient visibly
    # (in f32 a last-place error would vanish in their rounding)
    x = weights(rng, (64, 16), BF16)
    w = rng.standard_normal((64, 16)).astype(np.float32)

    def loss(x, cache, word):
        full, new_cache, stats = (ciera_jax.all_gather(x, cache, "fsdp") if word
                                  else (ciera_jax.plain_all_gather(x, "fsdp"), cache, {}))
        return jnp.sum(jnp.sin(full.astype(jnp.float32) * 8) * w), (new_cache, stats)

    def body(x, cache):
        (l_word, (new_cache, stats)), g_word = jax.value_and_grad(loss, has_aux=True)(
            x, cache, True)
        (l_plain, _), g_plain = jax.value_and_grad(loss, has_aux=True)(x, cache, False)
        return (g_word, g_plain, l_word[None], l_plain[None], new_cache,
                jax.tree.map(lambda v: v[None], stats))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                               out_specs=(P("fsdp"),) * 4 + (P(), P("fsdp"))))
    cache = ciera_jax.init_cache(x.shape, BF16, mode="word")
    modes = []
    for step in range(2):
        g_word, g_plain, l_word, l_plain, cache, stats = fn(
            jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("fsdp"))), cache)
        np.testing.assert_array_equal(bits_of(np.asarray(g_word)), bits_of(np.asarray(g_plain)))
        np.testing.assert_array_equal(bits_of(np.asarray(l_word)), bits_of(np.asarray(l_plain)))
        modes.append(int(np.asarray(stats["mode"])[0]))
        x = moved(x, word_deltas(rng, x.shape))
    assert modes == [MODE_PLAIN, MODE_WORD], modes
    assert (np.asarray(stats["fallback"]) == 0).all()
    assert (np.asarray(stats["sent_bytes"]) < np.asarray(stats["plain_bytes"])).all()


def test_mismatched_encoded_and_cache_is_a_clear_error():
    mesh = mesh_of((8,), ("fsdp",))

    def body(x, wc, ec):
        e = ciera_jax.encode(x, ec, "fsdp")
        return ciera_jax.exchange(x, e, wc, ciera_jax.agree(e, "fsdp"), "fsdp")[0]

    x = jax.device_put(jnp.zeros((16, 8), BF16), NamedSharding(mesh, P("fsdp")))
    with pytest.raises(TypeError, match="WordCache needs the WordEncoded"):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P(), P()),
                              out_specs=P()))(x, ciera_jax.init_cache((16, 8), BF16, "word"),
                                              ciera_jax.init_cache((16, 8), BF16))

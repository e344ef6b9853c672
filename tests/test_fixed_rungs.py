"""Rungs fixed when the step is compiled (``FixedRung``): bitwise a plain all-gather at every
rung, on adversarial trajectories; the section rides in the one main transfer; the fallback is
the only conditional with a collective; a plain rung compiles no codec at all."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from bitdata import BF16, F32, adversarial, bits_of, special_words
from ciera_jax.collective import capacity
from ciera_models.resilience import corrupt as faults
from ciera_jax.runtime import target
from ciera_jax.collective import gather as G
from ciera_jax.codec.wire import OVERFLOW_RUNGS, ExponentWire, WordWire
from jaxprs import outside, subjaxprs, walk

N = 8
SHAPE = (N * 32, 48)  # 1536 elements per rank: every ladder has several rungs
GATHERS = {"all_gather", "all_gather_invariant"}


def _mesh():
    return jax.make_mesh((N,), ("fsdp",))


def _body(rung, exits=0):
    """One encode + agree + exchange at ``rung`` with ``exits`` overflow rungs, returning
    what a test checks."""
    def body(x, c):
        e = G.encode(x, c, "fsdp")
        agreed = G.agree(e, "fsdp")
        need = capacity.needed_rung(e.wire, agreed)
        full, new_c, st = G.exchange(x, e, c, capacity.fix(agreed, rung, exits=exits), "fsdp")
        ref = lax.all_gather(lax.bitcast_convert_type(x, _word(x.dtype)), "fsdp", tiled=True)
        return full, ref, new_c, need, st["sent_bytes"], st["fallback"], st["verify_failed"]
    return body


def _word(dtype):
    return jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else jnp.uint32


_RUNS: dict = {}


def _run(rung, x, cache, exits=0):
    key = (rung, exits, x.dtype, type(cache).__name__, G.fills_in_branch())
    if key not in _RUNS:
        _RUNS[key] = jax.jit(jax.shard_map(_body(rung, exits), mesh=_mesh(),
                                           in_specs=(P("fsdp"), P()), out_specs=P(),
                                           check_vma=False))
    x = jax.device_put(jnp.asarray(x), NamedSharding(_mesh(), P("fsdp")))
    return _RUNS[key](x, cache)


def _trajectory(rng, dtype):
    """Adversarial start, then a step of small moves with every kind of far move mixed in
    (sign flips, every exponent changing, NaN payloads, infinities, signed zeros, subnormals,
    words moved by any amount), a step of fewer far and medium moves (its demand inside the
    ladder), then a step in which nothing moves."""
    word = np.dtype(_word(dtype))
    x0 = adversarial(rng, SHAPE, dtype)
    b = bits_of(x0).astype(np.int64).reshape(-1)
    move = rng.integers(-3, 4, size=b.size)
    far = rng.choice(b.size, size=b.size // 10, replace=False)
    move[far] = rng.integers(-(1 << 20), 1 << 20, size=far.size)
    b1 = (b + move) % (1 << (8 * word.itemsize))
    flip = rng.choice(b.size, size=b.size // 50, replace=False)
    b1[flip] ^= 1 << (8 * word.itemsize - 1)  # sign flips
    sp = special_words(dtype)
    b1[:sp.size] = sp
    x1 = b1.astype(word).view(dtype).reshape(SHAPE)
    # a step whose demand sits inside the ladder: a few far moves and flips, some medium ones
    b2 = b1.copy()
    some = rng.choice(b.size, size=b.size // 8, replace=False)
    b2[some[:b.size // 40]] += rng.integers(1 << 8, 1 << 16, size=b.size // 40)
    b2[some[b.size // 40:]] += rng.integers(4, 100, size=some.size - b.size // 40)
    b2[some[:b.size // 200]] ^= 1 << (8 * word.itemsize - 1)
    x2 = (b2 % (1 << (8 * word.itemsize))).astype(word).view(dtype).reshape(SHAPE)
    return [x0, x1, x2, x2]


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("mode,exits,fill_in_branch", [
    ("exponent", 0, True), ("word", 0, True), ("word", OVERFLOW_RUNGS, True),
    ("word", OVERFLOW_RUNGS, False)], ids=["exponent", "word", "word-exits",
                                           "word-exits-fill-before"])
def test_every_fixed_rung_is_bitwise_a_plain_gather(mode, exits, fill_in_branch, dtype,
                                                    monkeypatch):
    """Each step runs at PLAIN_RUNG, the needed rung, the rungs below it down to one past the
    overflow ladder (word mode: each overflow exit, then the plain fallback; exponent mode: the
    fallback) and the top; all give the plain gather's bits, price their bytes as the wire
    table says, and leave the same cache (carried on). With overflow rungs, the escapes' fill
    in the fallback's steady branch (as on a CPU) and before the conditional (as on a GPU)."""
    monkeypatch.setattr(G, "fills_in_branch", lambda: fill_in_branch)
    rng = np.random.default_rng(7)
    cache = ciera_jax.init_cache(SHAPE, dtype, mode)
    wire = _wire(mode, np.dtype(dtype).itemsize)
    taken = set()  # (need - rung) of the overflows that still sent words
    for step, x in enumerate(_trajectory(rng, dtype)):
        need = int(_run(capacity.PLAIN_RUNG, x, cache)[3])
        rungs = {capacity.PLAIN_RUNG, wire.rungs - 1}
        if need < wire.rungs:
            below = range(need - 1, need - 2 - exits, -1)
            rungs |= {need} | {r for r in below if r >= 0}
        new_caches = []
        for rung in sorted(rungs):
            full, ref, new_c, need_again, sent, fallback, failed = _run(rung, x, cache, exits)
            assert np.array_equal(bits_of(full), np.asarray(ref)), (mode, step, rung)
            assert int(need_again) == need
            assert int(failed) == 0
            plain = rung == capacity.PLAIN_RUNG or (
                need > rung and need not in wire.overflow_rungs(rung, exits))
            assert bool(fallback) == plain, (rung, need)
            if need > rung and not plain:
                taken.add(need - rung)
            assert int(sent) == wire.bytes_at(rung, need, exits) + (12 if mode == "word" else 4)
            new_caches.append(jax.tree.leaves(new_c))
        for leaves in new_caches[1:]:  # every rung leaves the same (primed) cache
            for a, b in zip(leaves, new_caches[0]):
                assert np.array_equal(np.asarray(a), np.asarray(b))
        cache = jax.tree.unflatten(jax.tree.structure(cache), new_caches[0])
    assert need == 0, "the last step moved nothing: the smallest rung holds it"
    assert taken == set(range(1, exits + 1))


def _jaxpr(mode, rung, exits=0):
    cache = ciera_jax.init_cache(SHAPE, BF16, mode)
    fn = jax.shard_map(lambda x, c: _body(rung, exits)(x, c)[:3], mesh=_mesh(),
                       in_specs=(P("fsdp"), P()), out_specs=P(), check_vma=False)
    x = jax.device_put(jnp.zeros(SHAPE, BF16), NamedSharding(_mesh(), P("fsdp")))
    return jax.make_jaxpr(fn)(x, cache).jaxpr


def _conds_with_gathers(jaxpr) -> list:
    """The conditionals (outside any other) whose branches hold an all-gather."""
    return [c for c in outside(jaxpr, "cond") if c.primitive.name == "cond"
            and any(e.primitive.name in GATHERS for b in subjaxprs(c) for e in walk(b))]


def _wire(mode, word_bytes=2):
    n = SHAPE[0] * SHAPE[1] // N
    return ExponentWire(n, word_bytes) if mode == "exponent" else WordWire(n, word_bytes)


@pytest.mark.parametrize("mode,exits", [("exponent", 0), ("exponent", OVERFLOW_RUNGS),
                                        ("word", 0), ("word", OVERFLOW_RUNGS)])
def test_a_fixed_rung_sends_its_section_in_the_main_transfer(mode, exits):
    """One transfer outside every conditional, the main plane + checksum + the rung's section;
    the one conditional holding collectives is the fallback: word mode's overflow exit (a
    switch inside it sends the escapes past the rung's section, up to each overflow rung's)
    and the rest of the bits."""
    wire = _wire(mode)
    rung = wire.rungs // 2
    jaxpr = _jaxpr(mode, rung, exits)
    gathers = [e for e in outside(jaxpr, "cond") if e.primitive.name in GATHERS]
    # the reference plain gather of the test's body, and the compressed one
    sizes = sorted(e.invars[0].aval.size * e.invars[0].aval.dtype.itemsize for e in gathers)
    assert wire.main_bytes + wire.section_bytes(rung) in sizes, sizes
    assert len(gathers) == 2, sizes
    conds = _conds_with_gathers(jaxpr)
    assert len(conds) == 1, "the fallback only: no rung switch"
    branches = subjaxprs(conds[0])
    assert not [e for e in walk(branches[0]) if e.primitive.name in GATHERS]  # the rung held
    rest = [e for b in branches for e in walk(b) if e.primitive.name in GATHERS]
    ladder = wire.overflow_rungs(rung, exits)
    assert len(ladder) == (exits if mode == "word" else 0)
    assert [e.invars[0].aval.size for e in rest] == [
        *(wire.section_bytes(r) - wire.section_bytes(rung) for r in ladder),
        wire.plain_bytes - (wire.main_bytes - 4 + wire.section_bytes(rung))]


@pytest.mark.parametrize("in_branch", [True, False], ids=["cpu", "gpu"])
def test_with_overflow_rungs_a_cpu_fills_the_escapes_in_the_steady_branch(in_branch,
                                                                          monkeypatch):
    """An overflow's exit fills every escape itself, so on a CPU the section's fill runs in the
    fallback's steady branch (not thrown away on an overflow); on a GPU before the conditional,
    where XLA fuses it with the self-check, and that branch passes the words through."""
    assert G.fills_in_branch() == (jax.default_backend() == "cpu")  # tracing for this host
    with target.tracing_for_gpu((9, 0)):
        assert not G.fills_in_branch()
    monkeypatch.setattr(G, "fills_in_branch", lambda: in_branch)
    jaxpr = _jaxpr("word", _wire("word").rungs // 2, OVERFLOW_RUNGS)
    conds = _conds_with_gathers(jaxpr)
    steady = subjaxprs(conds[0])[0]  # the rung held the demand
    takes = [e for e in walk(steady) if e.primitive.name == "gather"]  # the levels read
    assert len(takes) == (2 if in_branch else 0)
    assert bool(steady.eqns) == in_branch


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_a_plain_rung_compiles_no_codec_and_no_conditional(mode):
    jaxpr = _jaxpr(mode, capacity.PLAIN_RUNG)
    assert not [c for c in walk(jaxpr) if c.primitive.name == "cond"]
    gathers = [e for e in walk(jaxpr) if e.primitive.name in GATHERS]
    # the bits, and the test's own reference gather (the encode still runs: the test's)
    assert len(gathers) == 2
    assert {e.invars[0].aval.size for e in gathers} == {SHAPE[0] * SHAPE[1] // N}


def test_a_rung_outside_the_ladder_is_a_clear_error():
    with pytest.raises(ValueError, match="a fixed rung must be in 0.."):
        _jaxpr("word", 99)


@pytest.mark.parametrize("wire", [WordWire(1536, 2), ExponentWire(1536, 2)],
                         ids=["word", "exponent"])
def test_a_needed_rung_given_with_the_demand_decides_as_the_demand_does(wire):
    """A train step hands each gather the rung its demand needs (computed where the demand
    was agreed on); the overflow it decides is the one the demand alone decides, at every rung
    and every demand from nothing to above the top."""
    counts = sorted({0, 1, *wire.ladder, *(c + 1 for c in wire.ladder), 10 ** 9})
    if isinstance(wire, WordWire):  # escapes, raw words (at most an eighth of them), exponents
        demand = jnp.asarray([[c, c // 8, 0] for c in counts], jnp.int32)
    else:
        demand = jnp.asarray(counts, jnp.int32)
    needed = capacity.needed_rung(wire, demand)
    for rung in range(wire.rungs):
        alone = capacity.overflows(wire, capacity.fix(demand, rung))
        given = capacity.overflows(wire, capacity.fix(demand, rung, needed))
        np.testing.assert_array_equal(given, alone)
        assert bool(jnp.any(alone)) and not bool(jnp.all(alone))  # above the top; none


def test_an_overflow_exit_checks_the_words_it_rebuilt():
    """Rank 0's copy of the cache drifted (a flipped word in rank 1's part): rank 0 decodes a
    wrong word at the needed rung and at each overflow exit below it, and the self-check after
    the fallback's conditional names it; the plain fallback further below gathers the bits and
    is not checked (it re-primes the cache)."""
    rng = np.random.default_rng(7)
    cache = ciera_jax.init_cache(SHAPE, BF16, "word")
    xs = _trajectory(rng, BF16)
    for x in xs[:2]:  # prime on the start, then carry the far-moving step
        cache = jax.tree.unflatten(jax.tree.structure(cache),
                                   jax.tree.leaves(_run(capacity.PLAIN_RUNG, x, cache)[2]))
    x = xs[2]
    need = int(_run(capacity.PLAIN_RUNG, x, cache)[3])
    assert OVERFLOW_RUNGS < need < _wire("word").rungs

    def flip(words):
        words = words.copy()
        words[SHAPE[0] // N, 5] ^= 1  # rank 1's first row
        return words

    drifted = faults.corrupt_cache(cache, jax.devices()[0], flip)
    for rung in range(need - OVERFLOW_RUNGS - 1, need + 1):
        full, ref, _, _, _, fallback, failed = _run(rung, x, drifted, OVERFLOW_RUNGS)
        if rung < need - OVERFLOW_RUNGS:  # beyond the exits: plain, exact, unchecked
            assert bool(fallback) and int(failed) == 0
            assert np.array_equal(bits_of(full), np.asarray(ref))
        else:  # rank 0's answer (out_specs P()): its copy failed rank 1's shard
            assert not bool(fallback) and int(failed) == 1, rung


def _guaranteed_body(rung):
    def body(x, c):
        e = G.encode(x, c, "fsdp")
        agreed = G.agree(e, "fsdp")
        need = capacity.needed_rung(e.wire, agreed)
        full, new_c, st = G.exchange(x, e, c, capacity.fix(agreed, rung, exits=OVERFLOW_RUNGS,
                                                           guaranteed=True), "fsdp")
        ref = lax.all_gather(lax.bitcast_convert_type(x, _word(x.dtype)), "fsdp", tiled=True)
        return full, ref, new_c, need, st["sent_bytes"], st["fallback"], st["verify_failed"]
    return body


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_a_guaranteed_rung_compiles_no_conditional_and_is_exact_where_it_holds(mode):
    """The host promised the rung holds the demand: one transfer (main plane, checksum, the
    rung's section), no conditional of any kind, no overflow rung; at the needed rung and
    every rung above it the gather is bitwise a plain one, priced as the wire table says.
    Below the needed rung the promise is broken: the self-check says so (the redo is exact)."""
    wire = _wire(mode)
    cache = ciera_jax.init_cache(SHAPE, BF16, mode)
    fn = jax.shard_map(lambda x, c: _guaranteed_body(wire.rungs // 2)(x, c)[:3], mesh=_mesh(),
                       in_specs=(P("fsdp"), P()), out_specs=P(), check_vma=False)
    x0 = jax.device_put(jnp.zeros(SHAPE, BF16), NamedSharding(_mesh(), P("fsdp")))
    jaxpr = jax.make_jaxpr(fn)(x0, cache).jaxpr
    assert not [e for e in walk(jaxpr) if e.primitive.name in ("cond", "switch")]
    sizes = sorted(e.invars[0].aval.size * e.invars[0].aval.dtype.itemsize
                   for e in walk(jaxpr) if e.primitive.name in GATHERS)
    assert sizes == sorted([wire.main_bytes + wire.section_bytes(wire.rungs // 2),
                            wire.plain_bytes]), sizes  # the reference gather beside it

    rng = np.random.default_rng(11)
    runs = {}

    def run(rung, x, c):
        if rung not in runs:
            runs[rung] = jax.jit(jax.shard_map(_guaranteed_body(rung), mesh=_mesh(),
                                               in_specs=(P("fsdp"), P()), out_specs=P(),
                                               check_vma=False))
        return runs[rung](jax.device_put(jnp.asarray(x), NamedSharding(_mesh(), P("fsdp"))), c)

    broken = 0
    for x in _trajectory(rng, BF16):
        need = int(_run(capacity.PLAIN_RUNG, x, cache)[3])
        if need >= wire.rungs:  # unprimed, or above the top: the host runs a plain rung
            cache = jax.tree.unflatten(jax.tree.structure(cache), jax.tree.leaves(
                _run(capacity.PLAIN_RUNG, x, cache)[2]))
            continue
        for rung in sorted({need, wire.rungs - 1}):
            full, ref, new_c, _, sent, fallback, failed = run(rung, x, cache)
            assert np.array_equal(bits_of(full), np.asarray(ref)), (mode, rung, need)
            assert not bool(fallback) and int(failed) == 0
            assert int(sent) == wire.bytes_at(rung, need) + (12 if mode == "word" else 4)
        if need > 0:
            full, ref, _, _, _, _, failed = run(need - 1, x, cache)
            broken += 1
            assert int(failed) > 0 and not np.array_equal(bits_of(full), np.asarray(ref))
        cache = jax.tree.unflatten(jax.tree.structure(cache), jax.tree.leaves(new_c))
    assert broken, "the trajectory had a step whose promise could be broken"


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rung", [None, 6, 9], ids=["traced", "rung 6", "top rung"])
def test_rows_aligned_for_the_fused_decode_gather_bitwise(rung, dtype):
    """Off axis 0, where the fused decode reads the payload in the wire's rows (interpreted
    Pallas here), the sender pads each row to its alignment: bitwise a plain gather, the
    self-check passes, and at a fixed rung (the section in the row) the padding counts as
    sent."""
    shape, axis = (2, N * 2, 256), 1
    spec = P(None, "fsdp", None)
    align = ciera_jax.kernels.row_align(shape, dtype, N, axis=axis, impl="pallas")
    assert align

    def body(x, c):
        e = G.encode(x, c, "fsdp", axis=axis, impl="pallas")
        agreed = G.agree(e, "fsdp")
        agreed = agreed if rung is None else capacity.fix(agreed, rung)
        full, new_c, st = G.exchange(x, e, c, agreed, "fsdp", impl="pallas")
        ref = lax.all_gather(_bits(x), "fsdp", axis=axis, tiled=True)
        return (_bits(full), ref, new_c, st["verify_failed"], st["sent_bytes"],
                st["fallback"])

    fn = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(spec, P()), out_specs=P(),
                               check_vma=False))
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(dtype)
    cache = ciera_jax.init_cache(shape, dtype, mode="exponent")
    compressed = 0
    for step in range(3):
        full, ref, cache, failed, sent, fallback = fn(
            jax.device_put(jnp.asarray(x), NamedSharding(_mesh(), spec)), cache)
        assert np.array_equal(np.asarray(full), np.asarray(ref)) and int(failed) == 0, step
        if not bool(fallback):
            compressed += 1
            if rung is not None:  # plane, section, checksum: whole aligned rows
                assert (int(sent) - 4) % align == 0  # less the agreement's bytes
        x = (x.astype(np.float32) * (1 + 1e-3 * rng.standard_normal(shape))).astype(dtype)
    assert compressed == 2  # the first gather primes the cache


def _bits(a):
    return lax.bitcast_convert_type(a, _word(a.dtype))

"""The escape kernels (``kernels/escape.py``: pack, exponent fill, word fill) against the jnp
loops of :mod:`ciera_jax.codec.escapes`, bit for bit, in Triton's interpreter (the kernels exist on
Triton only: Mosaic GPU has no per-element gather/scatter), on random and adversarial flags:
none, all, every 32nd, the last element only, lengths that are not a multiple of 32 or of the
block. With ``JAX_PLATFORMS=cuda`` (``benchmarks/gpu_check.sh``) the same tests compile and run
the kernels. Lowering for CUDA: ``test_cuda_lowering.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ciera_jax.codec import escapes
from ciera_jax.collective import word_mode
from ciera_jax import kernels as K
from ciera_jax.codec.word_ladder import LEVEL2

pytestmark = pytest.mark.skipif("triton" not in K.available_backends(),
                                reason="no Pallas Triton in this JAX")

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
BLOCK = 256  # small blocks: several per row at test sizes (the kernels' default is 4096)
N = 3 * BLOCK + 45  # not a multiple of 32, nor of the block
PATTERNS = ["none", "all", "every_32nd", "last_only", "first_only", "sparse", "half"]


def flags_of(pattern: str, rows: int, n: int, seed: int = 0) -> np.ndarray:
    f = np.zeros((rows, n), bool)
    if pattern == "all":
        f[:] = True
    elif pattern == "every_32nd":
        f[:, 31::32] = True
    elif pattern == "last_only":
        f[:, -1] = True
    elif pattern == "first_only":
        f[:, 0] = True
    elif pattern in ("sparse", "half"):
        f = np.random.default_rng(seed).random((rows, n)) < (0.03 if pattern == "sparse" else 0.5)
        f[-1] = False  # a row with nothing
    return f


def _u8(rng, shape):
    return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))


def all_patterns(rows_each: int, n: int) -> np.ndarray:
    """Every pattern, ``rows_each`` rows of each, stacked: one compiled call covers them all."""
    return np.concatenate([flags_of(p, rows_each, n, seed=i) for i, p in enumerate(PATTERNS)])


def test_popcount32_is_population_count_on_every_kind_of_word():
    """The kernels' popcount (Triton cannot lower ``lax.population_count``): every single bit,
    every run of low and of high bits, alternating bits, and random words."""
    one = np.uint32(1) << np.arange(32, dtype=np.uint32)
    runs = np.cumsum(one, dtype=np.uint32)  # 0b1, 0b11, ... 0xFFFFFFFF
    words = np.concatenate([[0, 0x55555555, 0xAAAAAAAA, 0x0F0F0F0F, 0xF0F0F0F0], one, runs,
                            ~runs, np.random.default_rng(0).integers(0, 2**32, 4096)])
    words = jnp.asarray(words.astype(np.uint32))
    got = jax.jit(K.escape.popcount32)(words)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(jax.lax.population_count(words)).astype(np.int32))


def test_fill_exponents_matches_loop():
    flags = all_patterns(3, N)
    rows, k = flags.shape[0], 200
    rng = np.random.default_rng(1)
    cached, section = _u8(rng, (rows, N)), _u8(rng, (rows, k))
    words = escapes.pack_flags(jnp.asarray(flags))
    want_fn = jax.jit(lambda *a: K.escape_fill_exponents(*a, impl="xla"))
    got_fn = jax.jit(lambda *a: K.fill_exponents_pallas(*a, block=BLOCK, interpret=INTERPRET))
    # the whole section; a short and an empty rung (row by row)
    for limit in ([k] * rows, [k, 37, 0] * (rows // 3)):
        args = (cached, words, section, jnp.asarray(limit, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got_fn(*args)), np.asarray(want_fn(*args)))


@pytest.mark.parametrize("dtype,capacities", [(np.uint8, (1, 40, N)), (np.int8, (40,)),
                                              (np.uint16, (40,)), (np.uint32, (N,))])
def test_pack_matches_loop(dtype, capacities):
    rng = np.random.default_rng(2)
    info = np.iinfo(dtype)
    values = jnp.asarray(rng.integers(info.min, info.max, N, dtype=dtype, endpoint=True))
    for capacity in capacities:  # flags past the capacity are dropped
        want_fn = jax.jit(lambda v, w, c=capacity: escapes.pack(v, w, c))
        got_fn = jax.jit(lambda v, w, c=capacity: K.pack_pallas(v, w, c, block=BLOCK,
                                                                 interpret=INTERPRET))
        for i, pattern in enumerate(PATTERNS):
            words = escapes.pack_flags(jnp.asarray(flags_of(pattern, 1, N, seed=i)))[0]
            want, got = want_fn(values, words), got_fn(values, words)
            assert got.dtype == want.dtype and got.shape == (capacity,)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                          err_msg=f"{pattern}, capacity {capacity}")


def word_values_at(level1_NxC, level2_NxC, escape_offset):
    """word_mode.exchange's rule for an escape's word (the jnp path's ``values_at``)."""
    return word_mode.escape_words(level1_NxC, level2_NxC, escape_offset)


@pytest.mark.parametrize("word", [np.uint16, np.uint32], ids=["bf16", "f32"])
def test_fill_words_matches_loop(word):
    flags = all_patterns(2, N)
    rows, c1, c2, offset = flags.shape[0], 300, 60, 4
    rng = np.random.default_rng(3)
    top = np.iinfo(word).max
    dense = jnp.asarray(rng.integers(0, top, (rows, N), dtype=word, endpoint=True))
    level1 = rng.integers(-128, 128, (rows, c1), dtype=np.int8)
    level1[rng.random((rows, c1)) < 0.2] = LEVEL2  # raw words, more than level 2 holds
    level1 = jnp.asarray(level1)
    level2 = jnp.asarray(rng.integers(0, top, (rows, c2), dtype=word, endpoint=True))
    words = escapes.pack_flags(jnp.asarray(flags))

    @jax.jit
    def want_fn(limit):
        return K.escape_fill_words(dense, words, limit, level1, level2, escape_offset=offset,
                                   level2_code=LEVEL2,
                                   values_at=word_values_at(level1, level2, offset),
                                   init=jnp.zeros((rows,), jnp.int32), impl="xla")

    @jax.jit
    def got_fn(limit):
        return K.fill_words_pallas(dense, words, level1, level2, limit, escape_offset=offset,
                                   level2_code=LEVEL2, block=BLOCK, interpret=INTERPRET)

    for limit in ([c1] * rows, [c1, 50, 0, 7] * (rows // 4) + [c1] * (rows % 4)):
        limit = jnp.asarray(limit, jnp.int32)
        np.testing.assert_array_equal(np.asarray(got_fn(limit)), np.asarray(want_fn(limit)))


@pytest.mark.parametrize("n", [33, 1000])
def test_default_block_and_short_rows(n):
    """The default 4096-element block on rows shorter than one block."""
    rng = np.random.default_rng(4)
    cached, section = _u8(rng, (2, n)), _u8(rng, (2, 64))
    words = escapes.pack_flags(jnp.asarray(rng.random((2, n)) < 0.3))
    limit = jnp.asarray([64, 5], jnp.int32)
    want = jax.jit(lambda *a: K.escape_fill_exponents(*a, impl="xla"))(cached, words, section,
                                                                        limit)
    got = jax.jit(lambda *a: K.fill_exponents_pallas(*a, interpret=INTERPRET))(
        cached, words, section, limit)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    values = _u8(rng, (n,))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda v, w: K.pack_pallas(v, w, 64, interpret=INTERPRET))(
            values, words[0])),
        np.asarray(jax.jit(lambda v, w: escapes.pack(v, w, 64))(values, words[0])))


# What a GPU of each compute capability (None: no GPU) runs the escapes with, per impl.
ESCAPES_BY_GPU = {
    None: dict(auto="xla", xla="xla", mosaic="xla", pallas="triton", triton="triton"),
    (8, 0): dict(auto="xla", xla="xla", mosaic="xla", pallas="triton", triton="triton"),
    (9, 0): dict(auto="xla", xla="xla", mosaic="xla", pallas="xla", triton="triton"),
    (10, 0): dict(auto="xla", xla="xla", mosaic="xla", pallas="xla", triton="triton"),
}


@pytest.mark.parametrize("capability", list(ESCAPES_BY_GPU), ids=str)
def test_dispatch_runs_the_kernels_only_on_triton(monkeypatch, capability):
    """The Triton kernels where the codec resolves to Triton ("triton"; "pallas" below Hopper
    and, interpreted, without a GPU), the jnp loops everywhere else ("auto" included: it never
    reaches Triton)."""
    from ciera_jax.kernels import backend, dispatch

    # As on that GPU without lowering_for (which clears JAX's caches: what the session compiled
    # so far would compile again).
    monkeypatch.setattr(backend, "gpu_capability", lambda: capability)
    calls = []
    monkeypatch.setattr(dispatch, "pack_pallas",
                        lambda *a, **kw: calls.append(kw) or escapes.pack(*a))
    values = jnp.arange(100, dtype=jnp.uint8)
    words = escapes.pack_flags(jnp.asarray(flags_of("sparse", 1, 100)))[0]
    for impl, want in ESCAPES_BY_GPU[capability].items():
        calls.clear()
        # eval_shape: traced (a fresh function each time), not compiled
        jax.eval_shape(lambda v, w: K.escape_pack(v, w, 10, impl=impl), values, words)
        assert K.escape_impl(impl) == want, impl
        assert calls == ([] if want == "xla" else [dict(interpret=capability is None)]), impl


def test_no_loop_under_jit():
    """The kernels trace under jit with the rest of a gather's jnp (no host sync, no loop)."""
    rng = np.random.default_rng(5)
    cached, section = _u8(rng, (2, N)), _u8(rng, (2, 100))
    words = escapes.pack_flags(jnp.asarray(flags_of("half", 2, N)))
    limit = jnp.asarray([100, 100], jnp.int32)
    fn = jax.jit(lambda c, w, s, l: K.fill_exponents_pallas(c, w, s, l, block=BLOCK,
                                                             interpret=INTERPRET))
    jaxpr = jax.make_jaxpr(fn)(cached, words, section, limit)
    assert "while" not in str(jaxpr)
    np.testing.assert_array_equal(
        np.asarray(fn(cached, words, section, limit)),
        np.asarray(K.escape_fill_exponents(cached, words, section, limit, impl="xla")))


def gather_fn(impl: str, axis: int = 0):
    """One compressed gather on the 8-device CPU mesh -> (full, new cache, stats), returned
    replicated, hence ``check_vma=False`` (as for ``lax.all_gather``; and Triton's CPU
    interpreter runs a kernel's body under the checks: test_cuda_lowering lowers the kernels
    in a checked ``shard_map``)."""
    from jax.sharding import PartitionSpec as P

    import ciera_jax

    mesh = jax.make_mesh((8,), ("fsdp",))
    spec = P(*[None] * axis, "fsdp")
    fn = jax.jit(jax.shard_map(
        lambda x, c: ciera_jax.all_gather(x, c, "fsdp", axis=axis, impl=impl), mesh=mesh,
        in_specs=(spec, P()), out_specs=(P(), P(), P()), check_vma=False))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return lambda x, c: fn(jax.device_put(x, sharding), c)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU mesh)")
@pytest.mark.slow  # ~20 s each: two gathers compiled, one with every kernel interpreted
@pytest.mark.parametrize("mode,shape,axis", [
    ("exponent", (8 * 16, 96), 0), ("word", (8 * 16, 96), 0),  # a ragged last block a shard
    ("exponent", (3, 8 * 2, 256), 1),  # off axis 0: the fused decode + checksum
    ("word", (2, 8 * 2, 2048), 1)])  # off axis 0: the word decode reads the cache in place
def test_gather_with_escape_kernels_matches_jnp(mode, shape, axis):
    """Whole gathers on the 8-device CPU mesh, ``impl="pallas"`` (every kernel in Triton's
    interpreter, the escape kernels included) against ``impl="xla"``: the same weights, caches
    and stats, bit for bit, over a priming step and steps with escapes (exponent changes; word
    moves, far ones raw); but the bytes sent, which off axis 0 in exponent mode hold the
    padding that aligns the wire's rows for the fused decode (less than one alignment)."""
    import ciera_jax
    from ciera_jax.codec import bitfields

    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape).astype(np.float32)
    xs = [x]
    for share, scale in ((0.02, 3.0), (0.2, 1e-2)):  # exponent flips; small and far moves
        hit = rng.random(shape) < share
        xs.append(np.where(hit, xs[-1] * (1 + scale * rng.standard_normal(shape)), xs[-1]))
    xs = [jnp.asarray(v, jnp.bfloat16) for v in xs]
    runs = {}
    for impl in ("pallas", "xla"):
        fn, out = gather_fn(impl, axis), []
        cache = ciera_jax.init_cache(shape, jnp.bfloat16, mode=mode)
        for v in xs:
            full, cache, stats = fn(v, cache)
            out.append((bitfields.to_bits(full), cache, stats))
        runs[impl] = out
    align = ciera_jax.kernels.row_align(shape, jnp.bfloat16, 8, axis=axis, impl="pallas")
    for step, (v, got, want) in enumerate(zip(xs, runs["pallas"], runs["xla"])):
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(bitfields.to_bits(v)),
                                      err_msg=f"step {step}")
        pad = int(got[2]["sent_bytes"]) - int(want[2]["sent_bytes"])
        assert 0 <= pad < max(align, 1) and (pad == 0 or mode == "exponent"), (step, pad)
        got[2]["sent_bytes"] = want[2]["sent_bytes"]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {step}")

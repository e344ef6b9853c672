"""Escapes with implied positions: packed flags, select by running count and popcount, pack
and fill, against numpy on any length (not only multiples of 32), any density, and more slots
than one loop chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ciera_jax.codec import escapes


@jax.jit
def _packed(flags_RxN):
    n = flags_RxN.shape[1]
    words = escapes.pack_flags(flags_RxN)
    slots = jnp.broadcast_to(jnp.arange(n + 2, dtype=jnp.int32), (flags_RxN.shape[0], n + 2))
    counted, pop = escapes.pack_flags_counted(flags_RxN)
    return (words, escapes.unpack_flags(words, n), escapes.count(words),
            escapes.select(words, escapes.running_count(words), slots),
            (counted, pop, escapes.running_count(words, pop), escapes.running_count(words)))


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_pack_and_run_is_the_pack_and_its_running_count(backend, monkeypatch):
    """Either way it is traced (a counting pack for an accelerator's short rows): the packed
    flags and the flags in words 0..w, against numpy, on rows of 1,000 elements."""
    monkeypatch.setattr(escapes.target, "traced_backend", lambda: backend)
    flags = np.random.default_rng(3).random((3, 1000)) < np.array([0.0, 0.3, 1.0])[:, None]
    words, running = jax.jit(escapes.pack_and_run)(jnp.asarray(flags))
    np.testing.assert_array_equal(np.asarray(words), np.asarray(escapes.pack_flags(flags)))
    padded = np.pad(flags, ((0, 0), (0, 24))).reshape(3, -1, 32)
    np.testing.assert_array_equal(np.asarray(running), np.cumsum(padded.sum(axis=2), axis=1))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 1000])
def test_flags_round_trip_count_and_select(n):
    """Three rows of different densities in one call (one compile per length); the pack that
    counts as it packs gives the same words and each word's popcount."""
    rng = np.random.default_rng(n)
    for densities in ([0.0, 0.3, 1.0], [0.01, 1.0, 0.3]):
        flags = rng.random((3, n)) < np.array(densities)[:, None]
        words, back, count, element, (counted, pop, running, want_running) = _packed(
            jnp.asarray(flags))
        assert words.shape == (3, -(-n // 32)) and words.dtype == jnp.uint32
        # the pack that also counts: the same words, each word's popcount, the same scan
        np.testing.assert_array_equal(np.asarray(counted), np.asarray(words))
        np.testing.assert_array_equal(np.asarray(pop), np.asarray(escapes.popcount(words)))
        np.testing.assert_array_equal(np.asarray(running), np.asarray(want_running))
        np.testing.assert_array_equal(np.asarray(back), flags)
        np.testing.assert_array_equal(np.asarray(count), flags.sum(axis=1))
        past_end = 32 * words.shape[1]
        for r in range(3):
            where = np.nonzero(flags[r])[0]
            want = np.full(n + 2, past_end)
            want[:len(where)] = where
            np.testing.assert_array_equal(np.asarray(element[r]), want)


def _roundtrip(values, flags, cap, walk):
    """pack on one row, fill on three rows made from it (the middle one flag-free)."""
    words = escapes.pack_flags(flags[None])[0]
    section = escapes.pack(values, words, cap, walk)
    rows_flags = jnp.stack([flags, jnp.zeros_like(flags), flags])
    rows_words = escapes.pack_flags(rows_flags)
    sections = jnp.stack([section, jnp.zeros_like(section), section])
    dest = jnp.full((3, values.shape[0]), 7, values.dtype)
    back = escapes.fill(dest, rows_words, jnp.full((3,), cap, jnp.int32),
                        lambda slot, _, __, c: (jnp.take_along_axis(
                            sections, jnp.minimum(slot, cap - 1), axis=1), c), walk=walk)
    return section, back


_ROUNDTRIP = jax.jit(_roundtrip, static_argnums=(2, 3))
# (elements, capacity): capacity above the element count, equal to it, and below it. Each shape
# and walk compiles once; the flag patterns below run through the same program.
PACK_SHAPES = [(5, 8), (64, 64), (777, 40)]


def _flag_patterns(rng, n, cap):
    """No flag, one, half the capacity, exactly the capacity (or every element, when that is
    fewer), at random positions; and a run of flags at the row's end (a partial last word)."""
    full = min(n, cap)
    for k in sorted({0, 1, full // 2, full}):
        flags = np.zeros(n, bool)
        flags[rng.choice(n, size=k, replace=False)] = True
        yield flags
    flags = np.zeros(n, bool)
    flags[n - max(full // 2, 1):] = True
    yield flags


# The walks a user's step compiles (walk_for): "dense", and "either", which takes the loop on the
# sparse patterns and the dense pass on the others. The loop forced alone is no extra path.
@pytest.mark.parametrize("walk", ["dense", "either"])
@pytest.mark.parametrize("n,cap", PACK_SHAPES, ids=[f"n{n}-cap{c}" for n, c in PACK_SHAPES])
def test_pack_lists_flagged_values_in_order_and_fill_puts_them_back(n, cap, walk):
    rng = np.random.default_rng(n)
    for flags in _flag_patterns(rng, n, cap):
        values = rng.integers(0, 1 << 16, n).astype(np.uint16)
        section, back = map(np.asarray, _ROUNDTRIP(jnp.asarray(values), jnp.asarray(flags),
                                                   cap, walk))
        k = int(flags.sum())
        np.testing.assert_array_equal(section[:k], values[flags])
        assert (section[k:] == 0).all(), "slots after the last flagged value stay zero"
        for r in (0, 2):
            np.testing.assert_array_equal(back[r], np.where(flags, values, 7))
        assert (back[1] == 7).all(), "a row without flags is left as it was"


@pytest.mark.parametrize("density", [0.1, 1.0], ids=["loop", "dense"])
def test_more_escapes_than_one_chunk(density):
    """Both ways through, as compiled for long rows on CPU (``either``): below DENSE_SHARE
    several trips of the slot loop (SLOT_CHUNK slots each, a partial last one included); above
    it one pass over every element."""
    assert (density > escapes.DENSE_SHARE) == (density == 1.0)
    n = 12 * escapes.SLOT_CHUNK + 1000
    rng = np.random.default_rng(3)
    flags = rng.random(n) < density
    values = rng.integers(0, 1 << 16, n).astype(np.uint16)
    cap = int(flags.sum())
    assert cap > escapes.SLOT_CHUNK and n >= escapes.LOOP_MIN
    assert escapes.walk_for(n) == "either"
    section, back = map(np.asarray, _ROUNDTRIP(jnp.asarray(values), jnp.asarray(flags), cap,
                                               None))
    np.testing.assert_array_equal(section, values[flags])
    np.testing.assert_array_equal(back[0], np.where(flags, values, 7))


@pytest.mark.parametrize("walk", ["dense", "either"])
def test_pack_rows_and_pack_nonzero_are_the_packs_they_replace(walk):
    """Two rows packed together (one bitmap and rank pass on the dense walk) give each row's
    own :func:`escapes.pack`, capacities short of the flags included; the nonzero words packed
    by their running count give :func:`escapes.pack_dense` over their summary bitmap."""
    n = 3000
    rng = np.random.default_rng(5)
    flags = np.stack([rng.random(n) < 0.3, rng.random(n) < 0.01])
    values = [rng.integers(0, 1 << 16, n).astype(np.uint16),
              rng.integers(-128, 128, n).astype(np.int8)]
    words = escapes.pack_flags(jnp.asarray(flags))
    running = escapes.running_count(words)
    caps = [int(flags[0].sum()) - 5, int(flags[1].sum()) + 3]
    got = escapes.pack_rows([jnp.asarray(v) for v in values], words, caps, running, walk)
    for g, v, w, c in zip(got, values, words, caps):
        want = escapes.pack(jnp.asarray(v), w, c, walk)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
        assert g.dtype == v.dtype
    nonzero = (words[1] != 0)
    want = escapes.pack_dense(words[1], escapes.pack_flags(nonzero[None])[0], 40)
    got = escapes.pack_nonzero(words[1], 40, escapes.running_count(
        nonzero.astype(jnp.uint32)[None])[0])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(nonzero.sum()) > 0


def test_pack_drops_what_does_not_fit():
    """More flags than capacity: the first ``capacity`` values, in order (the agreement sends
    such a step to the plain fallback, so what is dropped never matters)."""
    flags = jnp.ones((40,), jnp.bool_)
    values = jnp.arange(40, dtype=jnp.uint8)
    words = escapes.pack_flags(flags[None])[0]
    np.testing.assert_array_equal(np.asarray(escapes.pack(values, words, 8)), np.arange(8))


def test_walk_is_static_and_checked():
    """Short rows compile the dense pass alone; long rows on CPU both; a bad walk is named."""
    assert escapes.walk_for(escapes.LOOP_MIN - 1) == "dense"
    assert escapes.walk_for(escapes.LOOP_MIN) == "either"
    with pytest.raises(ValueError, match="walk must be one of"):
        escapes.pack(jnp.zeros((4,), jnp.uint8), jnp.zeros((1,), jnp.uint32), 2, "both")


@pytest.mark.parametrize("density", [0.002, 0.03, 0.3])
def test_window_finds_the_words_select_finds(density):
    """The loop's window (a scatter of each word's first slot and a running max) gives every
    covered chunk the words of the binary search, rows of different densities together; it
    says when a chunk runs past it."""
    rng = np.random.default_rng(int(density * 1000))
    n, chunk = 40_000, 256
    flags = rng.random((2, n)) < np.array([[density], [density / 3]])
    words = escapes.pack_flags(jnp.asarray(flags))
    running = escapes.running_count(words)
    for first in (0, 37, chunk * 3, int(flags[0].sum()) - 5):
        word, covered = jax.jit(escapes._window_words, static_argnums=3)(
            words, running, jnp.int32(first), chunk)
        slots = jnp.broadcast_to(first + jnp.arange(chunk, dtype=jnp.int32), (2, chunk))
        want = np.asarray(escapes.select(words, running, slots))
        got = np.asarray(escapes._in_word(words, running, slots, word))
        for r in range(2):
            span = np.nonzero(flags[r])[0]
            in_window = 32 * escapes.WINDOW * chunk
            if bool(covered[r]):
                np.testing.assert_array_equal(got[r], want[r])
            else:  # the window stops short of the chunk's last flag
                last = span[min(first + chunk, len(span)) - 1] if len(span) > first else 0
                start = span[first] if len(span) > first else 0
                assert last - (start - start % 32) >= in_window - 32


@pytest.mark.parametrize("rows,n", [(1, escapes.BLOCKED_SCAN_MIN + 1), (3, 8192),
                                    (2, 128 * escapes.BLOCKED_SCAN_MIN + 77)])
def test_blocked_running_count_is_the_cumsum(rows, n):
    """The blocked scan (what a GPU compile of a long row's ranks uses) equals the plain
    cumsum exactly, on rows that are not a whole number of blocks and need two levels."""
    rng = np.random.default_rng(n)
    x = rng.integers(0, 33, (rows, n)).astype(np.int32)
    x[0, -5:] = 32  # the last, partial block full
    got = jax.jit(escapes.blocked_prefix_sum)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.cumsum(x, axis=1, dtype=np.int64))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 450, 1024, 1025, escapes.CPU_BLOCKED_SCAN_MAX])
def test_cpu_running_count_is_the_cumsum_in_blocks_of_32(n):
    """On XLA:CPU a row of up to CPU_BLOCKED_SCAN_MAX words is counted in blocks of 32 (no
    cumsum in its program: XLA:CPU makes a cumsum a tree of reduce-windows, a thunk each),
    exactly the cumsum, full words and partial last blocks included; longer rows keep the
    cumsum."""
    rng = np.random.default_rng(n)
    words = rng.integers(0, 2**32, (3, n), dtype=np.uint32)
    words[0] = 0xFFFFFFFF  # every flag set: the largest counts
    words[1, -(n % 32 or 32):] = 0  # the last block empty
    jaxpr = str(jax.make_jaxpr(escapes.running_count)(jnp.asarray(words)))
    assert "cumsum" not in jaxpr
    got = jax.jit(escapes.running_count)(jnp.asarray(words))
    pop = np.vectorize(lambda w: bin(int(w)).count("1"))(words)
    np.testing.assert_array_equal(np.asarray(got), np.cumsum(pop, axis=1))
    longer = jnp.zeros((1, escapes.CPU_BLOCKED_SCAN_MAX + 1), jnp.uint32)
    assert "cumsum" in str(jax.make_jaxpr(escapes.running_count)(longer))


def test_running_count_traced_for_a_gpu_takes_the_blocked_scan():
    """Traced for a GPU, a long row's running count is the blocked scan (no cumsum at the
    row's length in its program), and counts what the host's cumsum counts."""
    from ciera_jax.runtime import target

    words = jnp.asarray(np.random.default_rng(1).integers(
        0, 2**32, (2, 2 * escapes.BLOCKED_SCAN_MIN), dtype=np.uint32))
    host = escapes.running_count(words)
    with target.tracing_for_gpu((9, 0)):
        f = jax.jit(escapes.running_count)
        on_gpu = str(jax.make_jaxpr(escapes.running_count)(words))
        got = f(words)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(host))
    n_blocks = 2 * escapes.BLOCKED_SCAN_MIN // escapes.SCAN_BLOCK
    assert "i32[2,8192] = cumsum" in str(jax.make_jaxpr(escapes.running_count)(words))
    assert "i32[2,8192] = cumsum" not in on_gpu and f"i32[2,{n_blocks}] = cumsum" in on_gpu


@pytest.mark.parametrize("n", [1, 33, 1000, escapes.BLOCKED_SCAN_MIN])
def test_a_short_row_traced_for_a_gpu_is_counted_by_one_masked_sum(n):
    """Traced for a GPU, a row of up to BLOCKED_SCAN_MIN words takes one masked sum (no
    cumsum: XLA:GPU's is a tree of kernels), exactly the host's count."""
    from ciera_jax.runtime import target

    words = np.random.default_rng(n).integers(0, 2**32, (3, n), dtype=np.uint32)
    words[0] = 0xFFFFFFFF  # every flag set: the largest counts
    words = jnp.asarray(words)
    host = escapes.running_count(words)
    with target.tracing_for_gpu((9, 0)):
        on_gpu = str(jax.make_jaxpr(escapes.running_count)(words))
        got = jax.jit(escapes.running_count)(words)
    assert "cumsum" not in on_gpu
    np.testing.assert_array_equal(np.asarray(got), np.asarray(host))

"""Escapes with implied positions: flags packed 32 to a word, work in proportion to the escapes.

A compressed gather sends a few values per tensor out of line (changed exponents, far word
moves) in position order; their positions are implied by a flag per element (the bitmap, or
the escape code in the code plane). The sender packs the flagged values into a capacity buffer;
the receiver puts every value back at its element.

Both walk the *slots* (the escapes, in order), not the elements. Slot ``j``'s element is found
in two steps: its 32-flag word, then a 5-step search inside the word by popcount. The word
comes from a window of words after the chunk's first slot (each word's first slot scattered
to its place, then a running max) wherever the chunk's slots lie in it, else from
:func:`select`'s binary search over the running count of flags per word (a scan over 1/32 of
the elements). The walk is a
loop over chunks of :data:`SLOT_CHUNK` slots whose trip count is the number of escapes, so a
step in which little changed costs little, and a gather or scatter of every element (what
XLA:CPU runs 1-2 orders of magnitude slower than a copy) happens only where escapes are dense
(above :data:`DENSE_SHARE` of the elements: warm-up), where it is the cheaper of the two.

Which walks are compiled is static, per call (:func:`walk_for`): the loop exists only on CPU
and for rows of at least :data:`LOOP_MIN` elements; short rows and accelerators compile the
dense pass alone (one walk, not two under a ``cond``, is what keeps the compile short).

Shape letters: R rows (one per rank on the receiver, 1 on the sender), n elements per row,
W = ceil(n/32) flag words per row, S slots per chunk, C a capacity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.runtime import target
from ciera_jax.runtime.varying import same_types, typed_cond
from ciera_jax.codec.wire import FLAG_WORD_BITS

SLOT_CHUNK = 4096  # slots per loop trip: a few loop overheads per tensor at steady state
# Above this share of escapes in the fullest row, one pass over every element (a gather or
# scatter per element) beats the loop, whose cost per escape is several times an element's.
DENSE_SHARE = 1 / 8
# Rows shorter than this compile the dense pass only: there the loop saves less time a call
# than it costs in compile per tensor.
LOOP_MIN = 1 << 15
# A loop trip finds its slots' words in a window of this many words per slot (where escapes
# are denser than 1 in 32 * WINDOW), by one scatter and a running max, not a binary search
# per slot (a gather per level of the search). A window of 4 words suits the steady state's
# sparse escapes; a window of 1 only the densest rows.
WINDOW = 4
# Rows of more flag words than this take a blocked running count when traced for an
# accelerator (blocked_prefix_sum, SCAN_BLOCK words a block): fewer kernels than XLA's cumsum.
BLOCKED_SCAN_MIN = 4096
SCAN_BLOCK = 128
# XLA:CPU splits a reduction over more than 32 elements, and a cumsum, into trees of
# reduce-windows, pads and slices, a thunk each; in blocks of 32 a running count is two or
# three fusions, fewer kernels a step than XLA's trees. Its work is
# 32 adds a word, so rows of more words keep XLA's cumsum.
CPU_SCAN_BLOCK = 32
CPU_BLOCKED_SCAN_MAX = 4096
WALKS = ("dense", "loop", "either")


def walk_for(n: int) -> str:
    """The walk to compile for rows of ``n`` elements: ``"either"`` (both under a ``cond``, the
    cheaper one taken at run time) when tracing for a CPU (:mod:`ciera_jax.runtime.target`:
    not in a compile for a GPU that is not here) for rows of at least :data:`LOOP_MIN`, else
    ``"dense"``. Not the loop on an accelerator: XLA runs a gather or scatter of every element
    at memory bandwidth there, and a loop whose trip count is data would cost a device-to-host
    sync per trip."""
    return "either" if n >= LOOP_MIN and target.traced_backend() == "cpu" else "dense"


def _walk(pred_dense, dense, by_loop, walk: str | None, n: int):
    walk = walk_for(n) if walk is None else walk
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS} or None, got {walk!r}")
    if walk == "dense":
        return dense()
    if walk == "loop":
        return by_loop()
    return typed_cond(pred_dense(), dense, by_loop)


def _lanes():
    return jnp.arange(FLAG_WORD_BITS, dtype=jnp.uint32)


def _by_word(flags_RxN: jax.Array) -> jax.Array:
    """bool (R, n) -> (R, W, 32): each word's flags, zero-padded past ``n``."""
    rows, n = flags_RxN.shape
    pad = -n % FLAG_WORD_BITS
    return jnp.pad(flags_RxN, ((0, 0), (0, pad))).reshape(rows, -1, FLAG_WORD_BITS)


def pack_flags(flags_RxN: jax.Array) -> jax.Array:
    """bool (R, n) -> uint32 (R, W): element ``32*w + i`` is bit ``i`` of word ``w``."""
    shifted = _by_word(flags_RxN).astype(jnp.uint32) << _lanes()
    return lax.reduce(shifted, jnp.uint32(0), lax.bitwise_or, (2,))


def pack_flags_counted(flags_RxN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`pack_flags` and each word's popcount, int32 (R, W), in ONE reduction: the count
    is the sum of the word's flags, so what reads the counts (a running count) needs no
    popcount pass of its own (a kernel on a GPU)."""
    f = _by_word(flags_RxN)
    shifted = f.astype(jnp.uint32) << _lanes()

    def both(a, b):
        return lax.bitwise_or(a[0], b[0]), a[1] + b[1]

    return lax.reduce((shifted, f.astype(jnp.int32)), (jnp.uint32(0), jnp.int32(0)), both,
                      (2,))


def pack_and_run(flags_RxN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`pack_flags` and its :func:`running_count`. Traced for an accelerator, on rows
    whose running count is one masked sum (at most :data:`BLOCKED_SCAN_MIN` words), the pack
    also counts (:func:`pack_flags_counted`): the popcounts would be a kernel of their own
    there. Longer rows' blocked scan reads the popcounts in its first kernel, and a counting
    pack would make what produces the flags a kernel of its own instead."""
    n_words = -(-flags_RxN.shape[1] // FLAG_WORD_BITS)
    if target.traced_backend() != "cpu" and n_words <= BLOCKED_SCAN_MIN:
        words, pop = pack_flags_counted(flags_RxN)
        return words, running_count(words, pop)
    words = pack_flags(flags_RxN)
    return words, running_count(words)


def unpack_flags(words_RxW: jax.Array, n: int) -> jax.Array:
    """Inverse of :func:`pack_flags`: uint32 (R, W) -> bool (R, n)."""
    rows = words_RxW.shape[0]
    bits = (words_RxW[:, :, None] >> _lanes()) & jnp.uint32(1)
    return bits.reshape(rows, -1)[:, :n].astype(jnp.bool_)


def popcount(words):
    """Set bits of each unsigned word, int32."""
    return lax.population_count(words).astype(jnp.int32)


def count(words_RxW: jax.Array) -> jax.Array:
    """Flags per row, int32 (R,)."""
    return jnp.sum(popcount(words_RxW), axis=1)


def running_count(words_RxW: jax.Array, pop_RxW=None) -> jax.Array:
    """int32 (R, W): flags in words ``0..w`` of each row (an inclusive scan over words).
    ``pop_RxW``: each word's popcount, where the caller has it (:func:`pack_flags_counted`)."""
    pop = popcount(words_RxW) if pop_RxW is None else pop_RxW
    words = words_RxW.shape[1]
    if target.traced_backend() == "cpu":
        if words <= CPU_BLOCKED_SCAN_MAX:
            return blocked_prefix_sum(pop, CPU_SCAN_BLOCK, base=CPU_SCAN_BLOCK)
        # cumsum: XLA rewrites it into a few kernels; lax.associative_scan compiles to ~60.
        return jnp.cumsum(pop, axis=1, dtype=jnp.int32)
    if words > BLOCKED_SCAN_MIN:
        return blocked_prefix_sum(pop)
    # one masked sum over the row (W**2 adds), where XLA's cumsum is a tree of kernels
    return _masked_prefix(pop[:, None, :])[:, 0, :]


def blocked_prefix_sum(x_RxW: jax.Array, block: int = SCAN_BLOCK,
                       base: int = BLOCKED_SCAN_MIN) -> jax.Array:
    """int32 (R, W): the inclusive running sum of each row, by blocks of ``block``: inside a
    block a masked sum per element (one reduction, which XLA fuses with what produces ``x``),
    then the blocks' totals the same way, recursively, down to rows of ``base``, which take
    XLA's cumsum, or one block's masked sum where ``base`` is a block (XLA:CPU's case).

    XLA:GPU turns a cumsum into a tree of 16-wide ``reduce_window`` levels, a kernel each;
    this is 2 kernels up to ``block * BLOCKED_SCAN_MIN``. Its work is ``W * block`` adds,
    which a GPU does not notice and XLA:CPU runs many times slower than its cumsum on long
    rows: XLA:CPU takes it for rows of up
    to :data:`CPU_BLOCKED_SCAN_MAX` words, in blocks of 32 (:func:`running_count`)."""
    rows, n = x_RxW.shape
    if n <= block and base <= block:
        return _masked_prefix(x_RxW[:, None, :])[:, 0, :]
    if n <= base:  # XLA's tree is as short here, and fuses into what reads it
        return jnp.cumsum(x_RxW, axis=1, dtype=jnp.int32)
    x_RxBxK = jnp.pad(x_RxW, ((0, 0), (0, -n % block))).reshape(rows, -1, block)
    inclusive = _masked_prefix(x_RxBxK)
    totals_RxB = inclusive[:, :, -1]
    before_RxB = blocked_prefix_sum(totals_RxB, block, base) - totals_RxB
    return (inclusive + before_RxB[:, :, None]).reshape(rows, -1)[:, :n]


def _masked_prefix(x_RxBxK: jax.Array) -> jax.Array:
    """Inclusive running sums inside the last axis: element ``i`` sums elements ``j <= i``."""
    k = x_RxBxK.shape[-1]
    upto = (lax.broadcasted_iota(jnp.int32, (k, k), 1)
            <= lax.broadcasted_iota(jnp.int32, (k, k), 0))
    return jnp.sum(jnp.where(upto, x_RxBxK[:, :, None, :], 0), axis=3, dtype=jnp.int32)


def ranks(words_RxW: jax.Array, n: int, running_RxW=None) -> jax.Array:
    """int32 (R, n): for every element, the number of flags before it in its row."""
    rows = words_RxW.shape[0]
    if running_RxW is None:
        running_RxW = running_count(words_RxW)
    before_word = running_RxW - popcount(words_RxW)
    below_lane = (jnp.uint32(1) << _lanes()) - jnp.uint32(1)
    in_word = popcount(words_RxW[:, :, None] & below_lane)
    return (before_word[:, :, None] + in_word).reshape(rows, -1)[:, :n]


def pack_dense(values_N: jax.Array, words_W: jax.Array, capacity: int,
               running_W=None) -> jax.Array:
    """:func:`pack` by one scatter of every element: for short arrays (the flag words of the
    two-level bitmap, 1/32 of a tensor) and dense flags, where a loop costs more."""
    n = values_N.shape[0]
    flags = unpack_flags(words_W[None], n)[0]
    running = None if running_W is None else running_W[None]
    slot = jnp.where(flags, ranks(words_W[None], n, running)[0], capacity)
    return jnp.zeros((capacity,), values_N.dtype).at[slot].set(values_N, mode="drop")


def pack_nonzero(words_W: jax.Array, capacity: int, running_W: jax.Array) -> jax.Array:
    """The nonzero words in order in a (capacity,) buffer, zeros after the last: exactly
    :func:`pack_dense` of ``words_W`` flagged by ``words_W != 0``, given ``running_W``, the
    running count of the nonzero words (one scatter of the words, no bitmap of them)."""
    slot = jnp.where(words_W != 0, running_W - 1, capacity)
    return jnp.zeros((capacity,), words_W.dtype).at[slot].set(words_W, mode="drop")


def expand_dense(section_RxC: jax.Array, words_RxW: jax.Array, n: int) -> jax.Array:
    """Inverse of :func:`pack_dense` per row: (R, n), each flagged element's value, zero
    elsewhere."""
    if section_RxC.shape[1] == 0:
        return jnp.zeros((words_RxW.shape[0], n), section_RxC.dtype)
    slot = jnp.minimum(ranks(words_RxW, n), section_RxC.shape[1] - 1)
    got = jnp.take_along_axis(section_RxC, slot, axis=1)
    return jnp.where(unpack_flags(words_RxW, n), got, jnp.zeros((), got.dtype))


def select(words_RxW: jax.Array, running_RxW: jax.Array, slot_RxS: jax.Array) -> jax.Array:
    """int32 (R, S): the element of each row's ``slot``-th flag (0-based), or
    ``32 * W`` where the row has no such flag. ``running_RxW``: :func:`running_count`."""
    # The first word whose running count passes the slot.
    lo = jax.vmap(lambda r, s: jnp.searchsorted(r, s, side="right", method="scan"))(
        running_RxW, slot_RxS).astype(jnp.int32)
    return _in_word(words_RxW, running_RxW, slot_RxS, lo)


def _in_word(words_RxW, running_RxW, slot_RxS, word_RxS):
    """:func:`select` given each slot's word (``W`` where the row has no such flag): the lane
    of the flag inside its word, by a 5-step popcount search."""
    n_words = words_RxW.shape[1]
    take = lambda a, i: jnp.take_along_axis(a, i, axis=1, mode="clip")  # noqa: E731
    w = jnp.minimum(word_RxS, n_words - 1)
    word = take(words_RxW, w)
    k = slot_RxS - (take(running_RxW, w) - popcount(word))  # the flag's rank in its word
    # The lowest lane whose lanes 0..lane hold more than k flags.
    lane = jnp.zeros_like(slot_RxS)
    for step in (16, 8, 4, 2, 1):
        below = word & ((jnp.uint32(1) << (lane + step).astype(jnp.uint32)) - 1)
        lane = jnp.where(popcount(below) <= k, lane + step, lane)
    return jnp.where(word_RxS < n_words, FLAG_WORD_BITS * w + lane, FLAG_WORD_BITS * n_words)


def _window_words(words_RxW, running_RxW, first, chunk: int):
    """The word of each of the consecutive slots ``first .. first + chunk - 1`` of every row,
    from a window of ``min(WINDOW * chunk, W)`` words starting at the word of slot ``first``: each
    word's first slot scattered to its place, then a running max (no search per slot).
    Returns ((R, chunk) words, W past the row's flags; (R,) whether the window held every slot
    of the chunk the row has)."""
    n_words = words_RxW.shape[1]
    size = min(WINDOW * chunk, n_words)

    def one(words_W, running_W):
        start = jnp.searchsorted(running_W, first, side="right", method="scan")
        start = jnp.minimum(start, n_words - size).astype(jnp.int32)
        run = lax.dynamic_slice(running_W, (start,), (size,), allow_negative_indices=False)
        pop = popcount(lax.dynamic_slice(words_W, (start,), (size,),
                                          allow_negative_indices=False))
        rel = run - pop - first  # each word's first slot, relative to the chunk
        holds = (pop > 0) & (rel + pop > 0) & (rel < chunk)
        at = jnp.where(holds, jnp.maximum(rel, 0), chunk)
        first_words = jnp.full((chunk,), -1, jnp.int32).at[at].set(
            jnp.arange(size, dtype=jnp.int32), mode="drop")
        word = lax.cummax(first_words, axis=0)
        slot = first + jnp.arange(chunk, dtype=jnp.int32)
        word = jnp.where((slot < run[-1]) & (word >= 0), start + word, n_words)
        covered = (run[-1] >= first + chunk) | (start + size == n_words)
        return word, covered

    return jax.vmap(one)(words_RxW, running_RxW)


def take(section_RxC: jax.Array, slot_RxS: jax.Array) -> jax.Array:
    """Each row's entries at ``slot_RxS`` (clamped: mask slots that are not live)."""
    return jnp.take_along_axis(section_RxC, slot_RxS, axis=1, mode="clip")


def _chunk(words_RxW) -> int:
    """Slots per loop trip: SLOT_CHUNK, or fewer for a short row (a trip costs its size)."""
    return min(SLOT_CHUNK, FLAG_WORD_BITS * words_RxW.shape[1])


def for_each_chunk(words_RxW: jax.Array, limit_R, body, init, running=None):
    """Run ``body(slot_RxS, element_RxS, live_RxS, carry) -> carry`` over the slots of every row
    in chunks of up to :data:`SLOT_CHUNK`, for as many chunks as the fullest row needs: slot
    ``j`` of row ``r`` is live when the row has a ``j``-th flag and ``j < limit_R[r]``
    (``limit_R``: int32 (R,), or an int for every row). The body
    must leave the carry as it is where no slot is live."""
    if running is None:
        running = running_count(words_RxW)
    total_R = jnp.minimum(running[:, -1], limit_R)
    chunk = _chunk(words_RxW)
    trips = (jnp.max(total_R) + chunk - 1) // chunk

    def step(i, carry):
        # The iota made inside the body: captured from outside, XLA:CPU runs the body 4x slower.
        slot = jnp.broadcast_to(i * chunk + jnp.arange(chunk, dtype=jnp.int32),
                                (words_RxW.shape[0], chunk))
        live = slot < total_R[:, None]
        # Where the chunk's slots lie in a window of WINDOW * chunk words: their words by one
        # scatter and a running max; else a binary search each.
        word, covered = _window_words(words_RxW, running, i * chunk, chunk)
        element = typed_cond(jnp.all(covered),
                             lambda: _in_word(words_RxW, running, slot, word),
                             lambda: select(words_RxW, running, slot))
        return body(slot, element, live, carry)

    if same_types(jax.eval_shape(step, 0, init), init):
        return lax.fori_loop(0, trips, step, init)
    # The body's values vary over more mesh axes than the constant the carry starts from: run
    # the first trip outside the loop (a no-op when nothing is live) and carry its result,
    # which has the loop's type. (Not a cast: inside a vmapped cond's branch it fails.)
    return lax.fori_loop(1, jnp.maximum(trips, 1), step, step(0, init))


@dataclasses.dataclass(frozen=True)
class PerElement:
    """A sender's values defined element by element: ``at(index_S) -> values_S`` for int32
    indices in ``[0, n)``. The loop then computes values at the escapes only, where an array
    would be a whole-tensor pass written to be read at a few elements."""

    n: int
    dtype: Any
    at: Callable[[jax.Array], jax.Array]
    # every element's value at once, where the caller has it without indexing (``at`` of
    # every index is a gather of every element, which XLA does not turn back into a read)
    every: Callable[[], jax.Array] | None = None

    @classmethod
    def of(cls, values_N: jax.Array) -> "PerElement":
        return cls(values_N.shape[0], values_N.dtype, lambda i: values_N[i], lambda: values_N)

    def whole(self) -> jax.Array:
        """Every element's value (the dense walk, and kernels that take arrays)."""
        if self.every is not None:
            return self.every().astype(self.dtype)
        return self.at(jnp.arange(self.n, dtype=jnp.int32)).astype(self.dtype)


def _dense(running_RxW, n: int, limit_R) -> jax.Array:
    """Whether the fullest row's escapes are dense enough that one pass over every element
    beats the loop over escapes (rank-varying: each device decides for itself)."""
    return jnp.max(jnp.minimum(running_RxW[:, -1], limit_R)) > int(n * DENSE_SHARE)


def pack(values: jax.Array | PerElement, words_W: jax.Array, capacity: int,
         walk: str | None = None, running_W=None) -> jax.Array:
    """Sender: the values of the flagged elements (``values``: (n,), or :class:`PerElement`;
    ``words_W``: the flags, packed) in position order, in a (capacity,) buffer, zeros after the
    last (flags past ``capacity`` are dropped: the agreement sends such a step to the
    fallback). ``walk``: one of :data:`WALKS`, or None for :func:`walk_for`; ``running_W``:
    :func:`running_count` of ``words_W``, when the caller has it."""
    if not isinstance(values, PerElement):
        values = PerElement.of(values)
    if capacity == 0:
        return jnp.zeros((0,), values.dtype)
    n = values.n
    padded = -(-capacity // _chunk(words_W[None])) * _chunk(words_W[None])
    running = running_count(words_W[None]) if running_W is None else running_W[None]

    def body(slot, element, live, out):
        v = jnp.where(live[0], values.at(jnp.minimum(element[0], n - 1)), 0)
        return lax.dynamic_update_slice(out, v.astype(out.dtype), (slot[0, 0],),
                                        allow_negative_indices=False)

    def by_loop():
        # Zeros typed like what the body writes, so the loop needs no first trip outside it.
        probe = values.at(jnp.zeros((1,), jnp.int32)).astype(values.dtype)
        zeros = (jnp.zeros_like(probe, shape=(padded,))
                 + jnp.zeros_like(words_W, shape=(), dtype=values.dtype))
        out = for_each_chunk(words_W[None], capacity, body, zeros, running)
        return out[:capacity]

    def dense():
        return pack_dense(values.whole(), words_W, capacity, running[0])

    return _walk(lambda: _dense(running, n, capacity), dense, by_loop, walk, n)


def pack_rows(values: list, words_RxW: jax.Array, capacities: list[int],
              running_RxW: jax.Array, walk: str | None = None) -> list[jax.Array]:
    """:func:`pack` of ``values[r]`` flagged by row ``r`` of ``words_RxW`` (one length; its
    running count ``running_RxW``) at ``capacities[r]``, for every row. On the dense walk the
    rows share one unpacking of the flags and one rank pass (a kernel each for all rows, not
    per row); else one pack per row."""
    values = [v if isinstance(v, PerElement) else PerElement.of(v) for v in values]
    n = values[0].n
    walk = walk_for(n) if walk is None else walk
    if walk != "dense" or 0 in capacities:
        return [pack(v, w, c, walk, r)
                for v, w, c, r in zip(values, words_RxW, capacities, running_RxW)]
    flags_RxN = unpack_flags(words_RxW, n)
    slot_RxN = ranks(words_RxW, n, running_RxW)
    return [jnp.zeros((c,), v.dtype).at[jnp.where(f, s, c)].set(v.whole(), mode="drop")
            for v, f, s, c in zip(values, flags_RxN, slot_RxN, capacities)]


def fill(dest_RxN: jax.Array, words_RxW: jax.Array, limit_R: jax.Array, values_at, init=None,
         walk: str | None = None, running_RxW=None):
    """Receiver: ``dest_RxN`` with each row's flagged elements set, in order, to
    ``values_at(slot_RxS, current_RxS, live_RxS, carry) -> (values_RxS, carry)``: the slots'
    values (read from the row's section), given what ``dest`` holds at their elements now;
    ``carry`` starts at ``init``. Dense escapes take one pass over every element instead, with
    the same ``values_at`` called once on whole rows. ``walk``: as :func:`pack`;
    ``running_RxW``: :func:`running_count` of ``words_RxW``, when the caller has it."""
    n = dest_RxN.shape[1]
    rows = jnp.arange(dest_RxN.shape[0])[:, None]
    running = running_count(words_RxW) if running_RxW is None else running_RxW

    def body(slot, element, live, state):
        dest, carry = state
        values, carry = values_at(slot, take(dest, element), live, carry)
        at = jnp.where(live, element, n)  # past the end: dropped
        return dest.at[rows, at].set(values.astype(dest.dtype), mode="drop"), carry

    def by_loop():
        return for_each_chunk(words_RxW, limit_R, body, (dest_RxN, init), running)[0]

    def dense():
        slot = ranks(words_RxW, n, running)
        live = unpack_flags(words_RxW, n) & (slot < limit_R[:, None])
        values, _ = values_at(slot, dest_RxN, live, init)
        return jnp.where(live, values.astype(dest_RxN.dtype), dest_RxN)

    return _walk(lambda: _dense(running, n, limit_R), dense, by_loop, walk, n)

"""The wire's escapes as dense, blockwise Pallas kernels (Triton): the sender's pack and the
receivers' fills, one pass each, no loop over the escapes.

:mod:`ciera_jax.codec.escapes` walks the escapes (a loop whose trip count is their number: the right
shape for XLA:CPU). On a GPU a loop with a dynamic trip count syncs with the host every trip,
so here every element is visited once, a block of ``block`` elements (``block / 32`` flag
words) per program:

- a block's first rank, ``offset``, is the exclusive running sum of the blocks' flag counts
  (:func:`block_offsets`, jnp, over 1/32 of the elements, outside the kernel);
- inside the block, element ``32 * w + i``'s rank is ``offset`` + the flags of the block's
  words before ``w`` (a scan over ``block / 32`` popcounts) + ``popcount(word & lanes below
  i)``; flagged elements are exactly those whose bit ``i`` of word ``w`` is set.

Then the sender stores each flagged value at ``out[rank]`` (a masked scatter into a zeroed
buffer aliased into the kernel) and a receiver reads ``section[row, rank]`` (a masked gather)
where the element is flagged and ``rank < limit``, keeping the dense value elsewhere.
Results are bit for bit :func:`ciera_jax.codec.escapes.pack` / :func:`ciera_jax.codec.escapes.fill`.

Backend: Triton only. Pallas on Mosaic GPU (JAX 0.10.2's sources) has no per-element gather
or scatter: a ref indexed by an array fails ("Arrays are not supported as indices"),
``lax.gather`` has no lowering rule, and its one indexed copy is the TMA row gather (whole rows
of a 2-D array into shared memory), not a value per lane. ``kernels.dispatch`` runs these
kernels wherever the codec's kernels resolve to Triton, and the jnp loops elsewhere.

Shape letters: R rows, n elements per row, W flag words per row, B blocks per row, K / C1 / C2
section capacities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.codec import wordcodec
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import TRITON_WARPS
from ciera_jax.runtime.varying import kernel_out_types
from ciera_jax.codec.wire import FLAG_WORD_BITS

ESCAPE_BLOCK = 4096  # elements per program: 128 flag words; a power of two, >= 32
BITS = FLAG_WORD_BITS


def block_offsets(words_RxW: jax.Array, block: int) -> jax.Array:
    """int32 (R, B): the flags of each row before each block of ``block`` elements."""
    per = block // BITS
    rows, n_words = words_RxW.shape
    pad = -n_words % per
    w = jnp.pad(words_RxW, ((0, 0), (0, pad))).reshape(rows, -1, per)
    counts = jnp.sum(lax.population_count(w).astype(jnp.int32), axis=2)
    return jnp.cumsum(counts, axis=1, dtype=jnp.int32) - counts


def popcount32(x):
    """int32 set bits of each uint32, by shifts, masks and one multiply: Triton (3.6, JAX
    0.11.2 on an H200) cannot lower ``lax.population_count`` in a kernel ("failed to legalize
    operation 'math.ctpop'")."""
    x = x - ((x >> 1) & jnp.uint32(0x55555555))
    x = (x & jnp.uint32(0x33333333)) + ((x >> 2) & jnp.uint32(0x33333333))
    x = (x + (x >> 4)) & jnp.uint32(0x0F0F0F0F)
    return ((x * jnp.uint32(0x01010101)) >> 24).astype(jnp.int32)


def _ranks_in_block(words, offset):
    """(flag, rank) of a block's elements laid out (block/32, 32): ``words`` uint32
    (block/32,), ``offset`` the block's first rank (int32 scalar)."""
    per = words.shape[0]
    lane = lax.broadcasted_iota(jnp.uint32, (per, BITS), 1)
    word = jnp.broadcast_to(words[:, None], (per, BITS))
    flag = ((word >> lane) & jnp.uint32(1)) != jnp.uint32(0)
    below = word & ((jnp.uint32(1) << lane) - jnp.uint32(1))
    in_word = popcount32(below)
    counts = popcount32(words)
    before = jnp.cumsum(counts) - counts  # flags of the block's earlier words
    return flag, offset + before[:, None] + in_word


def _rows_of_words(x_Rxn: jax.Array, block: int) -> jax.Array:
    """(R, n) -> (R, n_pad / 32, 32), zero-padded to whole blocks."""
    rows, n = x_Rxn.shape
    pad = _layout.padded_size(n, block) - n
    return jnp.pad(x_Rxn, ((0, 0), (0, pad))).reshape(rows, -1, BITS)


def _words_padded(words_RxW: jax.Array, block: int) -> jax.Array:
    per = block // BITS
    return jnp.pad(words_RxW, ((0, 0), (0, -words_RxW.shape[1] % per)))


def _call(kernel, out_shape, in_specs, out_specs, grid, *, interpret, name, aliases=None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    return lambda *args: pl.pallas_call(
        kernel, out_shape=kernel_out_types(out_shape, args), grid=grid, in_specs=in_specs,
        out_specs=out_specs, input_output_aliases=aliases or {},
        compiler_params=pltriton.CompilerParams(num_warps=TRITON_WARPS, num_stages=1),
        interpret=interpret, name=name)(*args)


def _check(block: int, backend: str | None):
    _layout.check_block(block)
    if block < BITS:
        raise ValueError(f"escape blocks hold whole flag words: block {block} < {BITS}")
    if backend not in (None, "triton"):
        raise ValueError(f"the escape kernels exist on Triton only, not {backend!r} "
                         "(Mosaic GPU has no per-element gather/scatter)")


# --- the sender: pack ------------------------------------------------------------------------


def pack_pallas(values_N: jax.Array, words_W: jax.Array, capacity: int, *,
                block: int = ESCAPE_BLOCK, backend: str | None = None,
                interpret: bool = False) -> jax.Array:
    """:func:`ciera_jax.codec.escapes.pack`: the flagged values in position order in a (capacity,)
    buffer, zeros after the last, flags past ``capacity`` dropped."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    _check(block, backend)
    n = values_N.shape[0]
    if capacity == 0 or n == 0:
        return jnp.zeros((capacity,), values_N.dtype)
    per = block // BITS
    vals = _rows_of_words(values_N[None], block)[0]
    words = _words_padded(words_W[None], block)[0]
    offs = block_offsets(words[None], block)[0]
    programs = vals.shape[0] // per

    def kernel(vals_ref, words_ref, offs_ref, _, out_ref):
        flag, rank = _ranks_in_block(words_ref[...], offs_ref[0])
        keep = flag & (rank < capacity)
        # Masked-off lanes aim at the spare last slot: a masked store does not write on a GPU,
        # but Triton's interpreter writes back what it read there.
        pltriton.store(out_ref.at[jnp.where(keep, rank, capacity)], vals_ref[...], mask=keep)

    size = capacity + 1
    call = _call(
        kernel, jax.ShapeDtypeStruct((size,), values_N.dtype),
        in_specs=[pl.BlockSpec((per, BITS), lambda i: (i, 0)),
                  pl.BlockSpec((per,), lambda i: (i,)),
                  pl.BlockSpec((1,), lambda i: (i,)),
                  pl.BlockSpec((size,), lambda i: (0,))],
        out_specs=pl.BlockSpec((size,), lambda i: (0,)), grid=(programs,),
        interpret=interpret, name=f"ciera_escape_pack_{jnp.dtype(values_N.dtype).name}",
        aliases={3: 0})
    return call(vals, words, offs, jnp.zeros((size,), values_N.dtype))[:capacity]


# --- the receivers: fill ---------------------------------------------------------------------


def fill_exponents_pallas(cached_Rxn: jax.Array, flags_RxW: jax.Array, section_RxK: jax.Array,
                          limit_R: jax.Array, *, block: int = ESCAPE_BLOCK,
                          backend: str | None = None, interpret: bool = False) -> jax.Array:
    """Exponent mode's receiver: ``where(flag, section[row, rank], cached)`` for every element
    whose rank is below its row's ``limit_R`` (uint8 (R, n)); :func:`ciera_jax.codec.escapes.fill`
    with the section's values."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    _check(block, backend)
    rows, n = cached_Rxn.shape
    k = section_RxK.shape[1]
    if k == 0 or n == 0:
        return cached_Rxn
    per = block // BITS
    cached = _rows_of_words(cached_Rxn, block)
    words = _words_padded(flags_RxW, block)
    offs = block_offsets(words, block)
    limit = limit_R.astype(jnp.int32)
    programs = cached.shape[1] // per

    def kernel(cached_ref, words_ref, offs_ref, limit_ref, section_ref, out_ref):
        flag, rank = _ranks_in_block(words_ref[...], offs_ref[0])
        live = flag & (rank < limit_ref[0])
        at = jnp.where(live, jnp.minimum(rank, k - 1), 0)  # clamped, as escapes.take
        got = pltriton.load(section_ref.at[at], mask=live, other=0)
        out_ref[...] = jnp.where(live, got, cached_ref[...])

    block_rows = pl.BlockSpec((None, per, BITS), lambda r, i: (r, i, 0))
    call = _call(
        kernel, jax.ShapeDtypeStruct(cached.shape, cached.dtype),
        in_specs=[block_rows,
                  pl.BlockSpec((None, per), lambda r, i: (r, i)),
                  pl.BlockSpec((None, 1), lambda r, i: (r, i)),
                  pl.BlockSpec((1,), lambda r, i: (r,)),
                  pl.BlockSpec((None, k), lambda r, i: (r, 0))],
        out_specs=block_rows, grid=(rows, programs), interpret=interpret,
        name="ciera_escape_fill_exponents")
    out = call(cached, words, offs, limit, section_RxK.astype(cached.dtype))
    return out.reshape(rows, -1)[:, :n]


def raw_ranks(level1_RxC: jax.Array, level2_code: int) -> jax.Array:
    """int32 (R, C1): for each level-1 entry, the ``level2_code`` entries before it in its row
    (a raw word's place in level 2)."""
    raw = (level1_RxC == level2_code).astype(jnp.int32)
    return jnp.cumsum(raw, axis=1, dtype=jnp.int32) - raw


def fill_words_pallas(dense_Rxn: jax.Array, flags_RxW: jax.Array, level1_RxC: jax.Array,
                      level2_RxC: jax.Array, limit_R: jax.Array, *, escape_offset: int,
                      level2_code: int, block: int = ESCAPE_BLOCK, backend: str | None = None,
                      interpret: bool = False) -> jax.Array:
    """Word mode's receiver: each flagged element of rank ``s < limit`` becomes level 2's raw
    word (``level1[s] == level2_code``; its place in level 2 is the count of such entries before
    ``s``) or its dense word moved by ``level1[s] - escape_offset``; every other element keeps
    its dense word. Unsigned words (R, n)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    _check(block, backend)
    rows, n = dense_Rxn.shape
    c1, c2 = level1_RxC.shape[1], level2_RxC.shape[1]
    if c1 == 0 or n == 0:
        return dense_Rxn
    per = block // BITS
    word_t = dense_Rxn.dtype
    dense = _rows_of_words(dense_Rxn, block)
    words = _words_padded(flags_RxW, block)
    offs = block_offsets(words, block)
    limit = limit_R.astype(jnp.int32)
    raw_before = raw_ranks(level1_RxC, level2_code)
    level2 = level2_RxC if c2 else jnp.zeros((rows, 1), word_t)
    c2 = level2.shape[1]

    def kernel(dense_ref, words_ref, offs_ref, limit_ref, level1_ref, before_ref, level2_ref,
               out_ref):
        flag, rank = _ranks_in_block(words_ref[...], offs_ref[0])
        live = flag & (rank < limit_ref[0])
        at = jnp.where(live, jnp.minimum(rank, c1 - 1), 0)  # clamped, as escapes.take
        move = pltriton.load(level1_ref.at[at], mask=live, other=0).astype(jnp.int32)
        raw = live & (move == level2_code)
        raw_at = pltriton.load(before_ref.at[at], mask=raw, other=0)
        raw_at = jnp.where(raw, jnp.minimum(raw_at, c2 - 1), 0)
        got = pltriton.load(level2_ref.at[raw_at], mask=raw, other=0)
        old = dense_ref[...]
        moved = wordcodec.apply_delta(old, move - escape_offset)
        out_ref[...] = jnp.where(raw, got, jnp.where(live, moved, old))

    block_rows = pl.BlockSpec((None, per, BITS), lambda r, i: (r, i, 0))
    whole = lambda c: pl.BlockSpec((None, c), lambda r, i: (r, 0))  # noqa: E731
    call = _call(
        kernel, jax.ShapeDtypeStruct(dense.shape, word_t),
        in_specs=[block_rows,
                  pl.BlockSpec((None, per), lambda r, i: (r, i)),
                  pl.BlockSpec((None, 1), lambda r, i: (r, i)),
                  pl.BlockSpec((1,), lambda r, i: (r,)),
                  whole(c1), whole(c1), whole(c2)],
        out_specs=block_rows, grid=(rows, dense.shape[1] // per), interpret=interpret,
        name=f"ciera_escape_fill_words_{jnp.dtype(word_t).name}")
    out = call(dense, words, offs, limit, level1_RxC, raw_before, level2)
    return out.reshape(rows, -1)[:, :n]


__all__ = ["ESCAPE_BLOCK", "block_offsets", "fill_exponents_pallas", "fill_words_pallas",
           "pack_pallas", "raw_ranks"]

"""All-gather with cross-iteration reuse (CIERA), bitwise equal to a plain all-gather.

Call inside ``jax.shard_map``. The cache picks the mode (see :mod:`ciera_jax.cache`):

- exponent mode (:class:`ExponentCache`): a primed bf16 tensor sends 1 byte per element (sign +
  mantissa) plus patches for exponents that differ from the cache; the receiver rebuilds the
  exact words from its cached exponents.
- word mode (:class:`WordCache`): each element sends a 2-4 bit code of its word's move since the
  cached word, with escapes in two levels (:mod:`ciera_jax.wordcodec`); when words moved too far
  for the ladder (:mod:`ciera_jax.word_ladder`), exponent mode from the same cache, whichever
  fitting option sends fewest bytes.

Phases, per tensor:

1. encode: compare this rank's shard with its slice of the cache: exponent changes and their
   patch list (exponent mode), or word deltas and their escape counts (word mode).
2. agree: one ``pmax`` over the demands of *all* tensors gathered together (one vector: a
   count per exponent-mode tensor, ``wordcodec.N_DEMANDS`` counts per word-mode tensor), over
   every manual mesh axis, so the choice is the same on every rank.
3. exchange: ``lax.switch`` on that rank-invariant choice: a compressed gather with static
   capacities, or (unprimed cache / too many changes) a plain gather of the bits that re-primes
   the cache.

``stats["mode"]``: 0 plain, 1 exponent, 2 word (``MODE_*``); ``stats["code_bits"]``: the word
code width, 0 when not word mode.

Self-check: every compressed option also sends a 32-bit checksum of the sender's true shard
(:mod:`ciera_jax.checksum`); every receiver checks each shard it rebuilt against it.
``stats["verify_failed"]`` counts the shards that failed on this rank (per rank: a cache that
drifted on one rank fails there only). Plain gathers send the bits themselves and need no
check. :func:`ciera_jax.heal.reset_failed` is what to do about a failure.

Shape letters as in :mod:`ciera_jax.codec`: ``N`` ranks, ``n`` elements, ``P`` payload planes,
``L`` wire bytes per rank, ``K`` a patch capacity.

Gradients: the result is attached to ``x`` through a ``custom_vjp`` whose backward is
``lax.psum_scatter``, the transpose of an all-gather, so gradients are bitwise those of
``lax.all_gather``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax import checksum as checksums
from ciera_jax import codec, kernels, patches, wordcodec
from ciera_jax.cache import ExponentCache, WordCache, is_cache
# The tier ladder lives with the cost model so the planner and simulator price exactly what
# is sent.
from ciera_jax.costmodel import CHECKSUM_BYTES, DEFAULT_LADDER, Ladder, Tier
from ciera_jax.word_ladder import CODE_BITS, WORD_LADDER, WordRung

AGREEMENT_BYTES = 4  # one int32 demand in the step's pmax (exponent mode: one per tensor)

# ``stats["mode"]``: what one gather sent.
MODE_PLAIN, MODE_EXPONENT, MODE_WORD = 0, 1, 2

IMPLS = kernels.IMPLS


# --------------------------------------------------------------------------- public API


def plain_all_gather(x: jax.Array, axis_name, *, axis: int = 0) -> jax.Array:
    """Lossless baseline: all-gather the same-width unsigned view of ``x`` (tiled on ``axis``).

    Gathering the bits keeps every bit (XLA's CPU bf16 all-gather quiets signalling NaNs) and is
    the fast path on CPU. Differentiable: the backward is ``psum_scatter`` of the cotangent.
    """
    name = "plain_all_gather"
    axis = _normalize_axis(x, axis, name)
    _axis_size(axis_name, name)
    full = codec.from_bits(
        lax.all_gather(codec.to_bits(lax.stop_gradient(x)), axis_name, axis=axis, tiled=True),
        x.dtype)
    return attach_gather_grad(x, full, axis_name, axis)


def all_gather(x: jax.Array, cache: ExponentCache | WordCache, axis_name, *, axis: int = 0,
               impl: str = "auto", compress: bool | None = None,
               ladder: Ladder = DEFAULT_LADDER, name: str = "tensor"):
    """All-gather ``x`` (this rank's shard) over ``axis_name``, reusing the cache (exponents or
    words: the cache's kind picks the mode).

    Returns ``(full, new_cache, stats)``: ``full`` is bitwise ``lax.all_gather(x, axis_name,
    axis=axis, tiled=True)``; carry ``new_cache`` to the next step. ``compress=None`` compresses
    bf16/float32 and gathers other dtypes plainly; ``True`` insists (error for other dtypes);
    ``False`` always gathers plainly. ``stats`` holds scalars: ``sent_bytes``, ``plain_bytes``,
    ``changed`` (exponents), ``agreed_changed``, ``tier`` (-1: not compressible; the index of
    the option taken, see :func:`word_options` for word caches), ``capacity``, ``bitmap``,
    ``fallback``, ``mode`` (0 plain, 1 exponent, 2 word), ``code_bits`` (0 unless word).
    """
    full, new_cache, stats = all_gather_tree(
        {name: x}, {name: cache}, axis_name, axis=axis, impl=impl, compress=compress,
        ladder=ladder)
    return full[name], new_cache[name], stats[name]


def all_gather_tree(tree, caches, axis_name, *, axis=0, impl: str = "auto",
                    compress=None, ladder: Ladder = DEFAULT_LADDER):
    """:func:`all_gather` over a pytree with one agreement collective for all leaves.

    ``caches`` mirrors ``tree`` with an :class:`ExponentCache` or :class:`WordCache` per leaf
    (modes may be mixed; still one agreement collective). ``axis`` and
    ``compress`` are either single values or pytrees with the structure of ``tree``.
    Returns ``(full_tree, new_caches, stats_tree)``.
    """
    leaves, treedef = jax.tree.flatten(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    cache_leaves = _match_tree(caches, treedef, "caches", is_leaf=is_cache)
    axes = _broadcast_option(axis, treedef, "axis")
    compresses = _broadcast_option(compress, treedef, "compress")
    _check_impl(impl)

    encoded = [encode(x, c, axis_name, axis=ax, impl=impl, ladder=ladder, name=path)
               if _wants_compression(x, c, comp, path) else None
               for x, c, ax, comp, path in zip(leaves, cache_leaves, axes, compresses, paths)]
    agreed = iter(agree([e for e in encoded if e is not None], axis_name))
    outs, new_caches, stats = [], [], []
    for x, c, ax, e in zip(leaves, cache_leaves, axes, encoded):
        if e is None:
            outs.append(plain_all_gather(x, axis_name, axis=ax))
            new_caches.append(c)
            stats.append(_plain_stats(x))
        else:
            full, new_c, st = exchange(x, e, c, next(agreed), axis_name, impl=impl)
            outs.append(full)
            new_caches.append(new_c)
            stats.append(st)
    unflat = functools.partial(jax.tree.unflatten, treedef)
    return unflat(outs), unflat(new_caches), unflat(stats)


# --------------------------------------------------------------------------- the three phases


def gathered_shape(shard_shape, axis: int, n_ranks: int) -> tuple[int, ...]:
    """The full tensor's shape: ``n_ranks`` shards tiled on ``axis``."""
    shape = list(shard_shape)
    shape[axis] *= n_ranks
    return tuple(shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Encoded:
    """What one rank sends for one tensor, computed before the gather (it can be carried over
    from the end of the previous step: it depends only on the shard and the cache).

    ``payload``: uint8 (P, *shard shape); ``patch_exp``: the new exponents of the first
    changed elements, in position order, as many as the largest tier holds; ``patch_pos``:
    their positions in the full tensor, as many as the largest sparse tier holds (unused slots
    hold an out-of-range position); ``changed_bits``: one bit per element, packed little-end
    first (empty when the ladder has no bitmap tier); ``count``: exponents changed in this
    shard; ``demand``: ``count``, or int32 max when the cache is unprimed; ``checksum``: uint32
    of the shard's true words, sent with the payload for the receivers' check.
    """

    payload: jax.Array
    patch_pos: jax.Array
    patch_exp: jax.Array
    changed_bits: jax.Array
    count: jax.Array
    demand: jax.Array
    checksum: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    n_ranks: int = dataclasses.field(metadata=dict(static=True))
    tiers: tuple[Tier, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(self.payload.shape[1:])

    @property
    def full_shape(self) -> tuple[int, ...]:
        return gathered_shape(self.shard_shape, self.axis, self.n_ranks)


def encode(x: jax.Array, cache, axis_name, *, axis: int = 0,
           impl: str = "auto", ladder: Ladder = DEFAULT_LADDER,
           name: str = "tensor"):
    """Phase 1: compare this rank's shard with its slice of the cache.

    Exponent cache: split the shard and list its exponents that differ (:class:`Encoded`).
    Word cache: the word deltas and their demand vector (:class:`WordEncoded`).
    """
    _check_impl(impl)
    axis = _normalize_axis(x, axis, name)
    n_ranks = _axis_size(axis_name, name)
    codec.word_format(x.dtype)
    _check_cache(cache, x, axis, n_ranks, name)
    x = lax.stop_gradient(x)
    shard_len = x.shape[axis]
    offset = lax.axis_index(axis_name).astype(jnp.int32) * shard_len
    csum = _shard_checksum(x, axis, axis_name)
    if isinstance(cache, WordCache):
        cached = lax.dynamic_slice_in_dim(cache.words, offset, shard_len, axis=axis)
        d, counts = kernels.word_encode(x, cached, impl=impl)
        demand = jnp.where(cache.primed, counts, jnp.int32(np.iinfo(np.int32).max))
        return WordEncoded(d, counts, demand, csum, axis, n_ranks, ladder.tiers(x.size))
    cached = lax.dynamic_slice_in_dim(cache.exp, offset, shard_len, axis=axis)
    return _encode_exponent(x, cached, cache.primed, offset, axis, n_ranks,
                            ladder.tiers(x.size), impl, csum)


def _shard_checksum(x, axis: int, axis_name) -> jax.Array:
    """This rank's shard checksum at its global positions (rank * shard size onwards)."""
    first = lax.axis_index(axis_name).astype(jnp.uint32) * jnp.uint32(x.size)
    return checksums.checksum(x, first, axis=axis)


def _encode_exponent(x, cached_exp, primed, offset, axis: int, n_ranks: int,
                     tiers: tuple[Tier, ...], impl: str, csum) -> Encoded:
    exp, payload, changed = kernels.encode(x, cached_exp, impl=impl)
    # An unprimed cache knows no exponent: all of them count as changed.
    count = jnp.where(primed, jnp.sum(changed, dtype=jnp.int32), changed.size)
    patch_pos, patch_exp = patches.compact(exp, changed, count, offset, axis, n_ranks, tiers)
    bitmap = any(t.bitmap for t in tiers)
    changed_bits = (patches.pack_bits(changed.reshape(-1)) if bitmap
                    else jnp.zeros((0,), jnp.uint8))
    demand = jnp.where(primed, count, jnp.int32(np.iinfo(np.int32).max))
    return Encoded(payload, patch_pos, patch_exp, changed_bits, count, demand, csum, axis,
                   n_ranks, tiers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WordEncoded:
    """What one rank prepares for one word-mode tensor before the agreement.

    ``delta``: ``ord(new) - ord(cached)`` per element, the same-width signed integer, shard
    shape; ``counts``: this shard's int32 (``wordcodec.N_DEMANDS``,) vector: escapes at code
    widths 2, 3, 4, raw words (``|d| > 127``), changed exponents; ``demand``: ``counts``, or
    int32 max everywhere when the cache is unprimed; ``checksum``: as :attr:`Encoded.checksum`.
    The code plane and the escape lists are built in the exchange, for the code width the
    agreement picks.
    """

    delta: jax.Array
    counts: jax.Array
    demand: jax.Array
    checksum: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    n_ranks: int = dataclasses.field(metadata=dict(static=True))
    tiers: tuple[Tier, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(self.delta.shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return gathered_shape(self.shard_shape, self.axis, self.n_ranks)

    @property
    def count(self) -> jax.Array:
        """Changed exponents in this shard (as :attr:`Encoded.count`)."""
        return self.counts[..., wordcodec.EXP_CHANGED]


def priming_encoded(abstract: Encoded, n_local: int) -> Encoded:
    """A host-side (numpy) :class:`Encoded` / :class:`WordEncoded` that asks for a priming
    gather, shaped like ``abstract`` (one of those or its ``jax.eval_shape``, leading stacked
    axes allowed).

    Payload and patches are zeros and every exponent counts as changed, so ``demand`` is int32
    max and the exchange takes the plain branch, which sends the shard's own bits: nothing
    needs encoding, e.g. for a fresh or restored cache.
    """
    zero = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    demand = np.full(abstract.demand.shape, np.iinfo(np.int32).max, np.int32)
    if isinstance(abstract, WordEncoded):
        return dataclasses.replace(
            zero, counts=np.full(abstract.counts.shape, n_local, np.int32), demand=demand)
    return dataclasses.replace(
        zero, count=np.full(abstract.count.shape, n_local, np.int32), demand=demand)


def agree(encoded, axis_name):
    """Phase 2: one ``pmax`` over every tensor's demand, over all manual mesh axes.

    ``encoded`` is an :class:`Encoded` / :class:`WordEncoded` or a pytree of them (mixed modes
    allowed); returns the same structure of int32 demands (a scalar per exponent-mode tensor,
    a vector per word-mode tensor), identical on every rank, so every rank picks the same
    option.
    """
    leaves, treedef = jax.tree.flatten(
        encoded, is_leaf=lambda e: isinstance(e, (Encoded, WordEncoded)))
    if not leaves:
        return jax.tree.unflatten(treedef, [])
    mesh_axes = tuple(jax.sharding.get_abstract_mesh().manual_axes) or (axis_name,)
    shapes = [e.demand.shape for e in leaves]
    flat = jnp.concatenate([e.demand.reshape(-1) for e in leaves])
    agreed = lax.pmax(flat, mesh_axes)
    ends = np.cumsum([math.prod(sh) for sh in shapes])
    out = [agreed[end - math.prod(sh):end].reshape(sh) for end, sh in zip(ends, shapes)]
    return jax.tree.unflatten(treedef, out)


def exchange(x: jax.Array, encoded, cache, agreed, axis_name, *, impl: str = "auto"):
    """Phase 3: gather at the agreed option and rebuild; returns ``(full, new_cache, stats)``.

    ``x`` must be the shard ``encoded`` was made from: the compressed options send what was
    encoded, the plain fallback sends ``x``'s bits; gradients flow to ``x`` as through an
    all-gather.
    """
    e = encoded
    if tuple(x.shape) != e.shard_shape:
        raise ValueError(f"exchange: shard shape {tuple(x.shape)} differs from the encoded "
                         f"shard {e.shard_shape}; encode and exchange the same tensor")
    if isinstance(cache, WordCache) != isinstance(e, WordEncoded):
        raise TypeError(f"exchange: a {type(cache).__name__} needs the "
                        f"{'WordEncoded' if isinstance(cache, WordCache) else 'Encoded'} that "
                        f"encode() made from it, got {type(e).__name__}")
    if isinstance(cache, WordCache):
        return _exchange_word(x, e, cache, agreed, axis_name, impl)
    dtype = np.dtype(x.dtype)
    tiers = e.tiers
    capacities = [t.capacity for t in tiers] + [x.size]  # the last: plain, everything
    tier = jnp.sum(agreed > jnp.asarray(capacities[:-1], jnp.int32)).astype(jnp.int32)
    branches = [functools.partial(_compressed_branch, tier=t, axis_name=axis_name, dtype=dtype,
                                  impl=impl) for t in tiers]
    branches.append(functools.partial(_plain_branch, axis_name=axis_name, dtype=dtype))
    full, new_exp, failed = lax.switch(tier, branches, e, cache.exp, lax.stop_gradient(x))
    n_local = x.size
    payload_bytes = n_local * codec.word_format(dtype).payload_bytes
    wire = ([payload_bytes + t.patch_bytes(n_local) + CHECKSUM_BYTES for t in tiers]
            + [n_local * dtype.itemsize])
    stats = dict(
        sent_bytes=jnp.asarray(wire, jnp.int32)[tier] + AGREEMENT_BYTES,
        plain_bytes=jnp.int32(n_local * dtype.itemsize),
        changed=e.count,
        agreed_changed=jnp.minimum(agreed, n_local).astype(jnp.int32),
        tier=tier,
        capacity=jnp.asarray(capacities, jnp.int32)[tier],
        bitmap=jnp.asarray([t.bitmap for t in tiers] + [False])[tier],
        fallback=tier == len(tiers),
        mode=jnp.where(tier == len(tiers), MODE_PLAIN, MODE_EXPONENT).astype(jnp.int32),
        code_bits=jnp.int32(0),
        verify_failed=failed,
    )
    new_cache = dataclasses.replace(cache, exp=new_exp, primed=jnp.ones_like(cache.primed))
    # The gathered tensor differs by nothing across ranks, but lax.all_gather types it as
    # varying; match that so callers can mix it with per-rank values as they would a gather.
    full = lax.pcast(full, axis_name, to="varying")
    return attach_gather_grad(x, full, axis_name, e.axis), new_cache, stats


def word_options(n_local: int, word_bytes: int, tiers: tuple[Tier, ...],
                 ladder: tuple[WordRung, ...] = WORD_LADDER):
    """Everything a word-cache gather of ``n_local`` elements per rank may send, in switch
    order: distinct word rungs ``(b, c1, c2)``, then the exponent tiers, then plain. Returns
    ``(rungs, wire)``: the rungs and every option's wire bytes per rank."""
    rungs = []
    for r in ladder:
        key = (r.code_bits, r.level1_capacity(n_local), r.level2_capacity(n_local))
        if key not in rungs:
            rungs.append(key)
    payload = n_local * (word_bytes - 1)
    wire = ([wordcodec.wire_size(n_local, b, c1, c2, word_bytes) + CHECKSUM_BYTES
             for b, c1, c2 in rungs]
            + [payload + t.patch_bytes(n_local) + CHECKSUM_BYTES for t in tiers]
            + [n_local * word_bytes])
    return tuple(rungs), wire


def _exchange_word(x, e: WordEncoded, cache: WordCache, agreed, axis_name, impl):
    """Word cache: the cheapest option (by wire bytes) that holds every rank's demand."""
    dtype = np.dtype(x.dtype)
    n_local, word_bytes = x.size, dtype.itemsize
    rungs, wire = word_options(n_local, word_bytes, e.tiers)
    agreed = agreed.astype(jnp.int32)
    fits = ([(agreed[CODE_BITS.index(b)] <= c1) & (agreed[wordcodec.RAW] <= c2)
             for b, c1, c2 in rungs]
            + [agreed[wordcodec.EXP_CHANGED] <= t.capacity for t in e.tiers]
            + [jnp.bool_(True)])
    cost = jnp.where(jnp.stack(fits), jnp.asarray(wire, jnp.int32),
                     jnp.int32(np.iinfo(np.int32).max))
    choice = jnp.argmin(cost).astype(jnp.int32)  # first of the cheapest: rank-invariant
    branches = [functools.partial(_word_branch, rung=r, axis_name=axis_name, dtype=dtype,
                                  impl=impl) for r in rungs]
    branches += [functools.partial(_word_cache_exponent_branch, tier=t, axis_name=axis_name,
                                   dtype=dtype, impl=impl) for t in e.tiers]
    branches.append(functools.partial(_word_cache_plain_branch, axis_name=axis_name,
                                      dtype=dtype))
    full, new_words, failed = lax.switch(choice, branches, e, cache.words,
                                         lax.stop_gradient(x))
    n_rungs, n_tiers = len(rungs), len(e.tiers)
    plain = n_rungs + n_tiers
    table = lambda values, dt=jnp.int32: jnp.asarray(values, dt)[choice]  # noqa: E731
    stats = dict(
        sent_bytes=table(wire) + AGREEMENT_BYTES * wordcodec.N_DEMANDS,
        plain_bytes=jnp.int32(n_local * word_bytes),
        changed=e.count,
        agreed_changed=jnp.minimum(agreed[wordcodec.EXP_CHANGED], n_local).astype(jnp.int32),
        tier=choice,
        capacity=table([c1 for _, c1, _ in rungs] + [t.capacity for t in e.tiers] + [n_local]),
        bitmap=table([False] * n_rungs + [t.bitmap for t in e.tiers] + [False], jnp.bool_),
        fallback=choice == plain,
        mode=table([MODE_WORD] * n_rungs + [MODE_EXPONENT] * n_tiers + [MODE_PLAIN]),
        code_bits=table([b for b, _, _ in rungs] + [0] * (n_tiers + 1)),
        verify_failed=failed,
    )
    new_cache = dataclasses.replace(cache, words=new_words, primed=jnp.ones_like(cache.primed))
    full = lax.pcast(full, axis_name, to="varying")
    return attach_gather_grad(x, full, axis_name, e.axis), new_cache, stats


# --------------------------------------------------------------------------- validation


def _match_tree(caches, treedef, what, is_leaf=None):
    leaves, cdef = jax.tree.flatten(caches, is_leaf=is_leaf)
    if cdef.num_leaves != treedef.num_leaves:
        raise ValueError(f"{what} must mirror the gathered tree: {treedef.num_leaves} tensors "
                         f"but {cdef.num_leaves} {what}; build them with init_cache_tree(tree)")
    return leaves


def _broadcast_option(value, treedef, what):
    if value is None or isinstance(value, (bool, int, np.integer)):
        return [value] * treedef.num_leaves
    leaves = jax.tree.leaves(value, is_leaf=lambda v: v is None)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"{what} must be one value or a tree mirroring the gathered tree")
    return leaves


def _normalize_axis(x, axis, name) -> int:
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}: gather axis {axis} is out of range for a shard of shape "
                         f"{tuple(x.shape)}; pick an axis in [{-x.ndim}, {x.ndim})")
    return int(axis) % x.ndim


def _axis_size(axis_name, name) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{name}: ciera_jax gathers must run inside jax.shard_map with a mesh axis named "
            f"{axis_name!r} (got no such bound axis); wrap the caller in jax.shard_map(..., "
            f"mesh=mesh, in_specs=..., out_specs=...)") from None


def _wants_compression(x, cache, compress, path) -> bool:
    if compress is False:
        return False
    if not codec.is_compressible(x.dtype):
        if compress:
            raise TypeError(f"{path}: compression forced for dtype {x.dtype}, but CIERA only "
                            "compresses bfloat16 and float32; pass compress=None to gather it "
                            "plainly")
        return False
    if not is_cache(cache):
        raise TypeError(f"{path}: expected an ExponentCache or WordCache, got "
                        f"{type(cache).__name__}; create one with ciera_jax.init_cache("
                        "full_shape, dtype, mode='exponent' or 'word')")
    return True


def _check_cache(cache, x, axis: int, n_ranks: int, path: str) -> None:
    full = list(x.shape)
    full[axis] *= n_ranks
    if np.dtype(cache.dtype) != np.dtype(x.dtype):
        raise ValueError(f"{path}: the cache was made for {np.dtype(cache.dtype)} but the "
                         f"tensor is {np.dtype(x.dtype)}; rebuild it with init_cache({tuple(full)}"
                         f", {np.dtype(x.dtype).name}, mode={cache.mode!r})")
    if cache.shape != tuple(full):
        raise ValueError(
            f"{path}: cache shape {cache.shape} does not match the gathered shape "
            f"{tuple(full)} (shard {tuple(x.shape)} x {n_ranks} ranks on axis {axis}); the cache "
            f"must hold the full tensor and be replicated over the gather axis: "
            f"init_cache({tuple(full)}, {np.dtype(x.dtype).name}) with a PartitionSpec that "
            f"does not shard it over the gather axis")
    if math.prod(full) >= 2**31 - 1:
        raise ValueError(f"{path}: {math.prod(full)} elements exceed the int32 patch index; "
                         "split the tensor or gather it plainly (compress=False)")


def _check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _plain_branch(e: Encoded, cache_exp, x, *, axis_name, dtype):
    """Gather the bits as they are and re-prime the cache from the result."""
    bits = lax.all_gather(codec.to_bits(x), axis_name, axis=e.axis, tiled=True, to="invarying")
    full = codec.from_bits(bits, dtype)
    return full, codec.exponent(full), _no_failure(axis_name, (e, cache_exp, x))


def _compressed_branch(e: Encoded, cache_exp, x, *, tier: Tier, axis_name, dtype, impl):
    """Send payload bytes + patches in one uint8 buffer; rebuild from cache + patches (``x``
    only types the self-check's count)."""
    K, n_planes = tier.capacity, e.payload.shape[0]
    n_local = math.prod(e.shard_shape)
    parts = [e.payload.reshape(-1)]
    if tier.bitmap:
        parts += [e.changed_bits, e.patch_exp[:K]]
    elif K:
        parts += [lax.bitcast_convert_type(e.patch_pos[:K], jnp.uint8).reshape(-1),
                  e.patch_exp[:K]]
    parts.append(_checksum_bytes(e.checksum))
    wire_NxL = lax.all_gather(jnp.concatenate(parts), axis_name, axis=0, tiled=False,
                              to="invarying")
    wire_NxL, sent_N = _split_checksums(wire_NxL)

    end = n_planes * n_local
    payload = _to_full_layout(wire_NxL[:, :end].reshape(-1, n_planes, n_local), e)
    if tier.bitmap:
        nb = e.changed_bits.size
        changed_Nxn, new_Nxn = patches.apply_bitmap(wire_NxL[:, end:end + nb],
                                                    wire_NxL[:, end + nb:], n_local)
        exp_full = jnp.where(_to_full_layout(changed_Nxn, e), _to_full_layout(new_Nxn, e),
                             cache_exp)
    elif K:
        pos = lax.bitcast_convert_type(wire_NxL[:, end:end + 4 * K].reshape(-1, 4), jnp.int32)
        exp_full = patches.apply_sparse(cache_exp, pos, wire_NxL[:, end + 4 * K:].reshape(-1))
    else:
        exp_full = cache_exp
    full = kernels.decode(exp_full, payload.reshape((n_planes,) + e.full_shape), dtype,
                          impl=impl)
    return full, exp_full, _verify(full, sent_N, e, axis_name, (e, cache_exp, x))


def _word_branch(e: WordEncoded, words, x, *, rung, axis_name, dtype, impl):
    """Send codes + level 1 + level 2 in one uint8 buffer; rebuild from the cached words."""
    b, c1, c2 = rung
    n_local = math.prod(e.shard_shape)
    wire = wordcodec.encode_wire(e.delta.reshape(-1), codec.to_bits(x).reshape(-1), b, c1, c2)
    wire = jnp.concatenate([wire, _checksum_bytes(e.checksum)])
    wire_NxL, sent_N = _split_checksums(
        lax.all_gather(wire, axis_name, axis=0, tiled=False, to="invarying"))
    codes_Nxn, level1, level2 = wordcodec.split_wire(wire_NxL, n_local, b, c1, c2, words.dtype)
    dense = kernels.word_decode(words, _to_full_layout(codes_Nxn, e), b, impl=impl)
    # Escapes: positions from the codes (block-wise), moved into the full tensor's layout.
    pos = wordcodec.escape_positions_rows(codes_Nxn, b, c1)
    offsets = (jnp.arange(e.n_ranks, dtype=jnp.int32) * e.shard_shape[e.axis])[:, None]
    full_pos = patches.to_full_positions(pos, e.shard_shape, e.axis, offsets, e.n_ranks)
    flat = words.reshape(-1)
    cached_at = flat[jnp.minimum(full_pos, flat.shape[0] - 1)]
    new_at = wordcodec.escape_words(cached_at, level1, level2)
    out = dense.reshape(-1).at[full_pos.reshape(-1)].set(new_at.reshape(-1), mode="drop")
    out = out.reshape(words.shape)
    full = codec.from_bits(out, dtype)
    return full, out, _verify(full, sent_N, e, axis_name, (e, words, x))


def _word_cache_exponent_branch(e: WordEncoded, words, x, *, tier: Tier, axis_name, dtype,
                                impl):
    """Exponent mode served from a word cache (its words hold the exponents)."""
    fmt = codec.word_format(dtype)
    cache_exp = ((words >> fmt.mantissa_bits) & 0xFF).astype(jnp.uint8)
    shard_len = e.shard_shape[e.axis]
    offset = lax.axis_index(axis_name).astype(jnp.int32) * shard_len
    cached = lax.dynamic_slice_in_dim(cache_exp, offset, shard_len, axis=e.axis)
    # Compact for this tier only (the agreed tier is static here): no inner tier switch.
    tiers = (Tier(0), tier) if tier.capacity else (tier,)
    ee = _encode_exponent(x, cached, jnp.bool_(True), offset, e.axis, e.n_ranks, tiers, impl,
                          e.checksum)
    full, _, failed = _compressed_branch(ee, cache_exp, x, tier=tier, axis_name=axis_name,
                                         dtype=dtype, impl=impl)
    return full, codec.to_bits(full), failed


def _word_cache_plain_branch(e: WordEncoded, words, x, *, axis_name, dtype):
    """Gather the bits as they are; they are the new word cache."""
    bits = lax.all_gather(codec.to_bits(x), axis_name, axis=e.axis, tiled=True, to="invarying")
    return codec.from_bits(bits, dtype), bits, _no_failure(axis_name, (e, words, x))


def _no_failure(axis_name, operands) -> jax.Array:
    """A plain gather carries the bits themselves: nothing to check (a zero typed like the
    checked branches' counts)."""
    return _varying_like(jnp.int32(0), operands, axis_name)


def _vma(x) -> set:
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # JAX 0.10's type; older ones have .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def _varying_like(x, operands, axis_name) -> jax.Array:
    """``x`` typed to vary over every mesh axis the switch ``operands`` vary over, but the
    gather's: every branch then returns the same type, whatever the inputs vary over (a cache
    replicated over a data axis or not, a shard that differs across it or not)."""
    want = set().union(*(_vma(a) for a in jax.tree.leaves(operands))) - {axis_name}
    missing = tuple(sorted(want - _vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _checksum_bytes(csum) -> jax.Array:
    """The uint32 checksum as the last CHECKSUM_BYTES of a uint8 wire buffer."""
    return lax.bitcast_convert_type(csum.astype(jnp.uint32), jnp.uint8).reshape(CHECKSUM_BYTES)


def _split_checksums(wire_NxL):
    """Gathered wire rows -> (rows without their checksums, every rank's checksum (N,))."""
    sent_N = lax.bitcast_convert_type(wire_NxL[:, -CHECKSUM_BYTES:], jnp.uint32)
    return wire_NxL[:, :-CHECKSUM_BYTES], sent_N


def _verify(full, sent_N, e, axis_name, operands) -> jax.Array:
    """Shards of the rebuilt ``full`` whose checksum differs from what their rank sent."""
    got_N = checksums.checksum_shards(full, e.axis, e.n_ranks)
    return _varying_like(jnp.sum(got_N != sent_N, dtype=jnp.int32), operands, axis_name)


def _to_full_layout(a_NxPxn, e: Encoded):
    """Rank-major (N, [P,] n_local) rows -> the full tensor's layout ([P,] *full_shape)."""
    shard = e.shard_shape
    pre, s, post = math.prod(shard[:e.axis]), shard[e.axis], math.prod(shard[e.axis + 1:])
    lead = a_NxPxn.shape[1:-1]  # the payload planes, if any
    a = a_NxPxn.reshape((e.n_ranks,) + lead + (pre, s, post))
    k = len(lead)
    a = jnp.moveaxis(a, 0, k + 1)  # (lead..., pre, N, s, post)
    return a.reshape(lead + e.full_shape)


def _plain_stats(x) -> dict:
    n_bytes = jnp.int32(x.size * np.dtype(x.dtype).itemsize)
    return dict(sent_bytes=n_bytes, plain_bytes=n_bytes, changed=jnp.int32(0),
                agreed_changed=jnp.int32(0), tier=jnp.int32(-1), capacity=jnp.int32(0),
                bitmap=jnp.bool_(False), fallback=jnp.bool_(False),
                mode=jnp.int32(MODE_PLAIN), code_bits=jnp.int32(0),
                verify_failed=jnp.int32(0))


# --------------------------------------------------------------------------- gradient


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def attach_gather_grad(x, full, axis_name, axis):
    """Returns ``full`` (computed without gradient); differentiates as an all-gather of x.

    Every gather here (CIERA, plain bits, int8) computes its result off the gradient path and
    attaches it with this, so all share the one backward: ``psum_scatter`` of the cotangent."""
    del x
    return full


def _attach_fwd(x, full, axis_name, axis):
    del x
    return full, None


def _attach_bwd(axis_name, axis, _, ct_full):
    dx = lax.psum_scatter(ct_full, axis_name, scatter_dimension=axis, tiled=True)
    return dx, jnp.zeros_like(ct_full)


attach_gather_grad.defvjp(_attach_fwd, _attach_bwd)

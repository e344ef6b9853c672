"""All-gather with cross-iteration reuse (CIERA), bitwise equal to a plain all-gather.

Call inside ``jax.shard_map``. The cache picks the mode (see :mod:`ciera_jax.collective.cache`):

- exponent mode (:class:`ExponentCache`, :mod:`ciera_jax.collective.exponent_mode`): sign + mantissa
  travel, exponents that changed since the cache travel as a bitmap and a list;
- word mode (:class:`WordCache`, :mod:`ciera_jax.collective.word_mode`): a ``b``-bit code of each word's
  move since the cached word, with escapes out of line.

Phases, per tensor:

1. encode: compare this rank's shard with its slice of the cache; pack what will travel at the
   top capacity (no collective; it can run at the end of the previous step).
2. agree: one ``pmax`` over the counts of *all* tensors gathered together, over every manual
   mesh axis, so the rungs are the same on every rank.
3. exchange: one unconditional all-gather of the main plane (payload or code plane, with the
   sender's checksum), the escape section at the agreed rung (:mod:`ciera_jax.collective.transfer`), one
   decode, one self-check. Above the top rung or on an unprimed cache, the main transfer
   carries the head of the shard's bits instead and a ``lax.cond`` gathers the rest: a plain
   gather of the bits, in plain's bytes, which re-primes the cache.

The rung is either traced (the agreement's output: a ``lax.switch`` picks the section's
transfer) or fixed when the step is compiled (a :class:`~ciera_jax.collective.capacity.FixedRung`
from a host that knew the demand before the step: the section rides in the main transfer, and
the fallback's conditional is the only one with collectives, and with
``FixedRung.guaranteed`` (the host picked a program whose rungs hold the demand) there is no
conditional at all; with overflow rungs
(``FixedRung.exits``) it also finishes a word tensor a few rungs above its fixed one as words,
:func:`ciera_jax.collective.word_mode.overflow_exit`). A train step fixes it
(:mod:`ciera_jax.fsdp.phases`); a lone :func:`all_gather` cannot know its demand in advance.

Each compressed tensor thus has one codec in the compiled step, and its main transfer is
outside any conditional, where XLA can overlap it with compute. Wire sizes: :mod:`ciera_jax.codec.wire`.

``stats["mode"]``: what was sent (0 plain, 1 exponent, 2 word: ``MODE_*``);
``stats["verify_failed"]``: shards that failed the self-check on this rank (per rank: a cache
that drifted on one rank fails there only); :func:`ciera_jax.collective.heal.reset_failed` is what to do
about a failure. Gradients: the result is attached to ``x`` with
:func:`ciera_jax.collective.gradient.attach_gather_grad` (backward: ``psum_scatter``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.codec import bitfields
from ciera_jax.collective import (capacity, exponent_mode, selfcheck, transfer, validation,
                                  word_mode)
from ciera_jax.collective.cache import ExponentCache, WordCache, is_cache
from ciera_jax.collective.exponent_mode import Encoded
from ciera_jax.collective.gradient import attach_gather_grad
from ciera_jax.codec.layout import full_index, gathered_shape, rows_to_full
from ciera_jax.runtime import target
from ciera_jax.runtime.varying import varying_like, varying_over
from ciera_jax.codec.wire import AGREEMENT_BYTES, DEFAULT_CODE_BITS, agreement_bytes
from ciera_jax.collective.word_mode import WordEncoded

__all__ = ["AGREEMENT_BYTES", "Encoded", "IMPLS", "MODE_EXPONENT", "MODE_PLAIN", "MODE_WORD",
           "WordEncoded", "agree", "all_gather", "all_gather_tree", "attach_gather_grad",
           "encode", "exchange", "gathered_shape", "plain_all_gather", "priming_encoded"]

# ``stats["mode"]``: what one gather sent.
MODE_PLAIN, MODE_EXPONENT, MODE_WORD = 0, 1, 2

IMPLS = validation.IMPLS


# --------------------------------------------------------------------------- public API


def plain_all_gather(x: jax.Array, axis_name, *, axis: int = 0) -> jax.Array:
    """Lossless baseline: all-gather the same-width unsigned view of ``x`` (tiled on ``axis``).

    Gathering the bits keeps every bit (XLA's CPU bf16 all-gather quiets signalling NaNs) and is
    the fast path on CPU. Differentiable: the backward is ``psum_scatter`` of the cotangent.
    """
    name = "plain_all_gather"
    axis = validation.normalize_axis(x, axis, name)
    validation.axis_size(axis_name, name)
    full = bitfields.from_bits(
        lax.all_gather(bitfields.to_bits(lax.stop_gradient(x)), axis_name, axis=axis, tiled=True),
        x.dtype)
    return attach_gather_grad(x, full, axis_name, axis)


def all_gather(x: jax.Array, cache: ExponentCache | WordCache, axis_name, *, axis: int = 0,
               impl: str = "auto", compress: bool | None = None,
               code_bits: int = DEFAULT_CODE_BITS, name: str = "tensor"):
    """All-gather ``x`` (this rank's shard) over ``axis_name``, reusing the cache (exponents or
    words: the cache's kind picks the mode).

    Returns ``(full, new_cache, stats)``: ``full`` is bitwise ``lax.all_gather(x, axis_name,
    axis=axis, tiled=True)``; carry ``new_cache`` to the next step. ``compress=None`` compresses
    bf16/float32 and gathers other dtypes plainly; ``True`` insists (error for other dtypes);
    ``False`` always gathers plainly. ``code_bits`` (2, 3 or 4) is word mode's code width.
    ``stats`` holds scalars: ``sent_bytes``, ``plain_bytes``, ``changed`` (exponents),
    ``agreed_changed``, ``rung`` (-1: not compressed; else the escape rung, its top + 1 for the
    plain fallback), ``capacity``, ``bitmap``, ``fallback``, ``mode``, ``code_bits``,
    ``verify_failed``.
    """
    full, new_cache, stats = all_gather_tree(
        {name: x}, {name: cache}, axis_name, axis=axis, impl=impl, compress=compress,
        code_bits=code_bits)
    return full[name], new_cache[name], stats[name]


def all_gather_tree(tree, caches, axis_name, *, axis=0, impl: str = "auto",
                    compress=None, code_bits: int = DEFAULT_CODE_BITS):
    """:func:`all_gather` over a pytree with one agreement collective for all leaves.

    ``caches`` mirrors ``tree`` with an :class:`ExponentCache` or :class:`WordCache` per leaf
    (modes may be mixed; still one agreement collective). ``axis`` and ``compress`` are either
    single values or pytrees with the structure of ``tree``.
    Returns ``(full_tree, new_caches, stats_tree)``.
    """
    leaves, treedef = jax.tree.flatten(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    cache_leaves = validation.match_tree(caches, treedef, "caches", is_leaf=is_cache)
    axes = validation.broadcast_option(axis, treedef, "axis")
    compresses = validation.broadcast_option(compress, treedef, "compress")
    validation.check_impl(impl)

    encoded = [encode(x, c, axis_name, axis=ax, impl=impl, code_bits=code_bits, name=path)
               if validation.wants_compression(x, c, comp, path) else None
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


def encode(x: jax.Array, cache, axis_name, *, axis: int = 0, impl: str = "auto",
           code_bits: int = DEFAULT_CODE_BITS, name: str = "tensor"):
    """Phase 1: compare this rank's shard with its slice of the cache and pack what travels:
    an :class:`Encoded` (exponent cache) or a :class:`WordEncoded` (word cache)."""
    validation.check_impl(impl)
    v = local_view(x, cache, axis_name, axis, name)
    if isinstance(cache, WordCache):
        words_flat = cache.words.reshape(-1)

        def cached_at(i):  # read in place: the escapes need a few cached words, not the slice
            return words_flat[full_index(i, v.x.shape, v.axis, v.n_ranks, v.offset)]

        return word_mode.encode(v.x, v.cached, cache.primed, v.axis, v.n_ranks, v.checksum,
                                  impl, code_bits, cached_at)
    return exponent_mode.encode(v.x, v.cached, cache.primed, v.axis, v.n_ranks, v.checksum,
                                  impl)


class LocalView(NamedTuple):
    """What an encode reads of one rank's shard (:func:`local_view`)."""

    x: jax.Array  # the shard, without gradient
    axis: int  # its gather axis, normalized
    n_ranks: int
    offset: jax.Array  # where the shard starts on ``axis`` in the full tensor
    cached: jax.Array  # its slice of the cache's words (word mode) or exponents
    checksum: jax.Array  # the sender's checksum of the shard (selfcheck)


def local_view(x: jax.Array, cache, axis_name, axis: int, name: str) -> LocalView:
    """The shard and its slice of ``cache``, checked (axis, dtype, cache shape and kind)."""
    axis = validation.normalize_axis(x, axis, name)
    n_ranks = validation.axis_size(axis_name, name)
    bitfields.word_format(x.dtype)
    validation.check_cache(cache, x, axis, n_ranks, name)
    x = lax.stop_gradient(x)
    offset = lax.axis_index(axis_name).astype(jnp.int32) * x.shape[axis]
    stored = cache.words if isinstance(cache, WordCache) else cache.exp
    cached = lax.dynamic_slice_in_dim(stored, offset, x.shape[axis], axis=axis,
                                      allow_negative_indices=False)
    return LocalView(x, axis, n_ranks, offset, cached,
                     selfcheck.shard_checksum(x, axis, axis_name))


def priming_encoded(abstract, n_local: int):
    """A host-side (numpy) :class:`Encoded` / :class:`WordEncoded` that asks for a priming
    gather, shaped like ``abstract`` (one of those or its ``jax.eval_shape``, leading stacked
    axes allowed).

    Everything is zero and the demand is int32 max, so the exchange takes the plain fallback,
    which sends the shard's own bits: nothing needs encoding, e.g. for a fresh or restored
    cache.
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
    a vector per word-mode tensor), identical on every rank.
    """
    leaves, treedef = jax.tree.flatten(
        encoded, is_leaf=lambda e: isinstance(e, (Encoded, WordEncoded)))
    if not leaves:
        return jax.tree.unflatten(treedef, [])
    mesh_axes = tuple(jax.sharding.get_abstract_mesh().manual_axes) or (axis_name,)
    shapes = [e.demand.shape for e in leaves]
    flat = jnp.concatenate([e.demand.reshape(-1) for e in leaves])
    agreed = lax.pmax(varying_over(flat, mesh_axes), mesh_axes)
    ends = np.cumsum([math.prod(sh) for sh in shapes])
    out = [agreed[end - math.prod(sh):end].reshape(sh) for end, sh in zip(ends, shapes)]
    return jax.tree.unflatten(treedef, out)


def fills_in_branch() -> bool:
    """Whether a word gather with overflow rungs fills its escapes in the fallback
    conditional's steady branch (tracing for a CPU), not before the conditional (for a GPU):
    see :func:`exchange`."""
    return target.traced_backend() == "cpu"


def exchange(x: jax.Array, encoded, cache, agreed, axis_name, *, impl: str = "auto"):
    """Phase 3: gather at the agreed rungs and rebuild; returns ``(full, new_cache, stats)``.

    ``x`` must be the shard ``encoded`` was made from: the compressed path sends what was
    encoded, the plain fallback sends ``x``'s bits; gradients flow to ``x`` as through an
    all-gather.
    """
    e = encoded
    _check_exchange(x, e, cache)
    word = isinstance(cache, WordCache)
    dtype = np.dtype(x.dtype)
    if capacity.is_fixed(agreed) and agreed.rung == capacity.PLAIN_RUNG:
        return _fixed_plain(x, e, cache, agreed, axis_name)
    # The shard itself, not its bits, goes in: a bits copy of it would be made whole (an
    # operand of the fallback's cond) though only the head travels on most steps.
    shard = lax.stop_gradient(x)
    option, cached = ((word_mode, cache.words) if word else (exponent_mode, cache.exp))
    sent = option.send(e, agreed, shard, axis_name, impl=impl)
    words = _received_words(e, sent, cached, dtype, impl, axis_name) if word else None
    out = _rebuilt(e, sent, cached, agreed, shard, words, dtype, impl, axis_name)
    if word:
        (new_cached,) = out
        failed = words.failed
        if failed is None:
            failed = word_mode.check(e, words.got, new_cached, dtype)
        full = bitfields.from_bits(new_cached, dtype)
    else:
        full, new_cached, failed = out
    stats = _exchange_stats(e, sent, agreed, failed, dtype, word)
    # A guaranteed rung held the demand, which an unprimed cache's never fits: the cache was
    # primed, and stays so without a constant written anew (a kernel of its own on a GPU).
    new_cache = _refreshed(cache, new_cached,
                           cache.primed if capacity.is_guaranteed(agreed) else None)
    # The gathered tensor differs by nothing across ranks, but lax.all_gather types it as
    # varying; match that so callers can mix it with per-rank values as they would a gather.
    full = varying_like(full, x, None)
    return attach_gather_grad(x, full, axis_name, e.axis), new_cache, stats


def _check_exchange(x, e, cache) -> None:
    """One clear error for a shard or a cache that is not the one ``e`` was encoded from."""
    if tuple(x.shape) != e.shard_shape:
        raise ValueError(f"exchange: shard shape {tuple(x.shape)} differs from the encoded "
                         f"shard {e.shard_shape}; encode and exchange the same tensor")
    word = isinstance(cache, WordCache)
    if word != isinstance(e, WordEncoded):
        raise TypeError(f"exchange: a {type(cache).__name__} needs the "
                        f"{'WordEncoded' if word else 'Encoded'} that "
                        f"encode() made from it, got {type(e).__name__}")


class _Words(NamedTuple):
    """Word mode's receive, before the conditional: what it got, its overflow exit (None:
    no overflow rungs), the escapes' fill, the words decoded before the conditional (``()``:
    in its branch) and their self-check (None: on the conditional's words)."""
    got: object
    finish: object
    fill_section: object
    decoded: tuple
    failed: object


def _received_words(e, sent, cached, dtype, impl, axis_name) -> _Words:
    """Where word mode's decode runs: before the conditional, where XLA fuses it with the
    layer's other decodes, and the branch passes one array through, the words (the tensor is
    their bits); in the branch it would compile slower, run slower without an overflow and
    launch more kernels. Its fill of the escapes, with overflow rungs on a CPU: in the branch
    that ends the steady path, since an overflow's exit fills every escape itself and a fill
    before the conditional would be thrown away on every overflow. On a GPU before it, fused
    with the self-check (in the branch it would take more fusions and launches a step)."""
    got = word_mode.receive(e, sent, cached, impl)
    finish = word_mode.overflow_exit(e, sent, got, impl, axis_name)
    fill_section = functools.partial(word_mode.fill, e, got, *got.levels,
                                     jnp.asarray(e.wire.caps1, jnp.int32)[sent.rung], impl)
    decoded = ()
    if not (finish and fills_in_branch()):
        decoded = (fill_section(),)
    # With overflow rungs, the check takes the conditional's words, whichever way they came
    # (an exit fills the escapes past the fixed prefix in its branch); without, the decode's,
    # fused with it before the conditional.
    failed = None if finish else word_mode.check(e, got, decoded[0], dtype)
    return _Words(got, finish, fill_section, decoded, failed)


def _rebuilt(e, sent, cached, agreed, shard, words: _Words | None, dtype, impl, axis_name):
    """The full tensor's bits (word mode: ``(words,)``) or ``(full, exponents, failed)``
    (exponent mode), through the conditional the rung calls for: none (a guaranteed rung),
    the steady path / an overflow rung's exit / the plain fallback, or the steady path / the
    plain fallback. Exponent mode decodes in the fallback conditional's compressed branch,
    with its self-check, so a step that falls back does not also decode what it throws
    away, and XLA:GPU copies nothing through the branch (fewer copies a step, less
    memory)."""
    word = words is not None
    finish = words.finish if word else None
    operands = (shard, sent.rows, words.decoded if word else ())

    def typed(*arrays):  # every branch's outputs typed alike
        return tuple(varying_like(a, operands, axis_name) for a in arrays)

    def plain(shard, rows, _):
        bits = rows_to_full(transfer.plain_rest(rows, bitfields.to_bits(shard), axis_name),
                            e.shard_shape, e.axis)
        if word:
            return typed(bits)
        full = bitfields.from_bits(bits, dtype)
        return typed(full, bitfields.exponent(full), jnp.int32(0))

    def compressed(_, __, decoded, in_branch=True):
        if word:
            return typed(*(decoded or (words.fill_section(),)))
        return typed(*exponent_mode.decode(e, sent, cached, dtype, impl, in_branch))

    def overflow(*_):
        return typed(finish())

    if capacity.is_guaranteed(agreed):
        # The host promised the rung holds the demand: no fallback, no conditional (on a GPU
        # each is a host sync); a broken promise fails the self-check, whose redo is exact.
        return compressed(*operands, in_branch=False)
    if finish is not None:
        # The one conditional with collectives: the fixed rung held the demand (no transfer),
        # an overflow rung's exit (its transfer in a switch of its own, inside), or the plain
        # fallback; all but the first off the steady path (``sent.exit`` is rank-invariant,
        # from the agreement).
        way = jnp.minimum(sent.exit, 1) + sent.overflow.astype(jnp.int32)
        return lax.switch(way, [compressed, overflow, plain], *operands)
    # The one conditional with a large transfer: taken only when some rank overflowed its
    # rung or a cache is unprimed (the agreement makes ``fallback`` rank-invariant).
    return lax.cond(sent.overflow, plain, compressed, *operands)


def _exchange_stats(e, sent, agreed, failed, dtype, word: bool) -> dict:
    """What one exchange sent and found (``stats`` of :func:`exchange`)."""
    wire, fallback, taken = e.wire, sent.overflow, sent.rung_sent
    caps = wire.caps1 if word else wire.caps
    demand = agreed.demand if capacity.is_fixed(agreed) else agreed
    sent_bytes = jnp.where(fallback, wire.fallback_bytes, wire.main_bytes + sent.section_bytes)
    return dict(
        sent_bytes=(sent_bytes + agreement_bytes("word" if word else "exponent")
                    ).astype(jnp.int32),
        plain_bytes=jnp.int32(wire.n * dtype.itemsize),
        changed=e.count,
        agreed_changed=jnp.minimum(demand[word_mode.EXP_CHANGED] if word else demand,
                                   wire.n).astype(jnp.int32),
        rung=jnp.where(fallback, len(caps), taken).astype(jnp.int32),
        capacity=jnp.where(fallback, wire.n, jnp.asarray(caps, jnp.int32)[taken]),
        bitmap=jnp.bool_(not word) & (taken > 0),
        fallback=fallback,
        mode=jnp.where(fallback, MODE_PLAIN, MODE_WORD if word else MODE_EXPONENT
                       ).astype(jnp.int32),
        code_bits=jnp.where(fallback, 0, e.code_bits if word else 0).astype(jnp.int32),
        verify_failed=jnp.where(fallback, 0, failed).astype(jnp.int32),
    )


def _fixed_plain(x, e, cache, agreed, axis_name):
    """A gather compiled plain (:data:`~ciera_jax.collective.capacity.PLAIN_RUNG`: a priming
    step, a demand above the top rung): the bits, gathered, and the cache made from them; no
    codec, no conditional, plain's bytes."""
    word = isinstance(cache, WordCache)
    rows = transfer.gather_rows(bitfields.to_bits(lax.stop_gradient(x)).reshape(-1), axis_name)
    bits = rows_to_full(rows, e.shard_shape, e.axis)
    full = bitfields.from_bits(bits, x.dtype)
    wire = e.wire
    caps = wire.caps1 if word else wire.caps
    stats = dict(
        # its demand was agreed on with the others' (the host read it to pick this rung)
        sent_bytes=jnp.int32(wire.plain_bytes + agreement_bytes("word" if word else "exponent")),
        plain_bytes=jnp.int32(wire.plain_bytes),
        changed=e.count,
        agreed_changed=jnp.minimum(agreed.demand[word_mode.EXP_CHANGED] if word
                                   else agreed.demand, wire.n).astype(jnp.int32),
        rung=jnp.int32(len(caps)), capacity=jnp.int32(wire.n), bitmap=jnp.bool_(False),
        fallback=jnp.bool_(True), mode=jnp.int32(MODE_PLAIN), code_bits=jnp.int32(0),
        verify_failed=jnp.int32(0))
    new_cache = _refreshed(cache, bits if word else bitfields.exponent(full))
    full = varying_like(full, x, None)
    return attach_gather_grad(x, full, axis_name, e.axis), new_cache, stats


def _refreshed(cache, new_cached, primed=None):
    """The cache after a gather: the full tensor's words or exponents (``new_cached``),
    primed (``primed``: the flag it keeps, when the caller knows it is set)."""
    primed = jnp.ones_like(cache.primed) if primed is None else primed
    if isinstance(cache, WordCache):
        return dataclasses.replace(cache, words=new_cached, primed=primed)
    return dataclasses.replace(cache, exp=new_cached, primed=primed)


def _plain_stats(x) -> dict:
    n_bytes = jnp.int32(x.size * np.dtype(x.dtype).itemsize)
    return dict(sent_bytes=n_bytes, plain_bytes=n_bytes, changed=jnp.int32(0),
                agreed_changed=jnp.int32(0), rung=jnp.int32(-1), capacity=jnp.int32(0),
                bitmap=jnp.bool_(False), fallback=jnp.bool_(False),
                mode=jnp.int32(MODE_PLAIN), code_bits=jnp.int32(0),
                verify_failed=jnp.int32(0))

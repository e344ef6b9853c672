"""All-gather with cross-iteration exponent reuse (CIERA), bitwise equal to a plain all-gather.

Call inside ``jax.shard_map``. One gather of a primed bf16 tensor sends 1 byte per element
(sign + mantissa) plus patches for exponents that differ from the cache; the receiver rebuilds
the exact words from its cached exponents. Phases, per tensor:

1. encode: split the local shard, compare its exponents with this rank's slice of the cache,
   compact the changed positions into a patch list.
2. agree: one ``pmax`` over the change counts of *all* tensors gathered together (a vector),
   over every manual mesh axis, so the tier choice is the same on every rank.
3. exchange: ``lax.switch`` on that rank-invariant tier: a compressed gather with static patch
   capacity K (sparse patches, or a changed-bit map plus exponents when many changed), or
   (unprimed cache / too many changes) a plain gather of the bits that re-primes the cache.

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

from ciera_jax import codec, kernels, patches
from ciera_jax.cache import ExponentCache, is_cache
# The tier ladder lives with the cost model so the planner and simulator price exactly what
# is sent.
from ciera_jax.costmodel import DEFAULT_LADDER, Ladder, Tier

AGREEMENT_BYTES = 4  # one int32 change count per tensor in the step's pmax

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


def all_gather(x: jax.Array, cache: ExponentCache, axis_name, *, axis: int = 0,
               impl: str = "auto", compress: bool | None = None,
               ladder: Ladder = DEFAULT_LADDER, name: str = "tensor"):
    """All-gather ``x`` (this rank's shard) over ``axis_name``, reusing cached exponents.

    Returns ``(full, new_cache, stats)``: ``full`` is bitwise ``lax.all_gather(x, axis_name,
    axis=axis, tiled=True)``; carry ``new_cache`` to the next step. ``compress=None`` compresses
    bf16/float32 and gathers other dtypes plainly; ``True`` insists (error for other dtypes);
    ``False`` always gathers plainly. ``stats`` holds scalars: ``sent_bytes``, ``plain_bytes``,
    ``changed``, ``agreed_changed``, ``tier`` (-1: not compressible), ``capacity``, ``bitmap``,
    ``fallback``.
    """
    full, new_cache, stats = all_gather_tree(
        {name: x}, {name: cache}, axis_name, axis=axis, impl=impl, compress=compress,
        ladder=ladder)
    return full[name], new_cache[name], stats[name]


def all_gather_tree(tree, caches, axis_name, *, axis=0, impl: str = "auto",
                    compress=None, ladder: Ladder = DEFAULT_LADDER):
    """:func:`all_gather` over a pytree with one agreement collective for all leaves.

    ``caches`` mirrors ``tree`` with an :class:`ExponentCache` per leaf. ``axis`` and
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
    shard; ``demand``: ``count``, or int32 max when the cache is unprimed.
    """

    payload: jax.Array
    patch_pos: jax.Array
    patch_exp: jax.Array
    changed_bits: jax.Array
    count: jax.Array
    demand: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    n_ranks: int = dataclasses.field(metadata=dict(static=True))
    tiers: tuple[Tier, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(self.payload.shape[1:])

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.shard_shape)
        shape[self.axis] *= self.n_ranks
        return tuple(shape)


def encode(x: jax.Array, cache: ExponentCache, axis_name, *, axis: int = 0,
           impl: str = "auto", ladder: Ladder = DEFAULT_LADDER,
           name: str = "tensor") -> Encoded:
    """Phase 1: split this rank's shard and list its exponents that differ from the cache."""
    _check_impl(impl)
    axis = _normalize_axis(x, axis, name)
    n_ranks = _axis_size(axis_name, name)
    codec.word_format(x.dtype)
    _check_cache(cache, x, axis, n_ranks, name)
    x = lax.stop_gradient(x)
    shard_len = x.shape[axis]
    offset = lax.axis_index(axis_name).astype(jnp.int32) * shard_len
    cached = lax.dynamic_slice_in_dim(cache.exp, offset, shard_len, axis=axis)
    exp, payload, changed = kernels.encode(x, cached, impl=impl)
    tiers = ladder.tiers(x.size)
    # An unprimed cache knows no exponent: all of them count as changed.
    count = jnp.where(cache.primed, jnp.sum(changed, dtype=jnp.int32), changed.size)
    patch_pos, patch_exp = patches.compact(exp, changed, count, offset, axis, n_ranks, tiers)
    bitmap = any(t.bitmap for t in tiers)
    changed_bits = (patches.pack_bits(changed.reshape(-1)) if bitmap
                    else jnp.zeros((0,), jnp.uint8))
    demand = jnp.where(cache.primed, count, jnp.int32(np.iinfo(np.int32).max))
    return Encoded(payload, patch_pos, patch_exp, changed_bits, count, demand, axis, n_ranks,
                   tiers)


def priming_encoded(abstract: Encoded, n_local: int) -> Encoded:
    """A host-side (numpy) :class:`Encoded` that asks for a priming gather, shaped like
    ``abstract`` (an ``Encoded`` or its ``jax.eval_shape``, leading stacked axes allowed).

    Payload and patches are zeros and every exponent counts as changed, so ``demand`` is int32
    max and the exchange takes the plain branch, which sends the shard's own bits: nothing
    needs encoding, e.g. for a fresh or restored cache.
    """
    zero = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    return dataclasses.replace(
        zero, count=np.full(abstract.count.shape, n_local, np.int32),
        demand=np.full(abstract.demand.shape, np.iinfo(np.int32).max, np.int32))


def agree(encoded, axis_name):
    """Phase 2: one ``pmax`` over every tensor's demand, over all manual mesh axes.

    ``encoded`` is an :class:`Encoded` or a pytree of them; returns the same structure of
    int32 scalars, identical on every rank, so every rank picks the same tier.
    """
    leaves, treedef = jax.tree.flatten(encoded, is_leaf=lambda e: isinstance(e, Encoded))
    if not leaves:
        return jax.tree.unflatten(treedef, [])
    mesh_axes = tuple(jax.sharding.get_abstract_mesh().manual_axes) or (axis_name,)
    agreed = lax.pmax(jnp.stack([e.demand for e in leaves]), mesh_axes)
    return jax.tree.unflatten(treedef, list(agreed))


def exchange(x: jax.Array, encoded: Encoded, cache: ExponentCache, agreed, axis_name, *,
             impl: str = "auto"):
    """Phase 3: gather at the agreed tier and rebuild; returns ``(full, new_cache, stats)``.

    ``x`` must be the shard ``encoded`` was made from: the compressed tiers send the payload,
    the plain fallback sends ``x``'s bits; gradients flow to ``x`` as through an all-gather.
    """
    e = encoded
    dtype = np.dtype(x.dtype)
    if tuple(x.shape) != e.shard_shape:
        raise ValueError(f"exchange: shard shape {tuple(x.shape)} differs from the encoded "
                         f"shard {e.shard_shape}; encode and exchange the same tensor")
    tiers = e.tiers
    capacities = [t.capacity for t in tiers] + [x.size]  # the last: plain, everything
    tier = jnp.sum(agreed > jnp.asarray(capacities[:-1], jnp.int32)).astype(jnp.int32)
    branches = [functools.partial(_compressed_branch, tier=t, axis_name=axis_name, dtype=dtype,
                                  impl=impl) for t in tiers]
    branches.append(functools.partial(_plain_branch, axis_name=axis_name, dtype=dtype))
    full, new_exp = lax.switch(tier, branches, e, cache.exp, lax.stop_gradient(x))
    n_local = x.size
    payload_bytes = n_local * codec.word_format(dtype).payload_bytes
    wire = [payload_bytes + t.patch_bytes(n_local) for t in tiers] + [n_local * dtype.itemsize]
    stats = dict(
        sent_bytes=jnp.asarray(wire, jnp.int32)[tier] + AGREEMENT_BYTES,
        plain_bytes=jnp.int32(n_local * dtype.itemsize),
        changed=e.count,
        agreed_changed=jnp.minimum(agreed, n_local).astype(jnp.int32),
        tier=tier,
        capacity=jnp.asarray(capacities, jnp.int32)[tier],
        bitmap=jnp.asarray([t.bitmap for t in tiers] + [False])[tier],
        fallback=tier == len(tiers),
    )
    new_cache = dataclasses.replace(cache, exp=new_exp, primed=jnp.ones_like(cache.primed))
    # The gathered tensor differs by nothing across ranks, but lax.all_gather types it as
    # varying; match that so callers can mix it with per-rank values as they would a gather.
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
        raise TypeError(f"{path}: expected an ExponentCache, got {type(cache).__name__}; "
                        "create one with ciera_jax.init_cache(full_shape, dtype)")
    return True


def _check_cache(cache: ExponentCache, x, axis: int, n_ranks: int, path: str) -> None:
    full = list(x.shape)
    full[axis] *= n_ranks
    if np.dtype(cache.dtype) != np.dtype(x.dtype):
        raise ValueError(f"{path}: the cache was made for {np.dtype(cache.dtype)} but the "
                         f"tensor is {np.dtype(x.dtype)}; rebuild it with init_cache({tuple(full)}"
                         f", {np.dtype(x.dtype).name})")
    if tuple(cache.exp.shape) != tuple(full):
        raise ValueError(
            f"{path}: cache shape {tuple(cache.exp.shape)} does not match the gathered shape "
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
    del cache_exp
    bits = lax.all_gather(codec.to_bits(x), axis_name, axis=e.axis, tiled=True, to="invarying")
    full = codec.from_bits(bits, dtype)
    return full, codec.exponent(full)


def _compressed_branch(e: Encoded, cache_exp, x, *, tier: Tier, axis_name, dtype, impl):
    """Send payload bytes + patches in one uint8 buffer; rebuild from cache + patches."""
    del x
    K, n_planes = tier.capacity, e.payload.shape[0]
    n_local = math.prod(e.shard_shape)
    parts = [e.payload.reshape(-1)]
    if tier.bitmap:
        parts += [e.changed_bits, e.patch_exp[:K]]
    elif K:
        parts += [lax.bitcast_convert_type(e.patch_pos[:K], jnp.uint8).reshape(-1),
                  e.patch_exp[:K]]
    wire_NxL = lax.all_gather(jnp.concatenate(parts), axis_name, axis=0, tiled=False,
                              to="invarying")

    end = n_planes * n_local
    payload = _to_full_layout(wire_NxL[:, :end].reshape(-1, n_planes, n_local), e)
    if tier.bitmap:
        nb = e.changed_bits.size
        changed_NxN, new_NxN = patches.apply_bitmap(wire_NxL[:, end:end + nb],
                                                    wire_NxL[:, end + nb:], n_local)
        exp_full = jnp.where(_to_full_layout(changed_NxN, e), _to_full_layout(new_NxN, e),
                             cache_exp)
    elif K:
        pos = lax.bitcast_convert_type(wire_NxL[:, end:end + 4 * K].reshape(-1, 4), jnp.int32)
        exp_full = patches.apply_sparse(cache_exp, pos, wire_NxL[:, end + 4 * K:].reshape(-1))
    else:
        exp_full = cache_exp
    return kernels.decode(exp_full, payload.reshape((n_planes,) + e.full_shape), dtype,
                          impl=impl), exp_full


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
                bitmap=jnp.bool_(False), fallback=jnp.bool_(False))


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

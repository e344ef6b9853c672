"""Checks on what a caller passes to a gather: clear errors before anything is traced."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from ciera_jax import kernels
from ciera_jax.codec import bitfields
from ciera_jax.collective.cache import is_cache

IMPLS = kernels.IMPLS


def match_tree(caches, treedef, what, is_leaf=None):
    leaves, cdef = jax.tree.flatten(caches, is_leaf=is_leaf)
    if cdef.num_leaves != treedef.num_leaves:
        raise ValueError(f"{what} must mirror the gathered tree: {treedef.num_leaves} tensors "
                         f"but {cdef.num_leaves} {what}; build them with init_cache_tree(tree)")
    return leaves


def broadcast_option(value, treedef, what):
    if value is None or isinstance(value, (bool, int, np.integer)):
        return [value] * treedef.num_leaves
    leaves = jax.tree.leaves(value, is_leaf=lambda v: v is None)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"{what} must be one value or a tree mirroring the gathered tree")
    return leaves


def normalize_axis(x, axis, name) -> int:
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}: gather axis {axis} is out of range for a shard of shape "
                         f"{tuple(x.shape)}; pick an axis in [{-x.ndim}, {x.ndim})")
    return int(axis) % x.ndim


def axis_size(axis_name, name) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{name}: ciera_jax gathers must run inside jax.shard_map with a mesh axis named "
            f"{axis_name!r} (got no such bound axis); wrap the caller in jax.shard_map(..., "
            f"mesh=mesh, in_specs=..., out_specs=...)") from None


def wants_compression(x, cache, compress, path) -> bool:
    if compress is False:
        return False
    if not bitfields.is_compressible(x.dtype):
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


def check_cache(cache, x, axis: int, n_ranks: int, path: str) -> None:
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


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")

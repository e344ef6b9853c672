"""``params_sha256``: one hash of every parameter's bits, the end-of-run proof that two runs
(ciera vs plain, resumed vs straight, multi- vs single-process) trained the same model."""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils


def host_array(x) -> np.ndarray:
    """The whole array on this host (gathered from the other processes when it spans them)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def flat_params(params: nnx.State) -> list[tuple[str, jax.Array]]:
    """(path, array) for every parameter, sorted by path: the fixed order of the hash."""
    items = [("/".join(str(getattr(k, "key", k)) for k in path), x)
             for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    return sorted(items)


def params_sha256(params: nnx.State) -> str:
    h = hashlib.sha256()
    for name, x in flat_params(params):
        a = host_array(x)
        h.update(name.encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()

"""Small helpers shared by the fsdp modules: is a mesh axis bound, does a value vary over it,
module walks and path keys. Kept apart so the other modules import them without cycles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


def _axis_bound(axis_name: str) -> bool:
    try:
        lax.axis_size(axis_name)
        return True
    except (NameError, KeyError, ValueError):
        return False


def _vma(x) -> frozenset:
    """Mesh axes over which ``x`` varies (JAX's varying-manual-axes type)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()))


def invariant(x, axis_name: str, reduce=lax.pmax):
    """Make a per-rank scalar rank-invariant (reduce it only if it still varies over the axis)."""
    x = jnp.asarray(x)
    return reduce(x, axis_name) if axis_name in _vma(x) else x


def _iter_modules(model):
    it = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
    return [(tuple(path), m) for path, m in it]


def _key(path) -> str:
    """'a/b/c' from a pytree path (DictKeys and the like; Variable's ``.value`` is dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            continue
        parts.append(str(getattr(k, "key", getattr(k, "idx", k))))
    return "/".join(parts)


def _is_gathered(module) -> dict | None:
    return getattr(type(module).__call__, "_ciera_gathered", None)

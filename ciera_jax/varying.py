"""Manual-axis types inside ``shard_map``: which mesh axes a value varies over, and casts that
make both sides of a conditional, or a loop's carry in and out, the same type."""

from __future__ import annotations

import jax
from jax import lax


def vma(x) -> set:
    """The mesh axes ``x`` varies over (its type's manual-axis varying set)."""
    t = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # JAX 0.10's type; older ones have .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def varying_like(x, operands, axis_name) -> jax.Array:
    """``x`` typed to vary over every mesh axis ``operands`` vary over, but ``axis_name`` (None:
    every one): both sides of a conditional then return the same type, whatever the inputs
    vary over."""
    want = set().union(*(vma(a) for a in jax.tree.leaves(operands))) - {axis_name}
    missing = tuple(sorted(want - vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def carry_typed(step, init):
    """``init`` typed as ``step(0, init)`` returns it (a loop body that reads values varying
    over more mesh axes than the constant it starts from), so the loop's carry keeps one type."""
    out = jax.eval_shape(step, 0, init)
    return jax.tree.map(lambda a, o: varying_like(a, o, None), init, out)

"""Manual-axis types inside ``shard_map``: which mesh axes a value varies over, casts that make
both sides of a conditional, or a loop's carry in and out, the same type, and the type a
Pallas kernel's outputs must declare under ``check_vma=True``."""

from __future__ import annotations

import jax
from jax import lax


def vma(x) -> set:
    """The mesh axes ``x`` varies over (its type's manual-axis varying set)."""
    t = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # JAX 0.10's type; older ones have .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def varying_over(x, axes) -> jax.Array:
    """``x`` typed to vary over every one of ``axes`` (a cast, the values unchanged): what a
    reduction over all of them takes. JAX 0.11 refuses ``pmax``/``psum`` over an axis its
    input is invariant over; JAX 0.10 took it as the identity there."""
    missing = tuple(sorted(set(axes) - vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def varying_like(x, operands, axis_name) -> jax.Array:
    """``x`` typed to vary over every mesh axis ``operands`` vary over, but ``axis_name`` (None:
    every one): both sides of a conditional then return the same type, whatever the inputs
    vary over."""
    return varying_over(x, set().union(*(vma(a) for a in jax.tree.leaves(operands))) - {axis_name})


def same_types(a_tree, b_tree) -> bool:
    """Whether two pytrees' leaves vary over the same mesh axes."""
    return all(vma(a) == vma(b) for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)))


def typed_cond(pred, true_fn, false_fn):
    """``lax.cond`` of two operand-free branches whose results may vary over different mesh
    axes: each is cast to vary over what either does."""
    outs = [jax.eval_shape(f) for f in (true_fn, false_fn)]
    if same_types(*outs):
        return lax.cond(pred, true_fn, false_fn)  # (and under vmap, typeof can mislead a cast)

    def typed(f):
        def branch():
            return jax.tree.map(lambda a, *o: varying_like(a, o, None), f(), *outs)
        return branch

    return lax.cond(pred, typed(true_fn), typed(false_fn))


def kernel_out_types(out_types, args):
    """``out_types`` (a ``ShapeDtypeStruct`` or a tuple of them) declared to vary over every
    mesh axis an argument of the kernel varies over: a kernel computes its outputs from its
    arguments, and ``shard_map(..., check_vma=True)`` (JAX's default) refuses a Pallas output
    without a declared manual-axis type."""
    manual_axis_type = getattr(jax.sharding, "ManualAxisType", None)
    if manual_axis_type is None:  # a JAX without manual-axis types: nothing to declare
        return out_types
    mat = manual_axis_type(varying=frozenset().union(*(vma(a) for a in jax.tree.leaves(args))))
    try:
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_types)
    except TypeError:  # a JAX whose ShapeDtypeStruct names it otherwise: as before
        return out_types

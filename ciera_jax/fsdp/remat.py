"""What a prepared layer stack saves for its backward (``remat``, named like MaxText's
``remat_policy``), without ever saving a gathered weight.

A prepared stack (:mod:`~ciera_jax.fsdp.prepared`) runs its layers inside one custom VJP whose
backward gets every layer's full weights again from the shards and caches (word caches: read,
exponent caches: sign + mantissa regathered, the rest regathered). Which activations the
forward keeps is the policy:

- ``full``: only each layer's input; the backward recomputes the whole layer (least memory).
- ``save_dot_except_mlp``: also the attention's projections, the values a layer tags with
  ``jax.ad_checkpoint.checkpoint_name`` as ``query_proj``, ``key_proj``, ``value_proj``,
  ``out_proj`` (MaxText's names), through ``jax.checkpoint_policies.save_only_these_names``;
  the MLP / expert matmuls and the attention core are recomputed.
- ``none``: everything the layer's autodiff keeps (no recompute, most memory).

Saving goes through ``jax.vjp``: the forward takes the layer's VJP, keeps its residuals except
the weights (found by identity among the residuals, as ``jax.vjp`` forwards its inputs), and
the backward rebuilds the VJP from the residuals and the weights it got again. So no policy
keeps a gathered weight across the layers: :func:`vjp_saving` raises if a residual could be
one. The backward's cotangents through its layer scan (float0 leaves as placeholders) are here
too: :func:`drop_float0` and its kin.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax.fsdp.state.setup import check_policy

# The checkpoint names of a layer's attention projections (MaxText's).
ATTENTION_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj")


def saves_activations(policy: str) -> bool:
    """Whether the forward keeps more than each layer's input (not ``full``)."""
    return check_policy(policy) != "full"


def under_policy(fn: Callable, policy: str) -> Callable:
    """``fn`` as its VJP should save under ``policy`` (``none``: as it is)."""
    if check_policy(policy) == "none":
        return fn
    if policy == "save_dot_except_mlp":
        names = jax.checkpoint_policies.save_only_these_names(*ATTENTION_PROJECTIONS)
        return jax.checkpoint(fn, policy=names, prevent_cse=False)  # in a scan: no CSE to stop
    raise ValueError(f"remat {policy!r} saves nothing but the layer's input: recompute instead")


@dataclasses.dataclass
class Layout:
    """Where each leaf of a layer's VJP comes from: ``("weight", i)``, ``("input", i)`` (the
    backward has them), ``("saved", i)`` (a residual the forward keeps) or ``("static",
    value)``. Filled while the forward is traced, read when the backward is traced (a custom
    VJP traces its forward first)."""

    treedef: Any = None
    spec: tuple = ()


def vjp_saving(layout: Layout, fn: Callable, weights, inputs) -> tuple[Any, list]:
    """``(fn(weights, inputs), saved)``: the residuals of ``fn``'s VJP other than ``weights``
    and ``inputs`` themselves, with ``layout`` recording how :func:`vjp_rebuilt` puts them
    back. Raises if a saved residual is shaped like a weight it did not find by identity
    (a gathered weight kept in a copy would defeat FSDP's memory)."""
    out, f_vjp = jax.vjp(fn, weights, inputs)
    leaves, treedef = jax.tree.flatten(f_vjp)
    w_leaves, i_leaves = jax.tree.leaves(weights), jax.tree.leaves(inputs)
    w_at = {id(a): k for k, a in enumerate(w_leaves)}
    i_at = {id(a): k for k, a in enumerate(i_leaves)}
    spec, saved = [], []
    for leaf in leaves:
        if id(leaf) in w_at:
            spec.append(("weight", w_at[id(leaf)]))
        elif id(leaf) in i_at:
            spec.append(("input", i_at[id(leaf)]))
        elif isinstance(leaf, jax.Array):
            spec.append(("saved", len(saved)))
            saved.append(leaf)
        else:
            spec.append(("static", leaf))
    found = {k for kind, k in spec if kind == "weight"}
    unfound = {(tuple(a.shape), a.dtype) for k, a in enumerate(w_leaves) if k not in found}
    copies = [s for s in saved if (tuple(s.shape), s.dtype) in unfound]
    if copies:
        raise ValueError(f"remat would save {len(copies)} residual(s) shaped like gathered "
                         f"weights ({copies[0].shape} {copies[0].dtype}); the weights must "
                         "reach the layer's VJP as they are")
    layout.treedef, layout.spec = treedef, tuple(spec)
    return out, saved


def vjp_rebuilt(layout: Layout, weights, inputs, saved: list) -> Callable:
    """The VJP :func:`vjp_saving` took, from the weights and inputs the backward has and the
    residuals the forward saved."""
    w_leaves, i_leaves = jax.tree.leaves(weights), jax.tree.leaves(inputs)
    pick = {"weight": w_leaves.__getitem__, "input": i_leaves.__getitem__,
            "saved": saved.__getitem__, "static": lambda v: v}
    return jax.tree.unflatten(layout.treedef, [pick[kind](k) for kind, k in layout.spec])


# The backward's cotangents through its layer scan: float0 cotangents (integer state, integer
# arguments) cannot ride in a scan, so they travel as bool placeholders and come back as float0.

def zero_cotangents(tree):
    """Zero cotangents of ``tree`` as :func:`drop_float0` leaves them: zeros for inexact
    leaves, a bool scalar placeholder for the rest."""
    return jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.result_type(a))
                        if jnp.issubdtype(jnp.result_type(a), jnp.inexact)
                        else jnp.zeros((), jnp.bool_), tree)


def float0_like(tree):
    """Zero cotangents of ``tree`` as a custom VJP returns them: zeros for inexact leaves,
    float0 for the rest (integer state, integer arguments)."""
    def one(a):
        a = jnp.asarray(a) if not hasattr(a, "dtype") else a
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)
    return jax.tree.map(one, tree)


def drop_float0(tree):
    """float0 cotangent leaves as a bool scalar placeholder (:func:`with_float0` undoes it)."""
    return jax.tree.map(lambda c: jnp.zeros((), jnp.bool_)
                        if getattr(c, "dtype", None) == jax.dtypes.float0 else c, tree)


def with_float0(primal, ct):
    """Cotangents of ``primal``: ``ct``'s leaves for inexact leaves, float0 for the rest."""
    return jax.tree.map(lambda p, c: c if jnp.issubdtype(jnp.result_type(p), jnp.inexact)
                        else np.zeros(jnp.shape(p), jax.dtypes.float0), primal, ct)

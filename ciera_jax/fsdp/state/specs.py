"""From the gathered parameters to JAX shardings: PartitionSpecs for a model's states (the
``shard_map`` programming model), placing host values on a mesh, and re-merging states at the
current trace level."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.fsdp.state.axes import AXIS
from ciera_jax.fsdp.state.caches import GatherCacheVar, param_key
from ciera_jax.fsdp.state.discovery import path_key
from ciera_jax.fsdp.state.inventory import gatherers
from ciera_jax.runtime.partition import check_divisible, spec_for, without_axis


def _split(model: nnx.Module, axis_name: str) -> tuple[dict, dict]:
    """From one walk over the model (:func:`~ciera_jax.fsdp.gatherers`): ``{parameter path:
    split axis}`` (counted in the held, possibly stacked, value) of every parameter a module
    gathering over ``axis_name`` gathers, and ``{parameter path: spec entries of the held
    value}`` (layer axes first, whole) of those whose spec names other mesh axes (``tp``)."""
    axes, full = {}, {}
    for g in gatherers(model):
        if g.spec.axis_name != axis_name:
            continue
        for p in g.params:
            axes[g.key(p)] = p.axis
            if any(without_axis(p.spec, axis_name)):
                full[g.key(p)] = (None,) * p.lead + tuple(p.spec)
    return axes, full


def split_axes(model: nnx.Module, axis_name: str = AXIS) -> dict[str, int]:
    """``{parameter path: split axis}`` of every parameter gathered over ``axis_name``."""
    return _split(model, axis_name)[0]


def state_specs(model: nnx.Module, state, axis_name: str = AXIS, n: int | None = None):
    """PartitionSpecs for ``state`` (e.g. ``nnx.split(model, nnx.Param, ...)[1]``), one per
    Variable: a prefix tree usable as ``shard_map`` in/out specs. Gathered parameters are split
    on their axis and keep their other mesh axes (``tp``); their caches are split like the
    gathered weight (the parameter's spec without ``axis_name``); everything else (norms,
    stats) replicated. With ``n`` given, checks that the mesh size divides every split
    dimension."""
    axes, full = _split(model, axis_name)

    def one(path, var):
        key = path_key(path)
        axis = axes.get(key)
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        shape = tuple(getattr(value, "shape", ()))
        if n is not None:
            check_divisible(key, shape, axis, n, axis_name)
        if key in full:
            return P(*full[key])
        param = param_key(path, var) if isinstance(var, GatherCacheVar) else None
        if param in full:
            kept = without_axis(full[param], axis_name)
            return var.replace(value=jax.tree.map(
                lambda leaf: P(*kept) if len(getattr(leaf, "shape", ())) == len(kept) else P(),
                value))
        return spec_for(axis, len(shape), axis_name)

    return jax.tree_util.tree_map_with_path(one, state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_specs(model: nnx.Module, axis_name: str = AXIS, n: int | None = None):
    """:func:`state_specs` of the model's parameters."""
    return state_specs(model, nnx.state(model, nnx.Param), axis_name, n)


def spec_pairs(specs, tree):
    """(spec, subtree) pairs: ``specs`` is a prefix of ``tree`` with PartitionSpec leaves."""
    pairs = []
    jax.tree.map(lambda s, sub: pairs.append((s, sub)), specs, tree,
                 is_leaf=lambda s: isinstance(s, P))
    return pairs


def is_split(spec: P, axis_name: str) -> bool:
    return any(a == axis_name or (isinstance(a, tuple) and axis_name in a) for a in spec)


def put(tree, specs, mesh):
    """Host values -> global arrays laid out by ``specs`` (a prefix tree of PartitionSpecs)
    on ``mesh``; works multi-process too (every process passes the same full values)."""

    def one(s, x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, s), lambda i: x[i])

    return jax.tree.map(lambda s, sub: jax.tree.map(functools.partial(one, s), sub),
                        specs, tree, is_leaf=lambda s: isinstance(s, P))


def merge(graphdef, *states):
    """``nnx.merge`` with fresh Variables at the current trace level.

    Use it inside the traced loss function: decorated calls update exponent caches and stats
    in place, and NNX refuses to mutate Variables created at an outer trace level (e.g. states
    that came in through ``shard_map`` and are passed to ``jax.grad`` as non-differentiated
    arguments).
    """
    return nnx.merge(graphdef, *jax.tree.map(lambda x: x, states))

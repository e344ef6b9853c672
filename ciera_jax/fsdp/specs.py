"""From the rule table to JAX shardings: PartitionSpecs for a model's states, placing host
values on a mesh, and re-merging states at the current trace level."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ciera_jax.fsdp._util import _is_gathered, _iter_modules
from ciera_jax.fsdp.layer_stack import _stack_of
from ciera_jax.fsdp.rules import AXIS, RULES, check_divisible, param_axis, spec_for


def param_specs(model: nnx.Module, axis_name: str = AXIS, n: int | None = None):
    """PartitionSpecs (pure dict mirroring ``nnx.state(model, nnx.Param)``) from rules/metadata.

    With ``n`` given, checks that the mesh size divides every split dimension.
    """
    specs: dict = {}
    mods = dict(_iter_modules(model))
    for path, module in mods.items():
        info = _is_gathered(module)
        rules = info["rules"] if info else RULES
        stacked = 1 if _stack_of(path, mods)[0] else 0
        for name, var in vars(module).items():
            if not isinstance(var, nnx.Param):
                continue
            axis = param_axis(name, var, rules) if info else None
            if axis is not None:
                axis += stacked  # stacked layers: the layer axis comes first
            shape = var.get_value().shape
            if n is not None:
                check_divisible("/".join(map(str, (*path, name))), shape, axis, n)
            d = specs
            for p in path:
                d = d.setdefault(p, {})
            d[name] = spec_for(axis, len(shape), axis_name)
    return specs


def _spec_pairs(specs, tree):
    """(spec, subtree) pairs: ``specs`` is a prefix of ``tree`` with PartitionSpec leaves."""
    pairs = []
    jax.tree.map(lambda s, sub: pairs.append((s, sub)), specs, tree,
                 is_leaf=lambda s: isinstance(s, P))
    return pairs


def _is_split(spec: P, axis_name: str) -> bool:
    return any(a == axis_name or (isinstance(a, tuple) and axis_name in a) for a in spec)


def state_specs(model: nnx.Module, state: nnx.State, axis_name: str = AXIS, n: int | None = None):
    """PartitionSpecs for ``state`` (e.g. ``nnx.split(model, nnx.Param, ...)[1]``), one per
    Variable: a prefix tree usable as ``shard_map`` in/out specs. See :func:`param_specs`."""
    spec_dict = param_specs(model, axis_name, n)

    def one(path, _):
        d = spec_dict
        for k in path:
            d = d[getattr(k, "key", getattr(k, "name", k))]
        return d

    return jax.tree_util.tree_map_with_path(one, state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def put(tree, specs, mesh):
    """Host values -> global arrays laid out by ``specs`` (a prefix tree of PartitionSpecs)
    on ``mesh``; works multi-process too (every process passes the same full values)."""
    from jax.sharding import NamedSharding

    def one(s, x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, s), lambda i: x[i])

    return jax.tree.map(lambda s, sub: jax.tree.map(functools.partial(one, s), sub),
                        specs, tree, is_leaf=lambda s: isinstance(s, P))


def merge(graphdef, *states):
    """``nnx.merge`` with fresh Variables at the current trace level.

    Use it inside the traced loss function: the decorator updates the exponent caches in
    place, and NNX refuses to mutate Variables created at an outer trace level (e.g. states
    that came in through ``shard_map`` and are passed to ``jax.grad`` as non-differentiated
    arguments).
    """
    return nnx.merge(graphdef, *jax.tree.map(lambda x: x, states))

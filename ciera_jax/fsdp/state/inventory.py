"""The one walk over a model (:func:`gatherers`): every gathering module and the parameters it
gathers. The caches, the state specs and a prepared step read it, and so does the tensor
inventory (:func:`gathered_tensors`: every gathered parameter keyed by its path, with one
layer's full shape and the stack it belongs to), which the trainer and the planner read;
abstract shapes are enough."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from ciera_jax.fsdp.state.discovery import (GatherSpec, ShardedParam, gather_spec, iter_modules,
                                            path_key, sharded_params)
from ciera_jax.fsdp.state.stacking import stack_of


@dataclasses.dataclass(frozen=True)
class GatheredTensor:
    """One sharded parameter that is gathered before use.

    ``key``: module path + parameter path (``layers/mlp/w_gate_ExDxF``), the key of its cache,
    encoded payload, plan decision and stats; ``axis``: the split axis of ONE layer's tensor;
    ``shape``: one layer's full (gathered) shape; ``stack``: layers stacked on a leading axis
    (0: a single tensor) and ``stack_path`` the stack's module path; ``spec``: one layer's
    partitioning, one entry per dimension (the gather axis at ``axis``, other mesh axes such
    as ``tp`` where the parameter keeps them; empty: split over the gather axis only);
    ``gatherer``: the path of the module that gathers it (its bucket's module, see
    :mod:`ciera_jax.fsdp.buckets`).
    """

    key: str
    axis: int
    shape: tuple[int, ...]
    dtype: object
    stack: int = 0
    stack_path: str = ""
    spec: tuple = ()
    gatherer: str = ""

    def layer_key(self, layer: int) -> str:
        """``layers/3/mlp/w_gate_ExDxF`` for layer 3 of a stacked tensor (the key otherwise)."""
        if not self.stack:
            return self.key
        return f"{self.stack_path}/{layer}{self.key[len(self.stack_path):]}"


@dataclasses.dataclass(frozen=True)
class Gatherer:
    """One gathering module of a model: its ``path``, the ``module``, its options (``spec``),
    the layers of the stack it lies in (``layers``, 0: none; ``stack_path``) and the
    parameters it gathers (``params``, keys below the module)."""

    path: tuple
    module: nnx.Module
    spec: GatherSpec
    layers: int
    stack_path: tuple
    params: tuple[ShardedParam, ...]

    def key(self, p: ShardedParam) -> str:
        """The model-wide key of parameter ``p`` (``layers/mlp/w_gate_ExDxF``)."""
        return self.key_of(p.key)

    def key_of(self, name: str) -> str:
        """The model-wide key of ``name`` below the module (a parameter's or a bucket's)."""
        return "/".join(map(str, (*self.path, name)))


def gatherers(model: nnx.Module) -> list[Gatherer]:
    """The one walk over a model: every gathering module and the parameters it gathers, in
    model order. The tensor inventory, the caches, the state specs and a prepared step read
    it."""
    mods = dict(iter_modules(model))
    out = []
    for path, module in mods.items():
        spec = gather_spec(module)
        if spec is None:
            continue
        n, spath = stack_of(path, mods)
        params = tuple(sharded_params(module, spec, lead=1 if n else 0, strict=False))
        out.append(Gatherer(path, module, spec, n, spath, params))
    return out


def gathered_tensors(model: nnx.Module) -> dict[str, GatheredTensor]:
    """Every parameter a gathering module gathers, keyed by path (model order)."""
    out = {}
    for g in gatherers(model):
        for p in g.params:
            out[g.key(p)] = GatheredTensor(g.key(p), p.axis - p.lead, p.layer_shape,
                                           g.spec.dtype or p.var.get_value().dtype,
                                           g.layers, "/".join(map(str, g.stack_path)), p.spec,
                                           "/".join(map(str, g.path)))
    return out


def param_dict(params: nnx.State) -> dict:
    """``{path key: array}`` of a parameter state."""
    return {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}

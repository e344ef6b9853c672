"""The tensor inventory of a model's gathers: every parameter a decorated module gathers, keyed
by its path, with one layer's full shape and the stack it belongs to. The trainer, the planner
and the engine read it; it is computed once from the model (abstract shapes are enough)."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from ciera_jax.fsdp.discovery import gather_spec, iter_modules, path_key, sharded_params
from ciera_jax.fsdp.stacking import stack_of


@dataclasses.dataclass(frozen=True)
class GatheredTensor:
    """One sharded parameter that is gathered before use.

    ``key``: module path + parameter path (``layers/mlp/w_gate_ExDxF``), the key of its cache,
    encoded payload, plan decision and stats; ``axis``: the split axis of ONE layer's tensor;
    ``shape``: one layer's full (gathered) shape; ``stack``: layers stacked on a leading axis
    (0: a single tensor) and ``stack_path`` the stack's module path; ``spec``: one layer's
    partitioning, one entry per dimension (the gather axis at ``axis``, other mesh axes such
    as ``tp`` where the parameter keeps them; empty: split over the gather axis only).
    """

    key: str
    axis: int
    shape: tuple[int, ...]
    dtype: object
    stack: int = 0
    stack_path: str = ""
    spec: tuple = ()

    def layer_key(self, layer: int) -> str:
        """``layers/3/mlp/w_gate_ExDxF`` for layer 3 of a stacked tensor (the key otherwise)."""
        if not self.stack:
            return self.key
        return f"{self.stack_path}/{layer}{self.key[len(self.stack_path):]}"


def gathered_tensors(model: nnx.Module) -> dict[str, GatheredTensor]:
    """Every parameter a decorated module gathers, keyed by path (model order)."""
    out = {}
    mods = dict(iter_modules(model))
    for path, module in mods.items():
        spec = gather_spec(module)
        if spec is None:
            continue
        n, spath = stack_of(path, mods)
        for p in sharded_params(module, spec, lead=1 if n else 0, strict=False):
            key = "/".join(map(str, (*path, p.key)))
            if key in out:  # under two decorated modules: the outer one gathers it
                continue
            out[key] = GatheredTensor(key, p.axis - p.lead, p.layer_shape,
                                      spec.dtype or p.var.get_value().dtype,
                                      n, "/".join(map(str, spath)), p.spec)
    return out


def param_dict(params: nnx.State) -> dict:
    """``{path key: array}`` of a parameter state."""
    return {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}

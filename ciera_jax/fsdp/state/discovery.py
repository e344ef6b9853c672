"""Which parameters a decorated module gathers, and along which axis.

Every ``nnx.Param`` anywhere under the decorated module (Flax layers included) is looked up in
three sources, first match wins:

1. Flax's own partitioning metadata (``nnx.with_partitioning``: the ``out_sharding`` /
   ``sharding_names`` that ``nnx.get_partition_spec`` reads). Naming the gather axis splits
   that dimension; naming only other axes (or None) says "replicated over it".
2. ``fsdp_axis`` metadata on the parameter (an axis of one layer's tensor).
3. The rule table passed to :func:`~ciera_jax.fsdp.gathered` (regexes over the parameter's
   path below the decorated module, e.g. ``up/kernel``).

A weight of two or more dimensions that no source covers is an error, unless the decorator's
``replicate=`` opts in (a regex, or True for all). Vectors (norms, biases) stay replicated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from flax import nnx
from flax.nnx import spmd

from ciera_jax.runtime.partition import Rules, rule_matches

GATHER_ATTR = "ciera_gather_spec"  # on a decorated __call__: its GatherSpec
PATH_ATTR = "ciera_path"  # on a module (set by attach_caches): its path in the model


@dataclasses.dataclass(frozen=True)
class GatherSpec:
    """A decorator's options: the mesh axis, the compute dtype, the rule table, and what may
    stay replicated (``replicate``: a regex over parameter paths, or True for every weight no
    source covers)."""

    axis_name: str
    dtype: Any
    rules: Rules
    replicate: str | bool


@dataclasses.dataclass(frozen=True)
class ShardedParam:
    """One parameter to gather: ``key`` its path below the decorated module (``up/kernel``),
    ``owner``/``name`` the module attribute holding it, ``axis`` its split axis counted in the
    value it holds, ``lead`` how many leading axes are stacked layers (never split), ``spec``
    one layer's partitioning entries."""

    key: str
    owner: Any
    name: str
    var: nnx.Variable
    axis: int
    lead: int = 0
    spec: tuple = ()
    path: tuple = ()  # the graph path below the decorated module (key, with list indices)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return tuple(self.var.get_value().shape)[self.lead:]


def gather_spec(module) -> GatherSpec | None:
    return getattr(getattr(type(module), "__call__", None), GATHER_ATTR, None)


def module_path(module) -> str:
    """The module's path in the model (set by ``attach_caches``), else its class name."""
    return getattr(module, PATH_ATTR, type(module).__name__)


def module_name(module) -> str:
    """How error messages name a module: its path, or its class name at the root."""
    return module_path(module) or type(module).__name__


def set_module_path(module, path: str) -> None:
    object.__setattr__(module, PATH_ATTR, path)


def path_key(path) -> str:
    """'a/b/c' from a graph or pytree path (DictKeys and the like; ``.value`` is dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            continue
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return "/".join(parts)


def iter_modules(model) -> list[tuple[tuple, nnx.Module]]:
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]


def iter_params(module, nested: bool = False) -> list[tuple[tuple, Any, str, nnx.Variable]]:
    """(path, owner, attribute name, Param) of every parameter under ``module``, except (unless
    ``nested``) those under a decorated sub-module: it gathers its own when called."""
    nodes = {tuple(p): n for p, n in nnx.iter_graph(module)}
    out = []
    for path, node in nodes.items():
        if not (isinstance(node, nnx.Param) and path):
            continue
        if not nested and any(gather_spec(nodes[path[:i]]) is not None
                              for i in range(1, len(path))):
            continue
        out.append((path, nodes[path[:-1]], str(path[-1]), node))
    return out


def flax_spec(var: nnx.Variable) -> tuple | None:
    """The partitioning Flax records for ``var`` (None: it records none)."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    if meta.get("out_sharding"):
        return tuple(spmd.get_var_pspec(var))
    for name in ("sharding_names", "sharding"):
        if meta.get(name):
            return tuple(meta[name])
    return None


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def split_axis(key: str, var: nnx.Variable, spec: GatherSpec, lead: int, where: str,
               strict: bool = True) -> tuple[int | None, int, tuple]:
    """(split axis counted in the held value or None, stacked leading axes, one layer's
    partitioning entries) of one param. ``strict=False`` (walks over a whole model) leaves an
    uncovered weight replicated: the call itself checks.

    Flax's partitioning may name more dimensions than one layer has (a layer axis that
    ``nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})`` inserted, still there inside
    an ``nnx.scan`` without ``transform_metadata``) or fewer (``nnx.vmap`` without it): one
    layer's entries are aligned from the right, and an extra leading entry must not split.
    """
    ndim = len(var.get_value().shape)
    fspec = flax_spec(var)
    if fspec is not None:
        layer_ndim = ndim - lead
        if len(fspec) < layer_ndim:
            lead, layer_ndim = ndim - len(fspec), len(fspec)
        local = tuple(fspec[len(fspec) - layer_ndim:]) if layer_ndim else ()
        extra = tuple(fspec[:len(fspec) - layer_ndim])
        if any(_names(e) for e in extra):
            raise ValueError(f"{where}/{key}: partitioning {fspec} splits a stacked layer axis "
                             f"of the parameter {tuple(var.get_value().shape)}; stack layers "
                             f"with nnx.vmap(..., transform_metadata={{nnx.PARTITION_NAME: "
                             f"None}}) so the layer axis stays whole")
        hits = [i for i, e in enumerate(local) if spec.axis_name in _names(e)]
        if not hits:
            return None, lead, local
        if len(hits) > 1 or len(_names(local[hits[0]])) > 1:
            raise ValueError(f"{where}/{key}: its partitioning {fspec} splits one dimension over "
                             f"several mesh axes or names {spec.axis_name!r} twice; split one "
                             f"dimension over {spec.axis_name!r} alone")
        return lead + hits[0], lead, local
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    layer_ndim = ndim - lead

    def only(axis):
        if axis is None:
            return None, lead, ()
        axis = axis % layer_ndim
        return lead + axis, lead, tuple(spec.axis_name if i == axis else None
                                        for i in range(layer_ndim))

    if "fsdp_axis" in meta:
        return only(meta["fsdp_axis"])
    matched, axis = rule_matches(key, spec.rules)
    if matched:
        return only(axis)
    if not strict or layer_ndim < 2 or spec.replicate is True or (
            isinstance(spec.replicate, str) and re.fullmatch(spec.replicate, key)):
        return None, lead, ()
    raise ValueError(
        f"{where}/{key}: no sharding for this {layer_ndim}-D weight "
        f"{tuple(var.get_value().shape)}: annotate it the Flax way "
        f"(kernel_init=nnx.with_partitioning(init, ({spec.axis_name!r}, None))), give it "
        f"fsdp_axis= metadata or a rule in @gathered(rules=...), or keep it whole with "
        f"@gathered(replicate={key!r})")


def sharded_params(module, spec: GatherSpec, lead: int = 0,
                   strict: bool = True) -> list[ShardedParam]:
    """The parameters under ``module`` that ``spec`` splits, in graph order."""
    where = module_name(module)
    out = []
    for path, owner, name, var in iter_params(module):
        key = "/".join(map(str, path))
        axis, plead, local = split_axis(key, var, spec, lead, where, strict)
        if axis is not None and axis < plead:
            raise ValueError(f"{where}/{key}: split axis {axis} is a stacked layer axis; split "
                             "a dimension of one layer's tensor")
        if axis is not None:
            out.append(ShardedParam(key, owner, name, var, axis, plead, local, path))
    return out

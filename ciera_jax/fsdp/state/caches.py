"""Gather caches as module state: one :class:`GatherCacheVar` per gathered parameter,
attached beside it on the module that holds it (``kernel`` -> ``kernel_gather_cache``), the
gather stats of every gathering module (zeros until the first gather), and conversions between
cache states and ``{parameter path: cache}`` dicts. Derived state, like batch-norm statistics:
carried through the step, never checkpointed.

A cache is shaped like the parameter gathered over the FSDP axis and stays split over the
parameter's other mesh axes (tensor, expert parallel), like the gathered weight; a stacked
layer's cache (``fsdp.stack`` or ``nnx.vmap``) has the layer axis first, one per layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax.collective.cache as cache_lib
from ciera_jax.fsdp.state.discovery import iter_modules, path_key, set_module_path
from ciera_jax.fsdp.state.inventory import gatherers
from ciera_jax.runtime.partition import without_axis
from ciera_jax.fsdp.state.stacking import stack_size
from ciera_jax.fsdp.state.stats import ensure_stats

CACHE_MODES = ("exponent", "word", "auto")
PLAIN_ATTR = "ciera_plain"  # on a module: keys of params the plan gathers plain (no cache)


class GatherCacheVar(nnx.Variable):
    """The cache of one gathered parameter: an exponent cache (1 B/param) or a word cache
    (2 B per bf16 param), shaped like the parameter gathered over the FSDP axis. Its
    ``param`` metadata names the parameter beside it (same module) that it serves.

    Derived state: it is carried through the train step like optimizer state but never
    checkpointed; a fresh (unprimed) cache re-primes on its first gather, bitwise exactly.
    """


ExponentCacheVar = GatherCacheVar  # the name before word caches; kept for one release


def cache_attr(name: str) -> str:
    """The attribute beside parameter ``name`` that holds its cache."""
    return f"{name}_gather_cache"


def param_key(path, var: GatherCacheVar) -> str:
    """The path key of the parameter a cache at ``path`` serves (read from its metadata)."""
    owner = path_key(path).rpartition("/")[0]
    return f"{owner}/{var.param}" if owner else var.param


def new_cache(layer_shape, dtype, layers: int = 0, mode: str = "exponent"):
    """An unprimed cache for one layer's full tensor; stacked ``layers`` deep when nonzero."""
    if layers:
        return jax.vmap(lambda _: cache_lib.init_cache(layer_shape, dtype, mode))(
            jnp.zeros(layers))
    return cache_lib.init_cache(layer_shape, dtype, mode)


def _concrete_mesh():
    """The mesh ``jax.set_mesh`` set (None: none, or under a transform, where values are
    traced and stay as made)."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside a trace (e.g. a layer built under nnx.vmap)
        return None
    return None if mesh.empty else mesh


def placer(spec_entries: tuple = (), layers: int = 0):
    """Puts a new cache or stats tree on the ambient mesh: leaves of the tensor's rank split
    like the gathered weight (``spec_entries``: one layer's spec without the FSDP axis), the
    rest replicated. Without a concrete mesh (or under a transform) values stay as made."""
    mesh = _concrete_mesh()
    if mesh is None:
        return lambda tree: tree
    lead = (None,) * (1 if layers else 0)
    full = P(*lead, *spec_entries)
    rank = len(lead) + len(spec_entries)

    def one(x):
        if isinstance(x, jax.core.Tracer):
            return x
        s = full if spec_entries and x.ndim == rank else P()
        return jax.device_put(x, NamedSharding(mesh, s))

    return lambda tree: jax.tree.map(one, tree)


def _local_shape(p, spec_entries, mesh) -> tuple[int, ...]:
    """One layer's shape gathered over FSDP, local to the other mesh axes (what a device
    holds of the cache: the planner prices that)."""
    shape = list(p.layer_shape)
    if mesh is None or mesh.empty:
        return tuple(shape)
    for i, e in enumerate(spec_entries):
        for a in ((e,) if isinstance(e, str) else tuple(e or ())):
            shape[i] //= mesh.shape[a]
    return tuple(shape)


def _planned_modes(found, axis_size: int, memory_gb, profile) -> dict:
    """``mode="auto"``: the planner's mode per tensor (plain / exponent / word) for the
    per-device block, within ``memory_gb`` of caches per device (None: unlimited)."""
    # the planner is a tool above fsdp: import it late
    from ciera_jax.planning import links, planner

    if profile is None:
        device = jax.devices()[0]
        profile = links.default_profile(device.platform, device.device_kind)
    tree = {k: jax.ShapeDtypeStruct(((layers,) if layers else ()) + shape, dtype)
            for k, (shape, dtype, layers) in found.items()}
    budget = None if memory_gb is None else float(memory_gb) * 1e9
    return planner.plan_modes(tree, axis_size, profile, cache_budget_bytes=budget)


def attach_caches(model: nnx.Module, mode: str = "exponent", *, memory_gb=None,
                  profile=None, stats: bool | None = None) -> nnx.Module:
    """Give every gathered parameter an unprimed cache beside it and every gathering module
    its gather stats (zeros); name module paths. Returns the model.

    ``mode``: ``"exponent"`` (1 B/param, sends ~0.58 of plain), ``"word"`` (2 B per bf16
    param, sends ~0.25 of plain at steady state) or ``"auto"``: the planner picks plain,
    exponent or word per tensor for the best step time within ``memory_gb`` of caches per
    device (None: unlimited; ``profile``: a link profile name, default by platform).

    Call once on the model built with its full (global) parameter shapes, eagerly sharded or
    not, after :func:`~ciera_jax.fsdp.shard`. Layers stacked with :func:`~ciera_jax.fsdp.stack`
    or with ``nnx.vmap`` get one cache per layer; an abstract model (``nnx.eval_shape``) gets
    abstract caches. Idempotent: a parameter that has a cache keeps it. Everything a step
    changes exists from here on, so ``nnx.jit`` traces once.

    ``stats``: create the :class:`~ciera_jax.fsdp.GatherStats` variables now (True) or on
    the first call (False: a state split as ``nnx.split(model, nnx.Param, GatherCacheVar)``
    with no ``...`` then has no remainder). Default: when a mesh is set (``jax.set_mesh``,
    the ``nnx.jit`` way, where a variable made on the first call would trace it again).
    """
    if mode not in CACHE_MODES:
        raise ValueError(f"attach_caches: unknown mode {mode!r}; choose one of {CACHE_MODES}")
    mesh = jax.sharding.get_abstract_mesh()
    for path, module in iter_modules(model):  # stacks run by scan_layers name theirs too
        if stack_size(module):
            set_module_path(module, "/".join(map(str, path)))
    todo = []
    for g in gatherers(model):
        set_module_path(g.module, "/".join(map(str, g.path)))
        for p in g.params:
            if p.lead > 1:
                raise ValueError(f"{g.key(p)}: {p.lead} stacked axes; one layer axis is "
                                 "supported")
            todo.append((g, p, g.layers or (p.var.get_value().shape[0] if p.lead else 0)))
    if mode == "auto":
        found = {g.key(p): (_local_shape(p, without_axis(p.spec, g.spec.axis_name), mesh),
                            g.spec.dtype or p.var.get_value().dtype, n) for g, p, n in todo}
        n_fsdp = {1 if mesh.empty else mesh.shape.get(g.spec.axis_name, 1) for g, _, _ in todo}
        modes = _planned_modes(found, max(n_fsdp or {1}), memory_gb, profile) if found else {}
    for g, p, n in todo:
        m = modes[g.key(p)] if mode == "auto" else mode
        if m == "plain":
            plain = set(getattr(p.owner, PLAIN_ATTR, ()))
            object.__setattr__(p.owner, PLAIN_ATTR, frozenset(plain | {p.name}))
            continue
        if not hasattr(p.owner, cache_attr(p.name)):
            value = p.var.get_value()
            make = functools.partial(new_cache, p.layer_shape, g.spec.dtype or value.dtype, n, m)
            if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model: abstract caches
                cache = jax.eval_shape(make)
            else:
                cache = placer(without_axis(p.spec, g.spec.axis_name), n)(make())
            setattr(p.owner, cache_attr(p.name), GatherCacheVar(cache, param=p.name))
    per_module: dict = {}
    for g, p, n in todo:
        per_module.setdefault(id(g.module), (g.module, n, []))[2].append(p.key)
    if stats is None:
        stats = not mesh.empty
    for module, n, keys in per_module.values() if stats else ():
        ensure_stats(module, keys, n, placer())
    return model


def cache_dict(caches: nnx.State) -> dict:
    """``{parameter path: cache}`` from a state of :class:`GatherCacheVar`."""
    out = {}
    pairs = jax.tree_util.tree_flatten_with_path(
        caches, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    for path, var in pairs:
        out[param_key(path, var)] = var.get_value()
    return out


def with_caches(caches: nnx.State, new: dict) -> nnx.State:
    """``caches`` with the entries of ``new`` (``{parameter path: cache}``) replaced."""

    def one(path, var):
        k = param_key(path, var)
        return var.replace(value=new[k]) if k in new else var

    return jax.tree_util.tree_map_with_path(one, caches,
                                            is_leaf=lambda v: isinstance(v, nnx.Variable))

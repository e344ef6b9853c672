"""FSDP for Flax NNX: one sharding rule table, gather-before-use, exponent caches as module state.

A sharded layer keeps its parameters as float32 shards (split over the ``fsdp`` mesh axis by
:data:`RULES`, or by a parameter's ``fsdp_axis`` metadata). Decorating its ``__call__`` with
:func:`gathered` makes every call, inside ``jax.shard_map``, cast each sharded parameter to the
compute dtype and all-gather it just before use, through CIERA's exponent-reuse gather (or the
plain / int8 baselines, chosen with :func:`gather_mode`). The exponent cache of each gathered
parameter lives on the module as an :class:`ExponentCacheVar`, like batch-norm statistics:
derived, replicated state carried through the train step, never checkpointed.

Outside ``shard_map`` (axis not bound) a decorated module runs on whatever it holds, cast to the
compute dtype: the unsharded reference path.

    class MLP(nnx.Module):
        def __init__(self, d, f, rngs):
            self.w_in = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d, f)), fsdp_axis=0)
            self.w_out = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (f, d)), fsdp_axis=1)

        @ciera_jax.gathered(axis_name="fsdp")
        def __call__(self, x):
            return jax.nn.gelu(x @ self.w_in[...]) @ self.w_out[...]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

AXIS = "fsdp"

# The whole FSDP policy of models/, one row per weight family: which axis is split over `fsdp`.
# Every matrix is split along its d_model (D) axis: D is present in every weight, the same for
# all of them, and divisible by the usual mesh sizes in every config (expert counts such as 60
# are not). Vectors (norms, biases) are small and stay replicated.
RULES: tuple[tuple[str, int | None], ...] = (
    (r"embed_VxD", 1),
    (r"head_DxV", 0),
    (r"w[qkv]_Dx[DK]", 0),
    (r"wo_DxD", 1),
    (r"(shared_)?router_Dx[E1]", 0),
    (r"w_(gate|up)_ExDxF", 1),
    (r"w_down_ExFxD", 2),
    (r"(shared|dense)_(gate|up)_Dx[SF]", 0),
    (r"(shared|dense)_down_[SF]xD", 1),
    (r".*", None),  # norms, biases, anything else: replicated
)

GATHER_MODES = ("ciera", "plain", "int8")


def rule_axis(name: str, rules=RULES) -> int | None:
    """The axis of weight ``name`` split over ``fsdp`` (None: replicated), by the first matching rule."""
    for pattern, axis in rules:
        if re.fullmatch(pattern, name):
            return axis
    return None


def param_axis(name: str, var: nnx.Variable, rules=RULES) -> int | None:
    """A parameter's ``fsdp_axis`` metadata wins over the rule table."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    if "fsdp_axis" in meta:
        return meta["fsdp_axis"]
    return rule_axis(name, rules)


def spec_for(axis: int | None, ndim: int, axis_name: str = AXIS) -> P:
    if axis is None:
        return P()
    return P(*([None] * axis + [axis_name] + [None] * (ndim - axis - 1)))


def check_divisible(name: str, shape: tuple[int, ...], axis: int | None, n: int) -> None:
    if axis is not None and shape[axis] % n:
        raise ValueError(
            f"mesh size fsdp={n} does not divide dimension {axis} (size {shape[axis]}) of "
            f"weight {name} {tuple(shape)}; choose a device count that divides it")


class ExponentCacheVar(nnx.Variable):
    """Exponent cache of one gathered parameter (uint8, full shape, replicated over fsdp).

    Derived state: it is carried through the train step like optimizer state but never
    checkpointed; a fresh (unprimed) cache re-primes on its first gather, bitwise exactly.
    """


def _cache_attr(name: str) -> str:
    return f"{name}_exp_cache"


# ----------------------------------------------------------------------------- gather context

@dataclasses.dataclass
class GatherContext:
    mode: str = "ciera"
    stats: dict[str, dict[str, jax.Array]] = dataclasses.field(default_factory=dict)


_CTX: contextvars.ContextVar[GatherContext | None] = contextvars.ContextVar("ciera_gather", default=None)


@contextlib.contextmanager
def gather_mode(mode: str = "ciera"):
    """Select the gather used by decorated modules and collect per-tensor stats.

    ``ciera``: exponent-reuse gather (lossless, compressed); ``plain``: all-gather of the bits
    (lossless baseline); ``int8``: blockwise absmax int8 gather (lossy baseline, ZeRO++ qwZ).
    Yields a :class:`GatherContext` whose ``stats`` maps parameter paths to stats dicts.
    """
    if mode not in GATHER_MODES:
        raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
    ctx = GatherContext(mode)
    token = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(token)


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


def _reduce_stats(st: dict, axis_name: str) -> dict:
    """Per-rank gather stats -> rank-invariant scalars (change counts summed over ranks)."""
    out = {}
    for k, v in st.items():
        v = jnp.asarray(v)
        if v.dtype == jnp.bool_:
            v = v.astype(jnp.int32)
        out[k] = invariant(v, axis_name, lax.psum if k == "changed" else lax.pmax)
    return out


def gather_params(xs: dict, caches: dict, axes: dict, axis_name: str, mode: str):
    """Gather local shards ``xs`` (name -> array in compute dtype) along ``axes[name]``.

    ``ciera`` gathers them together (one agreement collective per call); ``plain`` and
    ``int8`` one by one. Returns ``(fulls, new_caches, stats)`` dicts keyed by name; stats are
    rank-invariant scalars in bytes one rank sends (``sent_bytes``, ``plain_bytes``), exponents
    changed over the whole tensor (``changed``) and its size (``elements``), ``tier``,
    ``fallback``. Caches are returned unchanged by the baselines.
    """
    import ciera_jax
    from ciera_jax import quantized

    n = lax.axis_size(axis_name)
    if mode == "ciera":
        missing = [k for k in xs if caches.get(k) is None]
        if missing:
            raise ValueError(f"gather 'ciera' needs exponent caches for {missing}: call "
                             "ciera_jax.fsdp.attach_caches(model) after building the model")
        fulls, new_caches, st = ciera_jax.all_gather_tree(
            xs, {k: caches[k] for k in xs}, axis_name, axis={k: axes[k] for k in xs})
        stats = {k: _reduce_stats(v, axis_name) for k, v in st.items()}
    elif mode in ("plain", "int8"):
        fulls, new_caches, stats = {}, dict(caches), {}
        for k, x in xs.items():
            plain = jnp.int32(x.size * x.dtype.itemsize)
            if mode == "plain":
                fulls[k] = ciera_jax.plain_all_gather(x, axis_name, axis=axes[k])
                sent = plain
            else:
                fulls[k] = quantized.int8_all_gather(x, axis_name, axis=axes[k]).astype(x.dtype)
                sent = jnp.int32(quantized.wire_bytes(x.size))
            stats[k] = dict(sent_bytes=sent, plain_bytes=plain, changed=jnp.int32(0),
                            tier=jnp.int32(-1), fallback=jnp.int32(0))
    else:
        raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
    for k, x in xs.items():
        stats[k] = {s: lax.stop_gradient(v) for s, v in stats[k].items()
                    if s in ("sent_bytes", "plain_bytes", "changed", "tier", "fallback")}
        stats[k]["elements"] = jnp.int32(x.size * n)
    return fulls, new_caches, stats


def _sharded_params(module: nnx.Module, rules) -> list[tuple[str, nnx.Param, int]]:
    out = []
    for name, var in vars(module).items():
        if isinstance(var, nnx.Param):
            axis = param_axis(name, var, rules)
            if axis is not None:
                out.append((name, var, axis))
    return out


def gathered(axis_name: str = AXIS, *, dtype=jnp.bfloat16, rules=RULES) -> Callable:
    """Decorate a sharded NNX module's ``__call__``: gather its sharded params before use.

    Inside ``jax.shard_map`` over ``axis_name``, each direct ``nnx.Param`` attribute with a
    split axis (``fsdp_axis`` metadata, else the rule table) is cast to ``dtype`` and gathered
    with the gather selected by :func:`gather_mode` (default ``ciera``); the module's body sees
    the full weights, and its exponent caches (:class:`ExponentCacheVar`, created by
    :func:`attach_caches`) are updated in place. Gradients flow back to the shards through the
    gather's backward, a ``psum_scatter``. Outside ``shard_map`` the params are only cast.
    """

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            params = _sharded_params(self, rules)
            ctx = _CTX.get() or GatherContext()
            saved = [(var, var.get_value()) for _, var, _ in params]
            try:
                xs = {name: var.get_value().astype(dtype) if dtype is not None else var.get_value()
                      for name, var, _ in params}
                if params and _axis_bound(axis_name):
                    cvars = {name: getattr(self, _cache_attr(name), None) for name, _, _ in params}
                    caches = {k: (v.get_value() if isinstance(v, ExponentCacheVar) else None)
                              for k, v in cvars.items()}
                    axes = {name: axis for name, _, axis in params}
                    xs, new_caches, stats = gather_params(xs, caches, axes, axis_name, ctx.mode)
                    path = getattr(self, "_ciera_path", type(self).__name__)
                    for name, _, _ in params:
                        if ctx.mode == "ciera":
                            cvars[name].set_value(new_caches[name])
                        ctx.stats[f"{path}/{name}" if path else name] = stats[name]
                for name, var, _ in params:
                    var.set_value(xs[name])
                return fn(self, *args, **kwargs)
            finally:
                for var, value in saved:
                    var.set_value(value)

        wrapper._ciera_gathered = dict(axis_name=axis_name, dtype=dtype, rules=rules)
        return wrapper

    return deco


def _is_gathered(module) -> dict | None:
    return getattr(type(module).__call__, "_ciera_gathered", None)


def attach_caches(model: nnx.Module) -> nnx.Module:
    """Give every decorated module an unprimed exponent cache per sharded param; name paths.

    Call once on the model built with full (global) parameter shapes, before splitting it.
    Returns the model (modified in place).
    """
    import ciera_jax

    for path, module in nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules():
        info = _is_gathered(module)
        if info is None:
            continue
        object.__setattr__(module, "_ciera_path", "/".join(str(p) for p in path))
        for name, var, axis in _sharded_params(module, info["rules"]):
            shape = var.get_value().shape
            dt = info["dtype"] or var.get_value().dtype
            setattr(module, _cache_attr(name), ExponentCacheVar(ciera_jax.init_cache(shape, dt)))
    return model


def reset_caches(caches):
    """Fresh unprimed caches with the same structure (after a restore: re-prime on first gather)."""
    return jax.tree.map(jnp.zeros_like, caches)


def param_specs(model: nnx.Module, axis_name: str = AXIS, n: int | None = None):
    """PartitionSpecs (pure dict mirroring ``nnx.state(model, nnx.Param)``) from rules/metadata.

    With ``n`` given, checks that the mesh size divides every split dimension.
    """
    specs: dict = {}
    for path, module in (nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()):
        info = _is_gathered(module)
        rules = info["rules"] if info else RULES
        for name, var in vars(module).items():
            if not isinstance(var, nnx.Param):
                continue
            axis = param_axis(name, var, rules) if info else None
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


def global_sq_norm(tree, specs, axis_name: str = AXIS):
    """Squared global L2 norm of a sharded pytree inside shard_map.

    ``specs`` (a prefix of ``tree``) says which leaves are split over ``axis_name``: those
    contribute the psum of their shards' squares; replicated leaves are counted once (they
    are the same on every rank).
    """
    sharded, repl = jnp.float32(0), jnp.float32(0)
    for spec, sub in _spec_pairs(specs, tree):
        sq = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(sub)),
                 jnp.float32(0))
        if _is_split(spec, axis_name):
            sharded = sharded + sq
        else:
            repl = repl + sq
    return invariant(sharded, axis_name, lax.psum) + invariant(repl, axis_name)


def clip_by_global_norm(grads, specs, max_norm: float, axis_name: str = AXIS):
    """Scale ``grads`` so their global norm is at most ``max_norm``; returns (grads, norm)."""
    norm = jnp.sqrt(global_sq_norm(grads, specs, axis_name))
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


__all__ = [
    "AXIS", "RULES", "GATHER_MODES", "ExponentCacheVar", "GatherContext", "gather_mode",
    "gathered", "attach_caches", "reset_caches", "param_specs", "state_specs", "put", "merge", "rule_axis", "param_axis",
    "spec_for", "global_sq_norm", "clip_by_global_norm", "gather_params", "invariant",
]

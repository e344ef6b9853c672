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


PREGATHERED = "pregathered"


@contextlib.contextmanager
def pregathered():
    """Decorated modules use the values they hold (already gathered by an :class:`Engine`):
    they cast them to the compute dtype and gather nothing."""
    token = _CTX.set(GatherContext(PREGATHERED))
    try:
        yield
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
            ctx = _CTX.get() or GatherContext()
            engine = _ENGINE.get()
            if engine is not None and ctx.mode != PREGATHERED and _axis_bound(axis_name):
                return engine.call(self, fn, args, kwargs, rules=rules, dtype=dtype)
            params = _sharded_params(self, rules)
            saved = [(var, var.get_value()) for _, var, _ in params]
            try:
                xs = {name: var.get_value().astype(dtype) if dtype is not None else var.get_value()
                      for name, var, _ in params}
                if params and ctx.mode != PREGATHERED and _axis_bound(axis_name):
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

    mods = dict(_iter_modules(model))
    for path, module in mods.items():
        info = _is_gathered(module)
        if info is None and not stack_size(module):
            continue
        object.__setattr__(module, "_ciera_path", "/".join(str(p) for p in path))
        if info is None:
            continue
        n, _ = _stack_of(path, mods)
        for name, var, axis in _sharded_params(module, info["rules"]):
            shape = var.get_value().shape
            dt = info["dtype"] or var.get_value().dtype
            if n:  # one cache per layer, stacked like the parameter (primed flag per layer)
                cache = jax.vmap(lambda _: ciera_jax.init_cache(shape[1:], dt))(jnp.zeros(n))
            else:
                cache = ciera_jax.init_cache(shape, dt)
            setattr(module, _cache_attr(name), ExponentCacheVar(cache))
    return model


def reset_caches(caches):
    """Fresh unprimed caches with the same structure (after a restore: re-prime on first gather)."""
    return jax.tree.map(jnp.zeros_like, caches)


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



# ----------------------------------------------------------------------------- stacked layers

_STACK_ATTR = "_ciera_stack"


def stack(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """``n`` layers built by ``make(rngs)``, every variable stacked on a new leading axis.

    Run them with :func:`scan_layers`. Sharding rules and exponent caches of the stacked
    parameters shift by one axis (the layer axis is never split). Nesting stacks is not supported.
    """
    if n < 1:
        raise ValueError(f"a layer stack needs at least one layer, got {n}")

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)

    module = build(rngs)
    object.__setattr__(module, _STACK_ATTR, n)
    return module


def stack_size(module) -> int:
    """Layers in a module built by :func:`stack` (0: not a stack)."""
    return getattr(module, _STACK_ATTR, 0)


def _iter_modules(model):
    it = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
    return [(tuple(path), m) for path, m in it]


def _stack_of(path: tuple, mods: dict) -> tuple[int, tuple]:
    """(layers, path of the stack) for the module at ``path`` ((0, ()) outside any stack)."""
    found = [(stack_size(mods[path[:i]]), path[:i]) for i in range(len(path) + 1)
             if path[:i] in mods and stack_size(mods[path[:i]])]
    if len(found) > 1:
        raise ValueError(f"nested layer stacks at {'/'.join(map(str, path))} are not supported")
    return found[0] if found else (0, ())


def _key(path) -> str:
    """'a/b/c' from a pytree path (DictKeys and the like; Variable's ``.value`` is dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            continue
        parts.append(str(getattr(k, "key", getattr(k, "idx", k))))
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class GatheredTensor:
    """One sharded parameter that is gathered before use.

    ``key``: module path + parameter name (``layers/mlp/w_gate_ExDxF``), the key of its cache,
    encoded payload, plan decision and stats; ``axis``: the split axis of ONE layer's tensor;
    ``shape``: one layer's full (gathered) shape; ``stack``: layers stacked on a leading axis
    (0: a single tensor) and ``stack_path`` the stack's module path.
    """

    key: str
    axis: int
    shape: tuple[int, ...]
    dtype: object
    stack: int = 0
    stack_path: str = ""

    def layer_key(self, layer: int) -> str:
        """``layers/3/mlp/w_gate_ExDxF`` for layer 3 of a stacked tensor (the key otherwise)."""
        if not self.stack:
            return self.key
        return f"{self.stack_path}/{layer}{self.key[len(self.stack_path):]}"


def gathered_tensors(model: nnx.Module) -> dict[str, GatheredTensor]:
    """Every parameter a decorated module gathers, keyed by path (model order)."""
    out = {}
    mods = dict(_iter_modules(model))
    for path, module in mods.items():
        info = _is_gathered(module)
        if info is None:
            continue
        n, spath = _stack_of(path, mods)
        for name, var, axis in _sharded_params(module, info["rules"]):
            shape = tuple(var.get_value().shape)[1 if n else 0:]
            key = "/".join(map(str, (*path, name)))
            out[key] = GatheredTensor(key, axis, shape, info["dtype"] or var.get_value().dtype,
                                      n, "/".join(map(str, spath)))
    return out


def cache_dict(caches: nnx.State) -> dict:
    """``{tensor key: ExponentCache}`` from a state of :class:`ExponentCacheVar`."""
    out = {}
    pairs = jax.tree_util.tree_flatten_with_path(
        caches, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    suffix = _cache_attr("")
    for path, var in pairs:
        k = _key(path)
        out[k[:-len(suffix)]] = var.get_value()
    return out


def with_caches(caches: nnx.State, new: dict) -> nnx.State:
    """``caches`` with the entries of ``new`` (``{tensor key: ExponentCache}``) replaced."""
    suffix = _cache_attr("")

    def one(path, var):
        k = _key(path)[:-len(suffix)]
        return var.replace(value=new[k]) if k in new else var

    return jax.tree_util.tree_map_with_path(one, caches,
                                            is_leaf=lambda v: isinstance(v, nnx.Variable))


def param_dict(params: nnx.State) -> dict:
    """``{path key: array}`` of a parameter state."""
    return {_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


# ----------------------------------------------------------------------------- the step engine

_ENGINE: contextvars.ContextVar["Engine | None"] = contextvars.ContextVar("ciera_engine",
                                                                         default=None)


def encode_tensors(tensors: dict, params: dict, caches: dict, compress: dict,
                   axis_name: str = AXIS, impl: str = "auto") -> dict:
    """Phase 1 for every compressed tensor (inside ``shard_map``): ``{key: Encoded}``.

    ``params``: ``{key: local shard}`` (any float dtype; cast to the tensor's compute dtype);
    ``caches``: ``{key: ExponentCache}``; stacked tensors are encoded layer by layer (vmap),
    so their Encoded leaves carry the layer axis first.
    """
    import ciera_jax

    out = {}
    for key, t in tensors.items():
        if not compress.get(key, False):
            continue
        shard = params[key].astype(t.dtype)

        def enc(s, c, t=t):
            return ciera_jax.encode(s, c, axis_name, axis=t.axis, impl=impl, name=t.key)

        # Layer by layer with lax.map (one traced body; vmap would turn the tier switch of
        # encode into a select of all branches).
        out[key] = (lax.map(lambda sc: enc(*sc), (shard, caches[key])) if t.stack
                    else enc(shard, caches[key]))
    return out


def agree_tensors(tensors: dict, encoded: dict, axis_name: str = AXIS) -> dict:
    """Phase 2 for the whole step: ONE ``ciera_jax.agree`` (one ``pmax``) over the demand of
    every layer of every encoded tensor. Returns ``{key: agreed}`` (per layer for stacks)."""
    import ciera_jax

    flat, where = [], []
    for key, e in encoded.items():
        n = tensors[key].stack
        if n:
            for layer in range(n):
                flat.append(jax.tree.map(lambda a, layer=layer: a[layer], e))
                where.append(key)
        else:
            flat.append(e)
            where.append(key)
    agreed = ciera_jax.agree(flat, axis_name) if flat else []
    out: dict = {}
    for key, a in zip(where, agreed):
        out.setdefault(key, []).append(a)
    return {k: (jnp.stack(v) if tensors[k].stack else v[0]) for k, v in out.items()}


def _float0_like(tree):
    def one(a):
        a = jnp.asarray(a) if not hasattr(a, "dtype") else a
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)
    return jax.tree.map(one, tree)


class Engine:
    """The gathers of one FSDP train step (inside ``shard_map``), with prefetch and remat.

    Built from the step's inputs: ``mode`` (ciera / plain / int8), the gathered tensors, their
    caches, the ``Encoded`` payloads prepared at the end of the previous step (ciera; tensors
    without one gather plainly) and the step's agreement. While :meth:`active`, every decorated
    module gathers through it, and :func:`scan_layers` runs a layer stack with the gather of
    layer l+1 issued next to (not after) the compute of layer l.

    Backward: each gathered compute is a ``custom_vjp`` whose residuals are the shards and the
    gather inputs, not the gathered weights; its backward re-gathers (the same exact, pure
    function of the same inputs) and reduce-scatters the weight cotangents (``psum_scatter``).

    After the forward, :attr:`new_caches` and :attr:`stats` hold the gathers' outputs
    (stats: rank-invariant scalars, per layer for stacks).
    """

    def __init__(self, mode: str, tensors: dict, *, caches: dict | None = None,
                 encoded: dict | None = None, agreed: dict | None = None,
                 axis_name: str = AXIS, impl: str = "auto"):
        if mode not in GATHER_MODES:
            raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
        self.mode, self.tensors, self.axis_name, self.impl = mode, tensors, axis_name, impl
        self.caches = dict(caches or {})
        self.encoded = dict(encoded or {}) if mode == "ciera" else {}
        self.agreed = dict(agreed or {})
        missing = [k for k in self.encoded if k not in self.agreed]
        if missing:
            raise ValueError(f"no agreement for {missing}: run agree_tensors once per step")
        self.new_caches: dict = {}
        self.stats: dict = {}

    @contextlib.contextmanager
    def active(self):
        token = _ENGINE.set(self)
        try:
            yield self
        finally:
            _ENGINE.reset(token)

    # -- one tensor ---------------------------------------------------------------------------

    def _gin(self, key: str):
        """Gather inputs beside the shard: (Encoded, cache, agreed) or None (plain)."""
        if key not in self.encoded:
            return None
        return (self.encoded[key], self.caches[key], self.agreed[key])

    def _gather(self, t: GatheredTensor, shard, gin):
        """Gather one layer's shard (no gradient): (full, new cache or None, stats)."""
        import ciera_jax
        from ciera_jax import quantized

        ax = self.axis_name
        shard = lax.stop_gradient(shard)
        plain = jnp.int32(shard.size * shard.dtype.itemsize)
        new_cache = None
        if gin is not None:
            e, cache, agreed = gin
            full, new_cache, st = ciera_jax.exchange(shard, e, cache, agreed, ax, impl=self.impl)
            stats = dict(sent_bytes=st["sent_bytes"], plain_bytes=st["plain_bytes"],
                         changed=invariant(st["changed"], ax, lax.psum), tier=st["tier"],
                         fallback=st["fallback"].astype(jnp.int32))
        else:
            if self.mode == "int8":
                full = quantized.int8_all_gather(shard, ax, axis=t.axis).astype(shard.dtype)
                sent = jnp.int32(quantized.wire_bytes(shard.size))
            else:
                full = ciera_jax.plain_all_gather(shard, ax, axis=t.axis)
                sent = plain
            stats = dict(sent_bytes=sent, plain_bytes=plain, changed=jnp.int32(0),
                         tier=jnp.int32(-1), fallback=jnp.int32(0))
        stats["elements"] = jnp.int32(full.size)
        return full, new_cache, stats

    # -- gathered compute with re-gather in backward --------------------------------------------

    def _apply(self, compute, tensors: dict, shards: dict, others, gins: dict, fulls: dict, xargs):
        """``compute(fulls, others, xargs)``, differentiable to shards/others/xargs; ``fulls``
        are the prefetched gathers of ``shards`` (no gradient of their own)."""
        ax = self.axis_name

        @jax.custom_vjp
        def f(shards, others, gins, fulls, xargs):
            return compute(fulls, others, xargs)

        def fwd(shards, others, gins, fulls, xargs):
            return compute(fulls, others, xargs), (shards, others, gins, xargs)

        def bwd(res, ct):
            shards, others, gins, xargs = res
            re = {k: self._gather(tensors[k], shards[k], gins[k])[0] for k in shards}
            _, vjp = jax.vjp(compute, re, others, xargs)
            ct_fulls, ct_others, ct_xargs = vjp(ct)
            ct_shards = {k: lax.psum_scatter(ct_fulls[k], ax, scatter_dimension=tensors[k].axis,
                                             tiled=True).astype(shards[k].dtype)
                         for k in shards}
            return (ct_shards, ct_others, _float0_like(gins), _float0_like(ct_fulls), ct_xargs)

        f.defvjp(fwd, bwd)
        return f(shards, others, gins, fulls, xargs)

    @staticmethod
    def _split(module):
        graphdef, params, caches, rest = nnx.split(module, nnx.Param, ExponentCacheVar, ...)
        keys = [_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        leaves, treedef = jax.tree.flatten(params)
        dummy = jax.tree.map(lambda a: np.zeros((), a.dtype), caches)  # unused when pregathered
        return graphdef, keys, leaves, treedef, dummy, rest

    @staticmethod
    def _compute(graphdef, keys, treedef, dummy, call):
        """compute(fulls, others, (rest, args)) -> call(module with those values, *args)."""

        def compute(fulls, others, xargs):
            rest, args = xargs
            leaves = [fulls[k] if k in fulls else others[k] for k in keys]
            module = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), dummy, rest)
            with pregathered():
                return call(module, *args)

        return compute

    def call(self, module, fn, args, kwargs, *, rules=RULES, dtype=jnp.bfloat16):
        """A decorated module's call: gather its sharded params, run ``fn`` on the full ones."""
        if kwargs:
            args = args + tuple(kwargs.values())
            names = tuple(kwargs)
            call0 = lambda m, *a: fn(m, *a[:len(a) - len(names)],  # noqa: E731
                                     **dict(zip(names, a[len(a) - len(names):])))
        else:
            call0 = fn
        prefix = getattr(module, "_ciera_path", type(module).__name__)
        graphdef, keys, leaves, treedef, dummy, rest = self._split(module)
        split = {name for name, _, _ in _sharded_params(module, rules)}
        values = dict(zip(keys, leaves))
        tensors, shards, gins, fulls = {}, {}, {}, {}
        for k in keys:
            if k not in split:
                continue
            gkey = f"{prefix}/{k}" if prefix else k
            t = self.tensors.get(gkey)
            if t is None:
                raise ValueError(f"{gkey} is not among the engine's gathered tensors")
            tensors[k], shards[k], gins[k] = t, values[k].astype(dtype or values[k].dtype), \
                self._gin(gkey)
            fulls[k], new_cache, self.stats[gkey] = self._gather(t, shards[k], gins[k])
            if new_cache is not None:
                self.new_caches[gkey] = new_cache
        others = {k: v for k, v in values.items() if k not in split}
        compute = self._compute(graphdef, keys, treedef, dummy, call0)
        return self._apply(compute, tensors, shards, others, gins, fulls, (rest, tuple(args)))

    def scan(self, stack_module, x, *args):
        """Run a layer stack: layer l computes on weights gathered during layer l-1."""
        n = stack_size(stack_module)
        graphdef, keys, leaves, treedef, dummy, rest = self._split(stack_module)
        values = dict(zip(keys, leaves))
        spath = getattr(stack_module, "_ciera_path", None)
        if spath is None:
            raise ValueError("layer stack without a path: call fsdp.attach_caches(model) once "
                             "after building the model")
        tensors = {k: self.tensors[f"{spath}/{k}"] for k in keys
                   if f"{spath}/{k}" in self.tensors}
        shards = {k: values[k].astype(t.dtype) for k, t in tensors.items()}
        others = {k: v for k, v in values.items() if k not in tensors}
        gins = {k: self._gin(t.key) for k, t in tensors.items()}
        at = lambda tree, i: jax.tree.map(  # noqa: E731
            lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
        frozen = lax.stop_gradient(shards)

        def fetch(i):
            out = {k: self._gather(t, at(frozen[k], i), at(gins[k], i))
                   for k, t in tensors.items()}
            return ({k: o[0] for k, o in out.items()},
                    {k: o[1] for k, o in out.items() if o[1] is not None},
                    {k: o[2] for k, o in out.items()})

        compute = self._compute(graphdef, keys, treedef, dummy, lambda m, *a: m(*a))

        def layer(i, fulls, x, sh, ot, rs):
            return self._apply(compute, tensors, sh, ot, at(gins, i), fulls, (rs, (x, *args)))

        fulls, c0, s0 = fetch(0)
        first = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
        if n == 1:
            x, y = layer(0, fulls, x, at(shards, 0), at(others, 0), at(rest, 0))
            ys, cs, ss = first(y), first(c0), first(s0)
        else:
            head = lambda tree: jax.tree.map(lambda a: a[:-1], tree)  # noqa: E731

            def body(carry, xs):
                x, fulls = carry
                i, sh, ot, rs = xs
                nxt, c, s = fetch(i + 1)  # prefetch: independent of this layer's compute
                x, y = layer(i, fulls, x, sh, ot, rs)
                return (x, nxt), (y, c, s)

            (x, fulls), (ys, cs, ss) = lax.scan(
                body, (x, fulls), (jnp.arange(n - 1), head(shards), head(others), head(rest)))
            x, y = layer(n - 1, fulls, x, at(shards, n - 1), at(others, n - 1), at(rest, n - 1))
            cat = lambda a, b: jnp.concatenate([a, b], axis=0)  # noqa: E731
            ys = jax.tree.map(lambda a, b: cat(a, b[None]), ys, y)
            cs = jax.tree.map(lambda a, b: cat(a[None], b), c0, cs)
            ss = jax.tree.map(lambda a, b: cat(a[None], b), s0, ss)
        for k, t in tensors.items():
            if k in cs:
                self.new_caches[t.key] = cs[k]
            self.stats[t.key] = ss[k]
        return x, ys

    def layer_stats(self) -> dict:
        """Stats per gathered tensor and layer: ``{'layers/3/mlp/w_gate_ExDxF': {...}}``."""
        out = {}
        for key, st in self.stats.items():
            t = self.tensors[key]
            if t.stack:
                for layer in range(t.stack):
                    out[t.layer_key(layer)] = {k: v[layer] for k, v in st.items()}
            else:
                out[key] = st
        return out


def scan_layers(stack_module, x, *args):
    """Apply the layers of ``stack_module`` (built by :func:`stack`) in order:
    ``x, y = layer(x, *args)``; returns ``(x, ys)`` with the ``y`` of every layer stacked.

    Inside a train step with an active :class:`Engine` the stack runs with prefetch (the gather
    of layer l+1 overlaps the compute of layer l) and re-gathers in backward; elsewhere (no mesh
    axis bound) it is a plain ``lax.scan``.
    """
    engine = _ENGINE.get()
    if engine is not None and _axis_bound(engine.axis_name):
        return engine.scan(stack_module, x, *args)
    if _axis_bound(AXIS) and (_CTX.get() or GatherContext()).mode != PREGATHERED:
        raise ValueError("a layer stack inside shard_map gathers through an fsdp.Engine: "
                         "build one for the step and run the model under engine.active()")
    graphdef, state = nnx.split(stack_module)

    def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, *args)

    return lax.scan(body, x, state)

__all__ = [
    "AXIS", "RULES", "GATHER_MODES", "ExponentCacheVar", "GatherContext", "gather_mode",
    "gathered", "attach_caches", "reset_caches", "param_specs", "state_specs", "put", "merge", "rule_axis", "param_axis",
    "spec_for", "global_sq_norm", "clip_by_global_norm", "gather_params", "invariant",
    "stack", "stack_size", "scan_layers", "GatheredTensor", "gathered_tensors", "Engine",
    "encode_tensors", "agree_tensors", "cache_dict", "with_caches", "param_dict", "pregathered",
]

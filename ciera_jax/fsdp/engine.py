"""The gathers of a whole train step: which tensors are gathered, their two-phase CIERA
encode/agree, and the :class:`Engine` that prefetches layer l+1 during layer l and re-gathers
in backward instead of keeping gathered weights as residuals."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from ciera_jax.fsdp._util import _is_gathered, _iter_modules, _key, invariant
from ciera_jax.fsdp.caches import ExponentCacheVar
from ciera_jax.fsdp.context import _ENGINE, GATHER_MODES, pregathered
from ciera_jax.fsdp.layer_stack import _stack_of, stack_size
from ciera_jax.fsdp.rules import AXIS, RULES, _sharded_params


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


def param_dict(params: nnx.State) -> dict:
    """``{path key: array}`` of a parameter state."""
    return {_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


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

"""The one gather path of decorated modules: an :class:`Engine` gathers a call's sharded
parameters (CIERA, plain or int8), in the user's ``shard_map`` or in a ``shard_map`` region it
opens itself under ``jit``, and leaves new caches and stats in module state.

A *default* engine (built per call, or by :func:`gather_mode`) encodes and agrees per call
(one agreement collective per decorated call) and differentiates through the gather (its
backward is a ``psum_scatter``). A *prepared* engine (the trainer's: the step's inventory,
the ``Encoded`` made at the end of the previous step and the step's one agreement) gathers
layer l+1 while layer l computes. Its backward keeps no gathered weights as residuals: a tensor
with a word cache reads this step's full words from the cache the forward left (no second gather,
no second copy); every other tensor is gathered again (the same exact, pure function). Either
way the layer's compute sees its weights through one ``optimization_barrier``, forward and
backward, in every mode, so XLA compiles the same matmuls whichever path delivered them and the
parameters stay bitwise those of a plain gather.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import ciera_jax.cache as cache_lib
import ciera_jax.codec as codec
import ciera_jax.collective as collective
import ciera_jax.quantized as quantized
from ciera_jax.fsdp.axes import (AXIS, MANUAL, REGION, UNSHARDED, axis_bound, axis_size,
                                 invariant, placement, varying_axes)
from ciera_jax.fsdp.caches import PLAIN_ATTR, GatherCacheVar, cache_attr
from ciera_jax.fsdp.context import activate, check_mode
from ciera_jax.fsdp.discovery import (GatherSpec, ShardedParam, iter_params, module_name,
                                      module_path, path_key, sharded_params)
from ciera_jax.fsdp.inventory import GatheredTensor
from ciera_jax.fsdp.rules import check_divisible, kept_axes, names_of, without_axis
from ciera_jax.fsdp.stacking import stack_size
from ciera_jax.fsdp.stats import record


def _float0_like(tree):
    def one(a):
        a = jnp.asarray(a) if not hasattr(a, "dtype") else a
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)
    return jax.tree.map(one, tree)


# How a prepared engine's backward gets a word-mode tensor's full weights: "cache" (default: read
# the full words the forward's gather left in the word cache; no backward gather) or "regather"
# (the same exact gather again). Both give parameters bitwise equal to a plain gather's.
WORD_BACKWARDS = ("cache", "regather")
DEFAULT_WORD_BACKWARD = "cache"


class Engine:
    """The gathers of decorated modules, for one call (default) or one train step (prepared).

    ``Engine(mode)``: a default engine; every decorated call under :meth:`active` encodes,
    agrees once and gathers its own parameters, and leaves caches and stats on its module.
    ``Engine(mode, tensors, caches=, encoded=, agreed=)``: a prepared engine for a train step
    inside ``shard_map`` (see :mod:`ciera_jax.fsdp.phases`); layer stacks run with prefetch
    (:meth:`scan`). Either way new caches and stats are module state; a prepared engine also
    collects them in :attr:`new_caches` and :attr:`stats` (``{tensor key: ...}``, values of
    the trace that ran the forward: read them there, or the module state under transforms).
    """

    def __init__(self, mode: str = "ciera", tensors: dict | None = None, *,
                 caches: dict | None = None, encoded: dict | None = None,
                 agreed: dict | None = None, axis_name: str = AXIS, impl: str = "auto",
                 word_backward: str = DEFAULT_WORD_BACKWARD):
        self.mode, self.tensors, self.axis_name, self.impl = check_mode(mode), tensors, \
            axis_name, impl
        if word_backward not in WORD_BACKWARDS:
            raise ValueError(f"word_backward must be one of {WORD_BACKWARDS}, got "
                             f"{word_backward!r}")
        self.word_backward = word_backward
        self.caches = dict(caches or {})
        self.encoded = dict(encoded or {}) if mode == "ciera" else {}
        self.agreed = dict(agreed or {})
        missing = [k for k in self.encoded if k not in self.agreed]
        if missing:
            raise ValueError(f"no agreement for {missing}: run agree_tensors once per step")
        self.new_caches: dict = {}
        self._stats: dict = {}
        self._holding = False

    @property
    def prepared(self) -> bool:
        return self.tensors is not None

    @property
    def stats(self) -> dict:
        """A prepared engine's ``{tensor key: stats}`` of the trace that ran the forward.

        A default engine (:func:`gather_mode`) keeps none here: its stats are module state,
        read them with ``fsdp.gather_stats(model)`` (return them from the jitted step)."""
        if not self.prepared:
            raise RuntimeError(
                "Engine.stats: a default engine (fsdp.gather_mode) leaves the stats of every "
                "gather in module state; read them with fsdp.gather_stats(model), e.g. "
                "returned from your jitted step (they are zeros until the first step)")
        return self._stats

    def jit_key(self) -> tuple:
        """What a step traced under this engine depends on (part of jit's cache key)."""
        return ("prepared" if self.prepared else "default", self.mode, self.axis_name,
                self.impl, self.word_backward)

    def active(self):
        """Decorated modules called inside gather through this engine."""
        return activate(self)

    @contextlib.contextmanager
    def holding(self):
        """Decorated modules called inside already hold gathered values: they only cast."""
        old, self._holding = self._holding, True
        try:
            yield
        finally:
            self._holding = old

    # -- one tensor ---------------------------------------------------------------------------

    def gather_one(self, t: GatheredTensor, shard, gin, region: bool = False):
        """Gather one layer's shard: (full, new cache or None, stats). ``gin``: (Encoded,
        cache, agreed) for a compressed gather, None for the mode's plain / int8 gather.
        Stats are summed (sizes, counts) or maxed (tier, fallback) over the other mesh axes
        the tensor stays split on; ``region``: in the engine's own ``shard_map`` (no varying
        types), so per-rank counts are summed over the gather axis unconditionally."""
        ax = self.axis_name
        plain = jnp.int32(shard.size * shard.dtype.itemsize)
        new_cache = None
        if gin is not None:
            e, cache, agreed = gin
            full, new_cache, st = collective.exchange(shard, e, cache, agreed, ax, impl=self.impl)
            # verify_failed stays per rank in a train step (it rides on the step's norm psum);
            # a default engine reduces it like the other stats.
            failed = jnp.asarray(st["verify_failed"]).astype(jnp.int32)
            changed = jnp.asarray(st["changed"]).astype(jnp.int32)
            if not region:  # varying types tell what is still per rank
                changed = invariant(changed, ax, lax.psum)
                failed = failed if self.prepared else invariant(failed, ax, lax.psum)
            stats = dict(sent_bytes=st["sent_bytes"], plain_bytes=st["plain_bytes"],
                         changed=changed, tier=st["tier"],
                         fallback=st["fallback"].astype(jnp.int32), verify_failed=failed)
        else:
            if self.mode == "int8":
                full = quantized.int8_all_gather(shard, ax, axis=t.axis).astype(shard.dtype)
                sent = jnp.int32(quantized.wire_bytes(shard.size))
            else:
                full = collective.plain_all_gather(shard, ax, axis=t.axis)
                sent = plain
            stats = dict(sent_bytes=sent, plain_bytes=plain, changed=jnp.int32(0),
                         tier=jnp.int32(-1), fallback=jnp.int32(0), verify_failed=jnp.int32(0))
        stats["elements"] = jnp.int32(full.size)
        stats = {k: jnp.asarray(v).astype(jnp.int32) for k, v in stats.items()}
        others = tuple(a for a in kept_axes(t.spec, ax) if axis_bound(a))
        # One rank of the gather axis: its blocks on the other axes together. Sizes scale
        # statically; tier and fallback are agreed over every axis already; the per-rank
        # counts take ONE psum, after the gather (the barrier), so no device can enter it
        # while another still waits in the gather (collectives in different orders on
        # different devices deadlock).
        scale = int(np.prod([axis_size(a) for a in others])) if others else 1
        for k in ("sent_bytes", "plain_bytes", "elements"):
            stats[k] = stats[k] * scale
        sum_axes = ((ax,) if region and gin is not None else ()) + (others if gin is not None
                                                                    else ())
        if sum_axes:
            counts = jnp.stack([stats["changed"], stats["verify_failed"]])
            full, counts = lax.optimization_barrier((full, counts))
            counts = lax.psum(counts, sum_axes)
            stats["changed"] = counts[0]
            if not self.prepared:
                stats["verify_failed"] = counts[1]
        return full, new_cache, {k: lax.stop_gradient(v) for k, v in stats.items()}

    def _gather_inputs(self, key: str):
        """A prepared engine's gather inputs beside the shard: (Encoded, cache, agreed) or None."""
        if key not in self.encoded:
            return None
        return (self.encoded[key], self.caches[key], self.agreed[key])

    def gather_call(self, tensors: dict, shards: dict, caches: dict, region: bool = False):
        """Gather one call's shards (inside ``shard_map``): ``(fulls, new_caches, stats)``.

        A default ``ciera`` engine encodes every tensor it has a cache for and agrees on all
        of them with ONE collective; a prepared one uses the step's Encoded and agreement.
        """
        if self.prepared:
            inputs = {k: self._gather_inputs(t.key) for k, t in tensors.items()}
        else:
            enc = {k: collective.encode(lax.stop_gradient(shards[k]), caches[k], self.axis_name,
                                        axis=t.axis, impl=self.impl, name=t.key)
                   for k, t in tensors.items() if caches.get(k) is not None}
            agreed = collective.agree(enc, self.axis_name) if enc else {}
            inputs = {k: (enc[k], caches[k], agreed[k]) if k in enc else None for k in tensors}
        fulls, new_caches, stats = {}, {}, {}
        for k, t in tensors.items():
            fulls[k], c, stats[k] = self.gather_one(t, shards[k], inputs[k], region)
            if c is not None:
                new_caches[k] = c
        return fulls, new_caches, stats

    # -- a decorated call ---------------------------------------------------------------------

    def call(self, module, fn, args, kwargs, spec: GatherSpec):
        """A decorated module's call: gather its sharded params, run ``fn`` on the full ones."""
        where, prefix = module_name(module), module_path(module)
        if self._holding:
            return _run_cast(module, fn, args, kwargs, spec)
        place = placement(spec.axis_name, where)
        params = sharded_params(module, spec)
        if place == UNSHARDED:
            return _run_cast(module, fn, args, kwargs, spec)
        if spec.axis_name != self.axis_name:
            raise ValueError(f"{where}: decorated for axis {spec.axis_name!r} but the active "
                             f"engine gathers over {self.axis_name!r}; build the engine with "
                             f"axis_name={spec.axis_name!r}")
        if not params:
            raise ValueError(
                f"{where}: decorated with @gathered(axis_name={spec.axis_name!r}) but none of "
                f"its parameters is split over {spec.axis_name!r}, so nothing would be "
                f"gathered; annotate them (nnx.with_partitioning(init, ({spec.axis_name!r}, "
                f"None)), fsdp_axis= metadata or rules=) or remove the decorator")
        if stack_size(module):
            raise ValueError(f"{where}: a layer stack is run with fsdp.scan_layers, not called")
        n = axis_size(spec.axis_name)
        tensors, shards, caches = {}, {}, {}
        for p in params:
            gkey = f"{prefix}/{p.key}" if prefix else p.key
            value = p.var.get_value()
            shape = list(value.shape)
            if place == REGION:
                check_divisible(f"{where}/{p.key}", tuple(shape), p.axis, n, spec.axis_name)
            else:
                shape[p.axis] *= n
            dtype = spec.dtype or value.dtype
            if self.prepared:
                t = self.tensors.get(gkey)
                if t is None:
                    raise ValueError(f"{gkey} is not among the engine's gathered tensors")
            else:
                t = GatheredTensor(gkey, p.axis, tuple(shape), dtype, spec=p.spec)
            tensors[p.key] = t
            shards[p.key] = value.astype(dtype)
            if (not self.prepared and self.mode == "ciera" and codec.is_compressible(dtype)
                    and p.name not in getattr(p.owner, PLAIN_ATTR, ())):
                caches[p.key] = _cache_of(p, t, f"{where}/{p.key}")
        if place == MANUAL and self.prepared:
            return self._call_prepared(module, fn, args, kwargs, tensors, params)
        if self.prepared:
            raise ValueError(f"{where}: a prepared (train step) Engine runs inside shard_map; "
                             "under jit without shard_map use the default engine")
        if place == MANUAL:
            fulls, new_caches, stats = self.gather_call(tensors, shards, caches)
        else:
            fulls, new_caches, stats = self._region(tensors, shards, caches)
        _leave_state(module, params, new_caches, stats)
        return _run_with(module, [(p.var, fulls[p.key]) for p in params], fn, args, kwargs, self)

    def _region(self, tensors, shards, caches):
        """:meth:`gather_call` in a ``shard_map`` region of its own (under ``jit`` with the mesh
        set). Each shard comes in with its parameter's own spec (the gather axis and any other
        mesh axes, e.g. ``tp``); its full weight and cache leave gathered over the gather axis
        only, still split over the others; stats leave replicated. The rest of the model stays
        under sharding propagation (Auto axes) or sharding in types (Explicit axes)."""
        ax = self.axis_name
        shard_specs = {k: P(*t.spec) for k, t in tensors.items()}
        full_specs = {k: P(*without_axis(t.spec, ax)) for k, t in tensors.items()}
        cache_specs = {k: _cache_specs(caches[k], tensors[k], ax) for k in caches}
        shards = {k: _to_spec(v, shard_specs[k]) for k, v in shards.items()}
        caches = {k: jax.tree.map(_to_spec, caches[k], cache_specs[k]) for k in caches}
        return jax.shard_map(lambda s, c: self.gather_call(tensors, s, c, region=True),
                             in_specs=(shard_specs, cache_specs),
                             out_specs=(full_specs, cache_specs, P()),
                             check_vma=False)(shards, caches)

    # -- prepared: gathered compute; the backward reads word caches or gathers again ----------

    def _held(self, inputs: dict) -> set:
        """Keys whose backward reads the word cache the forward's gather left (``cache``)."""
        if self.word_backward != "cache":
            return set()
        return {k for k, gin in inputs.items() if gin is not None and _is_word_cache(gin[1])}

    def _backward_fulls(self, tensors: dict, shards: dict, inputs: dict, held_caches: dict):
        """The full weights a backward computes with: held keys from their (new) word cache,
        the rest gathered again from the shard and the step's gather inputs."""
        return {k: _typed_like_gather(cache_lib.cached_full(held_caches[k]), shards[k],
                                      self.axis_name) if k in held_caches else
                self.gather_one(tensors[k], lax.stop_gradient(shards[k]), inputs[k])[0]
                for k in shards}

    def _scatter(self, tensors: dict, ct_fulls: dict, shards: dict) -> dict:
        """Weight cotangents: the transpose of the all-gather (``psum_scatter``) per tensor."""
        return {k: lax.psum_scatter(ct_fulls[k], self.axis_name,
                                    scatter_dimension=tensors[k].axis, tiled=True
                                    ).astype(shards[k].dtype) for k in shards}

    def _apply(self, compute, tensors: dict, shards: dict, others, inputs: dict, fulls: dict,
               held_caches: dict, call_args):
        """``compute(fulls, others, call_args)``, differentiable to shards, others and call_args;
        ``inputs``: each shard's gather inputs (Encoded, cache, agreed) or None; ``fulls``
        are the gathers of ``shards`` (no gradient of their own); ``held_caches``: the new
        word caches of the keys whose backward reads them (the residual is the cache itself)."""

        @jax.custom_vjp
        def f(shards, others, inputs, fulls, held_caches, call_args):
            return compute(fulls, others, call_args)

        def fwd(shards, others, inputs, fulls, held_caches, call_args):
            return (compute(fulls, others, call_args),
                    (shards, others, inputs, held_caches, call_args))

        def bwd(res, ct):
            shards, others, inputs, held_caches, call_args = res
            re = self._backward_fulls(tensors, shards, inputs, held_caches)
            _, vjp = jax.vjp(compute, re, others, call_args)
            ct_fulls, ct_others, ct_call_args = vjp(ct)
            return (self._scatter(tensors, ct_fulls, shards), ct_others, _float0_like(inputs),
                    _float0_like(ct_fulls), _float0_like(held_caches), ct_call_args)

        f.defvjp(fwd, bwd)
        return f(shards, others, inputs, fulls, held_caches, call_args)

    @staticmethod
    def _split(module):
        graphdef, params, caches, rest = nnx.split(module, nnx.Param, GatherCacheVar, ...)
        keys = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        leaves, treedef = jax.tree.flatten(params)
        dummy = jax.tree.map(lambda a: np.zeros((), a.dtype), caches)  # unused when holding
        return graphdef, keys, leaves, treedef, dummy, rest

    def _compute(self, graphdef, keys, treedef, dummy, call):
        """compute(fulls, others, (rest, args)) -> call(module with those values, *args).

        The full weights pass one ``optimization_barrier`` before the layer's compute, in the
        forward and in the backward's recomputation, whatever delivered them (a gather's
        decode, a plain all-gather, a word cache): XLA then compiles the same matmuls in every
        mode and path, which keeps the parameters bitwise those of a plain gather."""

        def compute(fulls, others, call_args):
            rest, args = call_args
            fulls = lax.optimization_barrier(fulls)
            leaves = [fulls[k] if k in fulls else others[k] for k in keys]
            module = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), dummy, rest)
            with self.active(), self.holding():
                return call(module, *args)

        return compute

    def _call_prepared(self, module, fn, args, kwargs, tensors, params):
        if kwargs:
            args = args + tuple(kwargs.values())
            names = tuple(kwargs)
            call0 = lambda m, *a: fn(m, *a[:len(a) - len(names)],  # noqa: E731
                                     **dict(zip(names, a[len(a) - len(names):])))
        else:
            call0 = fn
        graphdef, keys, leaves, treedef, dummy, rest = self._split(module)
        values = dict(zip(keys, leaves))
        shards = {k: values[k].astype(tensors[k].dtype) for k in tensors}
        inputs, fulls = {}, {}
        for k, t in tensors.items():
            inputs[k] = self._gather_inputs(t.key)
            fulls[k], new_cache, self._stats[t.key] = self.gather_one(
                t, lax.stop_gradient(shards[k]), inputs[k])
            if new_cache is not None:
                self.new_caches[t.key] = new_cache
        held = {k: self.new_caches[tensors[k].key] for k in self._held(inputs)}
        others = {k: v for k, v in values.items() if k not in tensors}
        compute = self._compute(graphdef, keys, treedef, dummy, call0)
        out = self._apply(compute, tensors, shards, others, inputs, fulls, held,
                          (rest, tuple(args)))
        _leave_state(module, params, {k: self.new_caches.get(t.key) for k, t in tensors.items()},
                     {k: self._stats[t.key] for k, t in tensors.items()})
        return out

    def scan(self, stack_module, x, *args):
        """Run a layer stack: layer l computes on weights gathered during layer l-1.

        Differentiated as one unit (:meth:`_stack_vjp`): the forward keeps each layer's input
        activation and nothing gathered; the backward runs the layers in reverse, each on
        weights read from its word cache (``word_backward="cache"``) or gathered again."""
        n = stack_size(stack_module)
        graphdef, keys, leaves, treedef, dummy, rest = self._split(stack_module)
        values = dict(zip(keys, leaves))
        spath = module_path(stack_module)
        tensors = {k: self.tensors[f"{spath}/{k}"] for k in keys
                   if f"{spath}/{k}" in self.tensors}
        shards = {k: values[k].astype(t.dtype) for k, t in tensors.items()}
        others = {k: v for k, v in values.items() if k not in tensors}
        inputs = {k: self._gather_inputs(t.key) for k, t in tensors.items()}
        compute = self._compute(graphdef, keys, treedef, dummy, lambda m, *a: m(*a))
        run = self._stack_vjp(compute, tensors, self._held(inputs), n)
        x, ys, cs, ss = run(shards, others, rest, x, tuple(args), inputs)
        for k, t in tensors.items():
            if k in cs:
                self.new_caches[t.key] = cs[k]
            self._stats[t.key] = ss[k]
        found = {"/".join(map(str, path)): (owner, name, var)
                 for path, owner, name, var in iter_params(stack_module, nested=True)}
        params = [ShardedParam(k, *found[k], axis=t.axis + 1, lead=1, spec=t.spec)
                  for k, t in tensors.items()]
        _leave_state(stack_module, params, cs, ss)
        return x, ys

    def _stack_vjp(self, compute, tensors: dict, held: set, n: int):
        """``run(shards, others, rest, x, args, inputs) -> (x, ys, new caches, stats)`` over
        the ``n`` stacked layers, with its own backward.

        Forward: a scan whose body gathers layer l+1 (independent of the activations) next to
        layer l's compute. A held tensor's word-cache stack is carried through the scan and
        updated one layer at a time in place (each gather reads its layer's old words and
        writes the new ones), so the step holds one stack of words, which is also what the
        backward reads. Residuals: each layer's input activation, the shards, the gather
        inputs and the new caches (no gathered weights). Backward: the layers in reverse, each
        recomputed on its full weights and its cotangents ``psum_scatter``-ed."""
        at = lambda tree, i: jax.tree.map(  # noqa: E731
            lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
        head = lambda tree: jax.tree.map(lambda a: a[:-1], tree)  # noqa: E731
        first = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
        cat = lambda a, b: jnp.concatenate([a, b], axis=0)  # noqa: E731
        put = lambda stack, i, c: jax.tree.map(  # noqa: E731
            lambda s, v: lax.dynamic_update_index_in_dim(s, v, i, 0), stack, c)

        def forward(shards, others, rest, x, args, inputs):
            frozen = lax.stop_gradient(shards)
            stacks = {k: inputs[k][1] for k in held}  # old words in; new words out, in place

            def fetch(i, stacks):
                fulls, caches, stats = {}, {}, {}
                for k, t in tensors.items():
                    gin = at(inputs[k], i)
                    if k in held:  # this layer's old words from the carried stack
                        gin = (gin[0], at(stacks[k], i), gin[2])
                    fulls[k], c, stats[k] = self.gather_one(t, at(frozen[k], i), gin)
                    if c is not None:
                        if k in held:
                            stacks = {**stacks, k: put(stacks[k], i, c)}
                        else:
                            caches[k] = c
                return fulls, caches, stats, stacks

            def layer(i, fulls, x):
                return compute(fulls, at(others, i), (at(rest, i), (x, *args)))

            fulls, c0, s0, stacks = fetch(0, stacks)
            if n == 1:
                x_last = x
                x, y = layer(0, fulls, x)
                ys, cs, ss, x_in = first(y), first(c0), first(s0), None
            else:
                def body(carry, i):
                    x, fulls, stacks = carry
                    nxt, c, s, stacks = fetch(i + 1, stacks)  # independent of layer i
                    x_next, y = layer(i, fulls, x)
                    return (x_next, nxt, stacks), (y, c, s, x)

                (x_last, fulls, stacks), (ys, cs, ss, x_in) = lax.scan(
                    body, (x, fulls, stacks), jnp.arange(n - 1))
                x, y = layer(n - 1, fulls, x_last)
                ys = jax.tree.map(lambda a, b: cat(a, b[None]), ys, y)
                cs = jax.tree.map(lambda a, b: cat(a[None], b), c0, cs)
                ss = jax.tree.map(lambda a, b: cat(a[None], b), s0, ss)
            cs = {**cs, **stacks}
            res = (shards, others, rest, args, inputs, {k: cs[k] for k in held}, x_in, x_last)
            return (x, ys, cs, ss), res

        def backward(res, cts):
            shards, others, rest, args, inputs, held_caches, x_in, x_last = res
            ct_x, ct_ys = cts[0], cts[1]

            def layer_bwd(i, x, ct_x, ct_y):
                fulls = self._backward_fulls(tensors, at(shards, i), at(inputs, i),
                                             at(held_caches, i))
                _, vjp = jax.vjp(compute, fulls, at(others, i), (at(rest, i), (x, *args)))
                ct_fulls, ct_others, (ct_rest, (ct_x, *ct_args)) = vjp((ct_x, ct_y))
                # float0 cotangents (integer state, integer args) cannot ride in a scan
                return ct_x, (self._scatter(tensors, ct_fulls, at(shards, i)), ct_others,
                              _drop_float0(ct_rest), _drop_float0(tuple(ct_args)))

            ct_x, last = layer_bwd(n - 1, x_last, ct_x, at(ct_ys, n - 1))
            if n == 1:
                grads, ct_args = first(last[:3]), last[3]
            else:
                def body(carry, xs):
                    ct_x, ct_args = carry
                    i, x, ct_y = xs
                    ct_x, (g_shards, g_others, g_rest, g_args) = layer_bwd(i, x, ct_x, ct_y)
                    ct_args = jax.tree.map(jnp.add, ct_args, g_args)
                    return (ct_x, ct_args), (g_shards, g_others, g_rest)

                (ct_x, ct_args), grads = lax.scan(
                    body, (ct_x, last[3]), (jnp.arange(n - 1), x_in, head(ct_ys)),
                    reverse=True)
                grads = jax.tree.map(lambda a, b: cat(a, b[None]), grads, last[:3])
            g_shards, g_others, g_rest = grads
            return (g_shards, g_others, _with_float0(rest, g_rest), ct_x,
                    _with_float0(args, ct_args), _float0_like(inputs))

        run = jax.custom_vjp(lambda *a: forward(*a)[0])
        run.defvjp(forward, backward)
        return run


def _typed_like_gather(full, shard, axis_name):
    """A full tensor read from a cache, typed like a gather's result: varying over the gather
    axis (as ``lax.all_gather`` types it) and over every other axis the shard varies over."""
    want = (varying_axes(shard) | {axis_name}) & set(jax.sharding.get_abstract_mesh().manual_axes)
    missing = tuple(sorted(want - varying_axes(full)))
    return lax.pcast(full, missing, to="varying") if missing else full


def _drop_float0(tree):
    """float0 cotangent leaves as a bool scalar placeholder (:func:`_with_float0` undoes it)."""
    return jax.tree.map(lambda c: jnp.zeros((), jnp.bool_)
                        if getattr(c, "dtype", None) == jax.dtypes.float0 else c, tree)


def _with_float0(primal, ct):
    """Cotangents of ``primal``: ``ct``'s leaves for inexact leaves, float0 for the rest."""
    return jax.tree.map(lambda p, c: c if jnp.issubdtype(jnp.result_type(p), jnp.inexact)
                        else np.zeros(jnp.shape(p), jax.dtypes.float0), primal, ct)


def _is_word_cache(cache) -> bool:
    return isinstance(cache, cache_lib.WordCache)


def _cache_specs(cache, t: GatheredTensor, axis_name: str):
    """Per leaf of one cache: leaves shaped like the tensor are split like its gathered
    weight (the parameter's spec without the gather axis), the rest (flags) replicated."""
    kept = without_axis(t.spec, axis_name)
    return jax.tree.map(lambda leaf: P(*kept) if any(kept) and jnp.ndim(leaf) == len(t.shape)
                        else P(), cache)


def _to_spec(x, spec: P):
    """On a mesh with Explicit axes, ``x`` resharded to ``spec`` (its Explicit axes): a
    ``shard_map`` there takes inputs whose type carries exactly its in_specs. No-op on Auto
    axes (``shard_map`` reshards) and when ``x`` already has the layout."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = {a for a, k in zip(mesh.axis_names, mesh.axis_types)
                if k == jax.sharding.AxisType.Explicit}
    if not explicit:
        return x
    keep = []
    for e in spec:
        names = tuple(a for a in names_of(e) if a in explicit)
        keep.append(None if not names else names[0] if len(names) == 1 else names)
    target = P(*keep)
    current = getattr(jax.typeof(x), "sharding", None)
    if current is not None and tuple(current.spec) + (None,) * (jnp.ndim(x) - len(
            current.spec)) == tuple(target) + (None,) * (jnp.ndim(x) - len(target)):
        return x
    return jax.sharding.reshard(x, target)


def _cache_of(p, t: GatheredTensor, name: str):
    """The cache beside parameter ``p``, checked against the tensor it serves."""
    var = getattr(p.owner, cache_attr(p.name), None)
    if not isinstance(var, GatherCacheVar):
        raise ValueError(f"{name}: gather 'ciera' needs an exponent cache for this parameter "
                         f"and it has none: call ciera_jax.fsdp.attach_caches(model) once "
                         f"after building the model (or gather with fsdp.gather_mode('plain'))")
    cache = var.get_value()
    shape = getattr(cache, "shape", None)
    if cache_lib.is_cache(cache) and shape is not None and tuple(shape) != t.shape:
        raise ValueError(f"{name}: its cache is for shape {tuple(shape)} but the gather is "
                         f"{t.shape}; layers stacked with nnx.vmap are recognised when built "
                         f"from Flax layers (Linear, Einsum, Embed, Conv, norms); otherwise "
                         f"call fsdp.attach_caches inside the function that builds one layer, "
                         f"or build the stack with fsdp.stack")
    return cache


def _leave_state(module, params: list, new_caches: dict, stats: dict) -> None:
    """New caches into the cache variables beside their parameters, stats onto ``module``."""
    for p in params:
        if new_caches.get(p.key) is not None:
            getattr(p.owner, cache_attr(p.name)).set_value(new_caches[p.key])
    record(module, stats)


def _run_with(module, values: list, fn, args, kwargs, engine):
    """``fn(module, ...)`` with each (Variable, value) of ``values`` holding it meanwhile."""
    saved = [(var, var.get_value()) for var, _ in values]
    try:
        for var, v in values:
            var.set_value(v)
        with engine.active():  # decorated sub-modules gather their own through it
            return fn(module, *args, **kwargs)
    finally:
        for var, v in saved:
            var.set_value(v)


def _run_cast(module, fn, args, kwargs, spec: GatherSpec):
    """``fn`` on the values the module holds (already whole), split ones cast to the dtype."""
    params = sharded_params(module, spec)
    values = [(p.var, p.var.get_value().astype(spec.dtype) if spec.dtype is not None
               else p.var.get_value()) for p in params]
    saved = [(var, var.get_value()) for var, _ in values]
    try:
        for var, v in values:
            var.set_value(v)
        return fn(module, *args, **kwargs)
    finally:
        for var, v in saved:
            var.set_value(v)


@contextlib.contextmanager
def gather_mode(mode: str = "ciera", *, axis_name: str = AXIS, impl: str = "auto"):
    """Select the gather of gathering modules: activates a default :class:`Engine`.

    ``ciera``: the caches' compressed gather (lossless; exponent or word caches, see
    :func:`~ciera_jax.fsdp.attach_caches`); ``plain``: all-gather of the bits (lossless
    baseline); ``int8``: blockwise absmax int8 gather (lossy baseline, ZeRO++ qwZ). It may
    enclose calls of a jitted step or sit inside it: the mode is part of ``jit``'s cache key,
    so a step traced under one mode and called under another is traced again. Stats are
    module state: read them with :func:`~ciera_jax.fsdp.gather_stats` (the yielded engine has
    none).
    """
    engine = Engine(mode, axis_name=axis_name, impl=impl)
    with engine.active():
        yield engine

"""Gathers prepared for a train step (inside its ``shard_map``): the step encoded every
compressed tensor at the end of the previous step and agreed on all of them with ONE collective
(:mod:`ciera_jax.fsdp.phases`); :func:`prepare` hands each gathering module its tensors'
``Encoded`` and agreement, as module state, with a static
:class:`~ciera_jax.fsdp.state.setup.GatherSetup`.

A prepared module's call gathers with them (:func:`call`), and a layer stack run by
:func:`~ciera_jax.fsdp.scan_layers` gathers layer l+1 while layer l computes (:func:`scan`).
Both go through :func:`_run`, the one custom VJP (:class:`_LayerLoop`'s forward and
backward): the forward keeps no gathered weights as residuals; the backward reads a word-cache
tensor's full words from the cache the forward left
(no second gather, no second copy), an exponent-cache tensor's exponents from its new cache
beside a gather of its sign + mantissa bytes alone (:mod:`~ciera_jax.fsdp.regather`), and
gathers every other tensor again (the same exact, pure function). Either way the compute sees
its weights through one ``optimization_barrier``, forward and backward, so XLA compiles the
same matmuls whichever path delivered them and the parameters stay bitwise those of a plain
gather. What the forward keeps for the backward besides each layer's input is the setup's
``remat`` policy (:mod:`~ciera_jax.fsdp.remat`); never a gathered weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import ciera_jax.collective.cache as cache_lib
from ciera_jax.fsdp import buckets, remat as remat_lib
from ciera_jax.fsdp.state.axes import AXIS, axis_size, varying_axes
from ciera_jax.fsdp.state.caches import GatherCacheVar, cache_attr
from ciera_jax.fsdp.state.discovery import gather_spec, iter_modules, module_path, path_key
from ciera_jax.fsdp.gather import gather
from ciera_jax.fsdp.state.inventory import GatheredTensor, gatherers
from ciera_jax.fsdp.state.setup import (DEFAULT_REMAT, DEFAULT_WORD_BACKWARD, GatherSetup,
                                        set_setup, setup_of)
from ciera_jax.fsdp.regather import regather
from ciera_jax.fsdp.state.stacking import stack_size
from ciera_jax.fsdp.state.stats import GatherStats, layer_stats, record, stats_by_key
from ciera_jax.runtime.loops import rolled_scan
from ciera_jax.runtime.varying import varying_over

INPUTS_ATTR = "ciera_gather_inputs"


class GatherInputs(nnx.Variable):
    """A prepared module's ``{parameter path below it: (Encoded, agreed)}`` for this step
    (per layer in a stack). Made inside the step, never checkpointed."""


def prepare(model: nnx.Module, encoded: dict, agreed: dict, mode: str = "ciera", *,
            word_backward: str = DEFAULT_WORD_BACKWARD, impl: str = "auto",
            remat: str = DEFAULT_REMAT) -> nnx.Module:
    """Hand every gathering module of ``model`` the step's gather inputs (``encoded`` and
    ``agreed``: ``{tensor key: ...}``, from :func:`~ciera_jax.fsdp.encode_tensors` and
    :func:`~ciera_jax.fsdp.agree_tensors`) and a prepared setup; returns ``model``. Call it
    inside the step's ``shard_map`` on the model merged there; read the new caches and
    stats from the model's state after the forward. ``remat``: what a layer stack's forward
    saves for its backward (:data:`~ciera_jax.fsdp.state.setup.REMAT_POLICIES`: ``full``, each
    layer's input alone; ``save_dot_except_mlp``, the attention's projections too; ``none``,
    all that autodiff keeps), never a gathered weight."""
    missing = [k for k in encoded if k not in agreed]
    if missing:
        raise ValueError(f"no agreement for {missing}: run agree_tensors once per step")
    encoded = encoded if mode == "ciera" else {}
    for g in gatherers(model):
        set_setup(g.module, GatherSetup(mode, impl, prepared=True, word_backward=word_backward,
                                        remat=remat))
        local = {g.key(p): p.key for p in g.params}
        mine = {p.key: (encoded[g.key(p)], agreed[g.key(p)]) for p in g.params
                if g.key(p) in encoded}
        for key, e in encoded.items():  # a bucket's inputs go to the module gathering it
            if buckets.is_bucket(e) and e.members[0] in local:
                mine[key.rsplit("/", 1)[-1]] = (buckets.BucketEncoded(
                    e.encoded, tuple(local[m] for m in e.members)), agreed[key])
        if mine:
            setattr(g.module, INPUTS_ATTR, GatherInputs(mine))
    return model


def _inputs(module) -> dict:
    var = getattr(module, INPUTS_ATTR, None)
    return var.get_value() if isinstance(var, GatherInputs) else {}


def _members(module, layers: int) -> tuple[list, dict]:
    """(key below ``module``, gathering module, its param, tensor, gather inputs or None) of
    every parameter gathered under ``module`` (a stack of ``layers``, or one call: 0), read
    from the inventory of ``module``, and the buckets' gather inputs by bucket key. Gathering
    sub-modules' parameters are gathered here too, with the rest: the sub-modules then hold
    full weights and only run.

    Gather inputs are ``(Encoded, cache, agreed)``; a bucket member's are ``(None, cache,
    None)`` and its bucket's ``(BucketEncoded, None, agreed)``."""
    out, bucket_inputs = [], {}
    prefix = module_path(module)
    for g in gatherers(module):
        n_ranks = axis_size(g.spec.axis_name)
        inputs = _inputs(g.module)
        in_bucket = set()
        for name, (enc, agreed) in inputs.items():
            if buckets.is_bucket(enc):
                at = {p.key: g.key(p) for p in g.params}
                members = tuple(at[m] for m in enc.members)
                bucket_inputs[g.key_of(name)] = (buckets.BucketEncoded(enc.encoded, members),
                                                 None, agreed)
                in_bucket.update(enc.members)
        for p in g.params:
            key = g.key(p)
            shape = list(p.layer_shape)
            shape[p.axis - p.lead] *= n_ranks
            t = GatheredTensor(f"{prefix}/{key}" if prefix else key, p.axis - p.lead,
                               tuple(shape), g.spec.dtype or p.var.get_value().dtype,
                               layers, prefix, p.spec, "/".join(map(str, g.path)))
            gin = None
            if p.key in inputs or p.key in in_bucket:
                enc, agreed = inputs.get(p.key, (None, None))
                gin = (enc, getattr(p.owner, cache_attr(p.name)).get_value(), agreed)
            out.append((key, g.module, p, t, gin))
    return out, bucket_inputs


def _leave(members, caches: dict, stats: dict) -> None:
    """New caches into their variables, stats onto the gathering modules (once each)."""
    per_module: dict = {}
    for key, gm, p, _, _ in members:
        if key in caches:
            getattr(p.owner, cache_attr(p.name)).set_value(caches[key])
        per_module.setdefault(id(gm), (gm, {}))[1][p.key] = stats[key]
    for gm, st in per_module.values():
        record(gm, st)


def call(module, fn, args, kwargs, setup: GatherSetup):
    """A prepared module's call inside the step's ``shard_map``."""
    names = tuple(kwargs)
    args = tuple(args) + tuple(kwargs.values())

    def body(m, x, *a):
        pos, kw = a[:len(a) - len(names)], dict(zip(names, a[len(a) - len(names):]))
        return x, fn(m, *pos, **kw)

    _, y = _scan(module, (), args, setup, 0, body)
    return y


def scan(stack_module, x, *args):
    """Run a prepared layer stack: layer l computes on weights gathered during layer l-1.
    ``x, y = layer(x, *args)``; returns ``(x, ys)``."""
    setup = next(setup_of(m) for _, m in iter_modules(stack_module) if gather_spec(m))
    return _scan(stack_module, x, args, setup, stack_size(stack_module),
                 lambda m, x, *a: m(x, *a))


def _scan(module, x, args, setup: GatherSetup, layers: int, body):
    """``body(module holding full weights, x, *args) -> (x, y)`` over ``layers`` stacked
    layers (0: one call), every gather through :func:`_run`; new caches and stats are left
    in ``module``'s state."""
    members, bucket_inputs = _members(module, layers)
    graphdef, params, skipped, rest = nnx.split(
        module, nnx.Param, (GatherCacheVar, GatherInputs, GatherStats), ...)
    keys = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    leaves, treedef = jax.tree.flatten(params)
    values = dict(zip(keys, leaves))
    dummy = jax.tree.map(lambda a: np.zeros((), a.dtype), skipped)  # held modules read none
    tensors = {k: t for k, _, _, t, _ in members}
    inputs = {**{k: gin for k, _, _, _, gin in members}, **bucket_inputs}
    shards = {k: values[k].astype(t.dtype) for k, t in tensors.items()}
    others = {k: v for k, v in values.items() if k not in tensors}

    def compute(fulls, others, call_args):
        return compute_on(lax.optimization_barrier(fulls), others, call_args)

    def compute_on(fulls, others, call_args):
        """The layer on ``fulls`` as they come: :func:`_run` passes them through the
        barrier when it takes the layer's VJP in the forward."""
        rest, (x, *args) = call_args
        copy = nnx.merge(graphdef, jax.tree.unflatten(
            treedef, [fulls[k] if k in fulls else others[k] for k in keys]), dummy, rest)
        for _, m in iter_modules(copy):  # they hold full weights: their calls only run
            if gather_spec(m) is not None:
                set_setup(m, dataclasses.replace(setup_of(m), held=True))
        return body(copy, x, *args)

    held = _cached(inputs, setup, cache_lib.WordCache)  # bucket members too: own caches
    axis_name = gather_spec(members[0][1]).axis_name if members else AXIS
    regathered = _payload_groups(inputs, _cached(inputs, setup, cache_lib.ExponentCache))
    run = _run(compute, tensors, held, regathered, layers, setup, axis_name, compute_on,
               _carried(inputs))
    x, ys, cs, ss = run(shards, others, rest, x, tuple(args), inputs)
    _leave(members, cs, ss)
    return x, ys


def _carried(inputs: dict) -> tuple:
    """Keys gathered with a cache (bucket members included), in the members' order: a layer
    loop carries each one's cache stack and updates it in place, one layer at a time, so the
    step holds one stack of every cache, not the old one and a new one (a loop's outputs are a
    new stack; the first layer's cache, peeled off the loop, makes a third to concatenate).
    Exponent caches are carried as well as the word caches the backward reads: each carried
    stack is one cache stack less in the step's memory."""
    return tuple(k for k, gin in inputs.items() if gin is not None and cache_lib.is_cache(gin[1]))


def _cached(inputs: dict, setup: GatherSetup, kind) -> tuple:
    """Keys whose backward reads their cache (``word_backward="cache"``), with a
    compressible cache of ``kind``. A tuple in the members' order, not a set: what is traced
    must not depend on string hashing, which differs between processes (a multi-host step
    would differ per host, and JAX's persistent cache would miss)."""
    if setup.word_backward != "cache":
        return ()
    return tuple(k for k, gin in inputs.items() if gin is not None
                 and isinstance(gin[1], kind) and gin[1].compressible)


def _payload_groups(inputs: dict, keys: tuple) -> tuple:
    """``keys`` as the backward's payload transfers: a bucket all of whose members are among
    them as one, every other key alone."""
    groups, grouped = [], set()
    for gin in inputs.values():
        if gin is not None and buckets.is_bucket(gin[0]) and set(gin[0].members) <= set(keys):
            groups.append(gin[0].members)
            grouped.update(gin[0].members)
    return tuple(groups) + tuple((k,) for k in keys if k not in grouped)


def _run(compute, tensors: dict, held: tuple, regathered: tuple, n: int, plan: GatherSetup,
         axis_name: str, compute_on=None, carried: tuple = ()):
    """``run(shards, others, rest, x, args, inputs) -> (x, ys, new caches, stats)`` over
    ``n`` stacked layers (0: one call, nothing stacked), with its own backward
    (:class:`_LayerLoop`: its forward and backward)."""
    loop = _LayerLoop(compute, tensors, held, regathered, n, plan, axis_name, compute_on,
                      carried)
    run = jax.custom_vjp(lambda *a: loop.forward(*a, keep=False)[0])
    run.defvjp(loop.forward, loop.backward)
    return run


def _at(tree, i):
    """Layer ``i`` of every leaf of ``tree`` (None: ``tree``, nothing stacked). ``i`` is a
    layer loop's counter, never negative: no index normalisation (a compare and a select
    every slice of the layer shares)."""
    if i is None:
        return tree
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(
        a, i, keepdims=False, allow_negative_indices=False), tree)


def _put(stack, i, c):
    """``stack`` with layer ``i`` set to ``c`` (None: ``c``, nothing stacked)."""
    if i is None:
        return c
    return jax.tree.map(lambda s, v: lax.dynamic_update_index_in_dim(
        s, v, i, 0, allow_negative_indices=False), stack, c)


def _first(tree):
    return jax.tree.map(lambda a: a[None], tree)


def _cat(a, b):
    return jnp.concatenate([a, b], axis=0)


class _LayerLoop:
    """The forward and backward of :func:`_run` over ``n`` stacked layers.

    Forward: a scan whose body gathers layer l+1 (independent of the activations) next to
    layer l's compute. The cache stack of each ``carried`` key (:func:`_carried`) is carried
    through the scan and updated one layer at a time in place (each gather reads its layer's
    old words or exponents and writes the new ones), so the step holds one stack of each
    cache, which is also what the backward reads. Residuals: each layer's input activation,
    the shards, the gather inputs and the new caches the backward reads (no gathered
    weights). Backward: the layers in reverse,
    each recomputed on its full weights and its cotangents ``psum_scatter``-ed; ``held``
    keys' full weights are their new word caches, ``regathered`` (exponent-cache keys, grouped
    into the backward's payload transfers) come from :func:`~ciera_jax.fsdp.regather.regather`.

    ``plan.remat`` other than ``full``: the forward takes each layer's VJP (``compute_on``
    under the policy, :func:`~ciera_jax.fsdp.remat.vjp_saving`) and keeps its residuals but
    the weights; the backward rebuilds it on the weights it got again."""

    def __init__(self, compute, tensors: dict, held: tuple, regathered: tuple, n: int,
                 plan: GatherSetup, axis_name: str, compute_on, carried: tuple):
        self.compute, self.tensors, self.held, self.regathered = (compute, tensors, held,
                                                                  regathered)
        self.n, self.plan, self.axis_name, self.carried = n, plan, axis_name, carried
        self.saving = remat_lib.saves_activations(plan.remat)
        self.layout = remat_lib.Layout()
        if self.saving:
            self.layer_fn = remat_lib.under_policy(
                lambda w, inputs: compute_on(w, *inputs), plan.remat)
        # the forward's gathers, traced once: the first layer's (peeled off the loop) and the
        # loop body's have the same shapes, so the second call reuses the first's trace and
        # lowering (less StableHLO, less time to trace and lower; XLA inlines the call, so the
        # compiled step is the same)
        self.gather_layer_once = jax.jit(self.gather_layer)
        self.from_cache = held + tuple(k for g in regathered for k in g)

    def gather_layer(self, shards, inputs, keys=None):
        """:func:`~ciera_jax.fsdp.gather` of one layer's ``keys`` (all: None) and of the
        buckets all of whose members are among them; ``inputs``: ``{key: (Encoded, cache,
        agreed) or None}``."""
        keys = list(shards) if keys is None else keys
        ready = {k: g for k, g in inputs.items() if g is not None and (
            k in keys or buckets.is_bucket(g[0]) and set(g[0].members) <= set(keys))}
        return gather({k: self.tensors[k] for k in keys}, {k: shards[k] for k in keys},
                      {k: g[1] for k, g in ready.items() if g[1] is not None}, self.plan,
                      self.axis_name,
                      prepared={k: (g[0], g[2]) for k, g in ready.items() if g[0] is not None})

    def backward_fulls(self, shards, inputs, new_caches):
        """Held keys from their (new) word cache, exponent-cache keys from their (new)
        exponents and a payload gather (:mod:`~ciera_jax.fsdp.regather`), the rest gathered
        again."""
        shards = lax.stop_gradient(shards)
        fulls = self.gather_layer(shards, inputs,
                                  [k for k in shards if k not in self.from_cache])[0]
        fulls.update(regather(self.tensors, shards, new_caches, self.regathered,
                              self.axis_name, axis_size(self.axis_name)))
        fulls.update({k: cache_lib.cached_full(new_caches[k]) for k in self.held})
        return {k: _typed_like_gather(fulls[k], shards[k], self.axis_name) for k in shards}

    def scatter(self, ct_fulls, shards):
        """Weight cotangents: the transpose of the all-gather (``psum_scatter``)."""
        return {k: lax.psum_scatter(ct_fulls[k], self.axis_name,
                                    scatter_dimension=self.tensors[k].axis,
                                    tiled=True).astype(shards[k].dtype) for k in shards}

    def fetch(self, i, frozen, inputs, stacks):
        """Layer ``i``'s gathers: ``(fulls, new caches not carried, stats, stacks)``, the
        carried keys' old caches read from ``stacks`` and their new ones written back."""
        inputs_i = {k: _at(gin, i) for k, gin in inputs.items()}
        for k in self.carried:  # this layer's old cache from the carried stack
            inputs_i[k] = (inputs_i[k][0], _at(stacks[k], i), inputs_i[k][2])
        fulls, new, stats = self.gather_layer_once(_at(frozen, i), inputs_i)
        stacks = {**stacks, **{k: _put(stacks[k], i, new[k]) for k in self.carried if k in new}}
        return (fulls, {k: c for k, c in new.items() if k not in self.carried},
                layer_stats(stats), stacks)

    def layer(self, i, fulls, x, others, rest, args, keep):
        """Layer ``i`` on ``fulls``: ``((x, y), residuals the policy keeps)``."""
        call = (_at(others, i), (_at(rest, i), (x, *args)))
        if not (self.saving and keep):
            return self.compute(fulls, *call), []
        return remat_lib.vjp_saving(self.layout, self.layer_fn,
                                    lax.optimization_barrier(fulls), call)

    def forward(self, shards, others, rest, x, args, inputs, keep=True):
        """``((x, ys, new caches, stats), residuals)``: every layer gathered and run."""
        n = self.n
        frozen = lax.stop_gradient(shards)
        stacks = {k: inputs[k][1] for k in self.carried}  # old caches in; new out, in place
        fulls, c0, s0, stacks = self.fetch(0 if n else None, frozen, inputs, stacks)
        if n <= 1:
            x_in = x[None] if n else x
            (x, y), sv = self.layer(0 if n else None, fulls, x, others, rest, args, keep)
            ys, cs, ss, saved = ((_first(y), _first(c0), _first(s0), _first(sv)) if n
                                 else (y, c0, s0, sv))
        else:
            x, ys, cs, ss, x_in, saved, stacks = self._stacked(
                fulls, c0, s0, stacks, frozen, others, rest, x, args, inputs, keep)
        cs = {**cs, **stacks}
        res = (shards, others, rest, args, inputs, {k: cs[k] for k in self.from_cache}, x_in,
               saved)
        return (x, ys, cs, stats_by_key(ss)), res

    def _stacked(self, fulls, c0, s0, stacks, frozen, others, rest, x, args, inputs, keep):
        """Layers 1.. of ``n`` > 1 in a loop (layer 0's gathers, ``fulls``, ``c0``, ``s0``,
        done): ``(x, ys, cs, ss, x_in, saved, stacks)`` over every layer."""
        n = self.n

        def body(carry, i):
            x, fulls, stacks = carry
            nxt, c, s, stacks = self.fetch(i + 1, frozen, inputs, stacks)  # independent of i
            (x_next, y), sv = self.layer(i, fulls, x, others, rest, args, keep)
            return (x_next, nxt, stacks), (y, c, s, x, sv)

        # compressed gathers in the loop: rolled (its docstring says why); plain ones keep
        # XLA's scan, double-buffered as plain FSDP compiles
        scan = rolled_scan if any(g is not None for g in inputs.values()) else lax.scan
        (x_last, fulls, stacks), (ys, cs, ss, x_in, saved) = scan(
            body, (x, fulls, stacks), jnp.arange(n - 1))
        (x, y), sv = self.layer(n - 1, fulls, x_last, others, rest, args, keep)
        x_in = _cat(x_in, x_last[None])
        ys = jax.tree.map(lambda a, b: _cat(a, b[None]), ys, y)
        saved = jax.tree.map(lambda a, b: _cat(a, b[None]), saved, sv)
        cs = jax.tree.map(lambda a, b: _cat(a[None], b), c0, cs)
        ss = jax.tree.map(lambda a, b: _cat(a[None], b), s0, ss)
        return x, ys, cs, ss, x_in, saved, stacks

    def layer_backward(self, res, i, x, ct_x, ct_y, saved):
        """Layer ``i``'s VJP on its weights got again: ``(ct_x, (shard grads, others',
        rest's, args'))``."""
        shards, others, rest, args, inputs, new_caches, _, _ = res
        fulls = self.backward_fulls(_at(shards, i), _at(inputs, i), _at(new_caches, i))
        call = (_at(others, i), (_at(rest, i), (x, *args)))
        if self.saving:  # the forward's VJP, on the weights got again
            vjp = remat_lib.vjp_rebuilt(self.layout, lax.optimization_barrier(fulls), call,
                                        saved)
            ct_fulls, (ct_others, (ct_rest, (ct_x, *ct_args))) = vjp((ct_x, ct_y))
        else:
            _, vjp = jax.vjp(self.compute, fulls, *call)
            ct_fulls, ct_others, (ct_rest, (ct_x, *ct_args)) = vjp((ct_x, ct_y))
        # float0 cotangents (integer state, integer args) cannot ride in a scan
        return ct_x, (self.scatter(ct_fulls, _at(shards, i)), ct_others,
                      remat_lib.drop_float0(ct_rest), remat_lib.drop_float0(tuple(ct_args)))

    def backward(self, res, cts):
        """The layers in reverse: the cotangents of ``forward``'s arguments."""
        _, _, rest, args, inputs, _, x_in, saved = res
        ct_x, ct_ys = cts[0], cts[1]
        if not self.n:
            ct_x, (*grads, ct_args) = self.layer_backward(res, None, x_in, ct_x, ct_ys, saved)
        else:
            # Every layer in the one scan (none peeled off): the backward's gathers and the
            # layer's VJP are compiled once.
            def body(carry, xs):
                ct_x, ct_args = carry
                i, x, ct_y, saved = xs
                ct_x, (g_shards, g_others, g_rest, g_args) = self.layer_backward(
                    res, i, x, ct_x, ct_y, saved)
                ct_args = jax.tree.map(jnp.add, ct_args, g_args)
                return (ct_x, ct_args), (g_shards, g_others, g_rest)

            (ct_x, ct_args), grads = lax.scan(
                body, (ct_x, remat_lib.zero_cotangents(args)),
                (jnp.arange(self.n), x_in, ct_ys, saved), reverse=True)
        g_shards, g_others, g_rest = grads
        return (g_shards, g_others, remat_lib.with_float0(rest, g_rest), ct_x,
                remat_lib.with_float0(args, ct_args), remat_lib.float0_like(inputs))


def _typed_like_gather(full, shard, axis_name):
    """A full tensor read from a cache, typed like a gather's result: varying over the gather
    axis (as ``lax.all_gather`` types it) and over every other axis the shard varies over."""
    want = (varying_axes(shard) | {axis_name}) & set(jax.sharding.get_abstract_mesh().manual_axes)
    return varying_over(full, want)

"""The encode program a user's step is followed by: every compressed tensor of every gathering
module encoded against its cache, ONE agreement over all their demands, and the rung each
demand needs, left on the modules as their inputs made ahead
(:mod:`~ciera_jax.fsdp.state.ahead`). The host reads the needed rungs before the next step
and picks the program that holds them (:mod:`~ciera_jax.loop.step`).

It runs under ``jit`` with the mesh set, in one ``shard_map`` over every module's shards and
caches, and encodes exactly what the module's next call gathers (the same tensors, shards in
the compute dtype, caches and buckets as :mod:`~ciera_jax.fsdp.percall`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import ciera_jax.collective.gather as collective
from ciera_jax.collective import capacity
from ciera_jax.fsdp import buckets, phases
from ciera_jax.fsdp.gather import cache_specs_of
from ciera_jax.fsdp.percall import call_inputs, checked_params, compresses
from ciera_jax.fsdp.state.ahead import rank_spec, set_ahead
from ciera_jax.fsdp.state.axes import REGION, placement
from ciera_jax.fsdp.state.caches import GatherCacheVar, cache_attr
from ciera_jax.fsdp.state.discovery import module_name, module_path
from ciera_jax.fsdp.state.inventory import GatheredTensor, gatherers
from ciera_jax.fsdp.state.setup import gathering_modules, set_setup, setup_of


class _Unit(NamedTuple):
    """One gathering module's inputs to the encode program."""

    path: str  # its module path
    tensors: dict  # {key: GatheredTensor}, one layer's
    shards: dict  # {key: shard in the compute dtype}, layers first when stacked
    caches: dict  # {key: cache} of the tensors it compresses
    axis: str
    impl: str
    layers: int  # 0: not stacked


def _place(g) -> str:
    """Where ``g``'s calls gather (REGION), or a one-line error for a module this path cannot
    run."""
    where = module_name(g.module)
    place = placement(g.spec.axis_name, where)
    if place != REGION:
        raise ValueError(f"{where}: ciera_jax.train_step runs under jit with the mesh set "
                         f"(jax.set_mesh) and the parameters placed on it")
    return place


def _stacked_inputs(g, setup) -> tuple[dict, dict, dict]:
    """``(tensors, shards, caches)`` of a gathering module in a layer stack (its calls run
    one layer at a time in an ``nnx.scan``): one layer's tensors, as such a call builds them
    (:func:`~ciera_jax.fsdp.percall.call_inputs`), with every layer's shards and caches."""
    prefix = module_path(g.module)
    tensors, shards, caches = {}, {}, {}
    for p in g.params:
        value = p.var.get_value()
        t = tensors[p.key] = GatheredTensor(
            f"{prefix}/{p.key}" if prefix else p.key, p.axis - p.lead, p.layer_shape,
            g.spec.dtype or value.dtype, g.layers, spec=p.spec)
        shards[p.key] = value.astype(t.dtype)
        var = getattr(p.owner, cache_attr(p.name), None)
        if compresses(p, t, setup) and isinstance(var, GatherCacheVar):
            caches[p.key] = var.get_value()
    return tensors, shards, caches


def _units(model: nnx.Module) -> list[_Unit]:
    """Every gathering module under ``model`` whose call compresses (``ciera`` mode, a
    cache), in model order."""
    units = []
    for g in gatherers(model):
        m, setup = g.module, setup_of(g.module)
        if setup.mode != "ciera" or setup.held:
            continue
        place = _place(g)
        if g.layers:
            t, s, c = _stacked_inputs(g, setup)
        else:
            t, s, c = call_inputs(m, checked_params(m, g.spec, place), g.spec, setup, place)
        if c:
            units.append(_Unit("/".join(map(str, g.path)), t, s, c, g.spec.axis_name,
                               setup.impl, g.layers))
    return units


def unit_specs(u: _Unit) -> dict:
    """``{key: spec of its per-rank Encoded stack}`` in the order
    :func:`~ciera_jax.fsdp.encode_tensors` returns one module's keys: its compressed tensors
    outside buckets, then its buckets (each with its first member's spec); a layer stack's
    with its layer axis first, whole."""
    tensors, caches = u.tensors, u.caches
    keys = [k for k in tensors if k in caches]
    bucket_of = buckets.groups(tensors, caches, u.axis, keys)
    members = {m for ms in bucket_of.values() for m in ms}
    firsts = {**{k: k for k in keys if k not in members},
              **{b: ms[0] for b, ms in bucket_of.items()}}
    return {k: rank_spec(tensors[first].spec, layers=bool(u.layers))
            for k, first in firsts.items()}


def _in_specs(u: _Unit) -> tuple[dict, dict]:
    """The encode program's in_specs of one unit's shards and caches."""
    lead = (None,) if u.layers else ()
    shards = {k: P(*lead, *t.spec) for k, t in u.tensors.items()}
    caches = {k: cache_specs_of(c, u.tensors[k], u.axis, layers=bool(u.layers))
              for k, c in u.caches.items()}
    return shards, caches


def ahead_specs(model: nnx.Module) -> dict:
    """``{module path: {key: (Encoded spec, P(), P())}}``: how :func:`ahead_values` leaves
    its results on the mesh (the ``Encoded`` stacks split on their rank axis, the agreement
    and needed rung replicated), for abstract arguments placed as the program makes them."""
    return _specs(_units(model))


def _specs(units: list) -> dict:
    return {u.path: {k: (spec, P(), P()) for k, spec in unit_specs(u).items()} for u in units}


def ahead_values(model: nnx.Module) -> dict:
    """``{module path: {key: (Encoded per rank, agreed, needed rung)}}`` of every gathering
    module under ``model`` whose call compresses (``ciera`` mode, a cache), traced under
    ``jit`` with the mesh set."""
    units = _units(model)
    if not units:
        return {}
    ax = units[0].axis
    if any(u.axis != ax for u in units):
        raise ValueError(f"ciera_jax.train_step: every gathering module gathers over one axis, "
                         f"got {sorted({u.axis for u in units})}")

    def body(shards, caches):
        encoded = [phases.encode_tensors(u.tensors, s, c, dict.fromkeys(c, True), ax, u.impl)
                   for u, s, c in zip(units, shards, caches)]
        agreed = iter(collective.agree([buckets.unwrap(e) for enc in encoded
                                        for e in enc.values()], ax))
        out = []
        for u, enc in zip(units, encoded):
            mine = {}
            for k, e in enc.items():
                a = next(agreed)
                per_rank = jax.tree.map(lambda x: x[:, None] if u.layers else x[None], e)
                mine[k] = (per_rank, a, capacity.needed_rung(wire_of(per_rank, u.layers), a))
            out.append(mine)
        return out

    in_specs = tuple(zip(*(_in_specs(u) for u in units)))
    in_specs = (list(in_specs[0]), list(in_specs[1]))
    out = jax.shard_map(body, in_specs=in_specs, out_specs=list(_specs(units).values()),
                        check_vma=False)([u.shards for u in units], [u.caches for u in units])
    return {u.path: o for u, o in zip(units, out)}


@functools.lru_cache(maxsize=64)
def _program(graphdef):
    """The encode program of a model of ``graphdef`` (compiled once per graph)."""
    return jax.jit(lambda state: ahead_values(nnx.merge(graphdef, state)))


def encode_ahead(model: nnx.Module) -> dict:
    """Run the encode program on ``model``'s parameters and caches (dispatched, not waited
    for) and leave its results on the modules; returns them, ``{module path: ...}``."""
    graphdef, state = nnx.split(model)
    values = _program(graphdef)(state)
    by_path = _modules_by_path(model)
    for path, v in values.items():
        set_ahead(by_path[path], v)
    return values


def _modules_by_path(model: nnx.Module) -> dict:
    """``{module path: gathering module}`` under ``model``, paths as the results name them."""
    return {"/".join(map(str, p)): m for p, m in gathering_modules(model)}


def wire_of(encoded, layers: int | bool = 0):
    """The wire of one rank's ``Encoded`` (one layer's) in a per-rank stack: its rank axis
    dropped, and its layer axis before it when ``layers``."""
    lead = 2 if layers else 1
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype),
                       buckets.unwrap(encoded))
    return one.wire


def at_rungs(model: nnx.Module, rungs) -> dict:
    """Fix every compressed gather of ``model`` at ``rungs`` without running a step (a compile
    of the step's program for GPUs that are not there, ``ciera aot --step``): the encode
    program's results traced onto the modules (call it under ``jax.eval_shape`` or ``jit``,
    the mesh set) and each module's setup given its rungs. ``rungs``: ``{(module path, key):
    rung}``, or a function of ``{(module path, key): wire}`` returning one. Returns the
    rungs."""
    by_path = _modules_by_path(model)
    values = ahead_values(model)
    wires = {(path, k): wire_of(e, jnp.ndim(n)) for path, v in values.items()
             for k, (e, _, n) in v.items()}
    fixed = rungs(wires) if callable(rungs) else rungs
    for path, v in values.items():
        m = by_path[path]
        set_ahead(m, v)
        set_setup(m, dataclasses.replace(setup_of(m), rungs=tuple((k, int(fixed[(path, k)]))
                                                                  for k in v)))
    return fixed

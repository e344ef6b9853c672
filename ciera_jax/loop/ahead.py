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

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

import ciera_jax.collective.gather as collective
from ciera_jax.collective import capacity
from ciera_jax.fsdp import buckets, phases
from ciera_jax.fsdp.gather import cache_specs_of
from ciera_jax.fsdp.percall import call_inputs, checked_params
from ciera_jax.fsdp.state.ahead import rank_spec, set_ahead
from ciera_jax.fsdp.state.axes import REGION, placement
from ciera_jax.fsdp.state.discovery import gather_spec, module_name
from ciera_jax.fsdp.state.setup import gathering_modules, set_setup, setup_of
from ciera_jax.fsdp.state.stacking import stack_size


def _checked(path: tuple, m) -> str:
    """Where ``m`` gathers (REGION), or a one-line error for a module this path cannot run."""
    where = module_name(m)
    if stack_size(m):
        raise ValueError(f"{where}: ciera_jax.train_step gathers modules called one at a "
                         f"time; a layer stack runs in a step prepared by fsdp.prepare")
    place = placement(gather_spec(m).axis_name, where)
    if place != REGION:
        raise ValueError(f"{where}: ciera_jax.train_step runs under jit with the mesh set "
                         f"(jax.set_mesh) and the parameters placed on it")
    return place


def unit_specs(tensors: dict, caches: dict, axis_name: str) -> dict:
    """``{key: spec of its per-rank Encoded stack}`` in the order
    :func:`~ciera_jax.fsdp.encode_tensors` returns one module's keys: its compressed tensors
    outside buckets, then its buckets (each with its first member's spec)."""
    keys = [k for k in tensors if k in caches]
    bucket_of = buckets.groups(tensors, caches, axis_name, keys)
    members = {m for ms in bucket_of.values() for m in ms}
    out = {k: rank_spec(tensors[k].spec) for k in keys if k not in members}
    out.update({b: rank_spec(tensors[ms[0]].spec) for b, ms in bucket_of.items()})
    return out


def _units(model: nnx.Module) -> list:
    """``(module path, tensors, shards, caches, axis, impl)`` of every gathering module under
    ``model`` whose call compresses (``ciera`` mode, a cache), in model order."""
    units = []
    for path, m in gathering_modules(model):
        spec, setup = gather_spec(m), setup_of(m)
        if setup.mode != "ciera" or setup.held:
            continue
        place = _checked(path, m)
        t, s, c = call_inputs(m, checked_params(m, spec, place), spec, setup, place)
        if c:
            units.append(("/".join(map(str, path)), t, s, c, spec.axis_name, setup.impl))
    return units


def ahead_specs(model: nnx.Module) -> dict:
    """``{module path: {key: (Encoded spec, P(), P())}}``: how :func:`ahead_values` leaves
    its results on the mesh (the ``Encoded`` stacks split on their rank axis, the agreement
    and needed rung replicated), for abstract arguments placed as the program makes them."""
    return _specs(_units(model))


def _specs(units: list) -> dict:
    return {path: {k: (spec, P(), P()) for k, spec in unit_specs(t, c, ax).items()}
            for path, t, _, c, ax, _ in units}


def ahead_values(model: nnx.Module) -> dict:
    """``{module path: {key: (Encoded per rank, agreed, needed rung)}}`` of every gathering
    module under ``model`` whose call compresses (``ciera`` mode, a cache), traced under
    ``jit`` with the mesh set."""
    units = _units(model)
    if not units:
        return {}
    ax = units[0][4]
    if any(u[4] != ax for u in units):
        raise ValueError(f"ciera_jax.train_step: every gathering module gathers over one axis, "
                         f"got {sorted({u[4] for u in units})}")

    def body(shards, caches):
        encoded = [phases.encode_tensors(t, s, c, dict.fromkeys(c, True), ax, impl)
                   for (_, t, _, _, _, impl), s, c in zip(units, shards, caches)]
        agreed = iter(collective.agree([buckets.unwrap(e) for enc in encoded
                                        for e in enc.values()], ax))
        out = []
        for enc in encoded:
            mine = {}
            for k, e in enc.items():
                a = next(agreed)
                mine[k] = (jax.tree.map(lambda x: x[None], e), a,
                           capacity.needed_rung(buckets.unwrap(e).wire, a))
            out.append(mine)
        return out

    in_specs = ([{k: P(*t[k].spec) for k in t} for _, t, _, _, _, _ in units],
                [{k: cache_specs_of(c[k], t[k], ax) for k in c} for _, t, _, c, _, _ in units])
    out_specs = list(_specs(units).values())
    out = jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        [u[2] for u in units], [u[3] for u in units])
    return {u[0]: o for u, o in zip(units, out)}


@functools.lru_cache(maxsize=64)
def _program(graphdef):
    """The encode program of a model of ``graphdef`` (compiled once per graph)."""
    return jax.jit(lambda state: ahead_values(nnx.merge(graphdef, state)))


def encode_ahead(model: nnx.Module) -> dict:
    """Run the encode program on ``model``'s parameters and caches (dispatched, not waited
    for) and leave its results on the modules; returns them, ``{module path: ...}``."""
    graphdef, state = nnx.split(model)
    values = _program(graphdef)(state)
    by_path = {"/".join(map(str, p)): m for p, m in gathering_modules(model)}
    for path, v in values.items():
        set_ahead(by_path[path], v)
    return values


def wire_of(encoded):
    """The wire of one rank's ``Encoded`` in a per-rank stack (its leading axis dropped)."""
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                       buckets.unwrap(encoded))
    return one.wire


def at_rungs(model: nnx.Module, rungs) -> dict:
    """Fix every compressed gather of ``model`` at ``rungs`` without running a step (a compile
    of the step's program for GPUs that are not there, ``ciera aot --step``): the encode
    program's results traced onto the modules (call it under ``jax.eval_shape`` or ``jit``,
    the mesh set) and each module's setup given its rungs. ``rungs``: ``{(module path, key):
    rung}``, or a function of ``{(module path, key): wire}`` returning one. Returns the
    rungs."""
    by_path = {"/".join(map(str, p)): m for p, m in gathering_modules(model)}
    values = ahead_values(model)
    wires = {(path, k): wire_of(e) for path, v in values.items() for k, (e, _, _) in v.items()}
    fixed = rungs(wires) if callable(rungs) else rungs
    for path, v in values.items():
        m = by_path[path]
        set_ahead(m, v)
        set_setup(m, dataclasses.replace(setup_of(m), rungs=tuple((k, int(fixed[(path, k)]))
                                                                  for k in v)))
    return fixed

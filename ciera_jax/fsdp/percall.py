"""A gathering module's call on its own: gather the parameters it holds (encoding and agreeing
for this call alone in ``ciera`` mode), then run the call on a copy of the module that holds
the full weights. Differentiable through the gather (its backward is a ``psum_scatter``).

The module itself is never changed while the call runs: its copy holds the full weights,
its new caches and stats; afterwards the copy's state other than parameters (those new
caches and stats, and whatever sub-modules changed) is written into the module, once."""

from __future__ import annotations

import jax
from flax import nnx

import ciera_jax.collective.cache as cache_lib
from ciera_jax.collective import bitfields, capacity
from ciera_jax.fsdp.state.ahead import ahead_of
from ciera_jax.fsdp.state.axes import MANUAL, REGION, UNSHARDED, axis_size, placement
from ciera_jax.fsdp.state.caches import PLAIN_ATTR, GatherCacheVar, cache_attr
from ciera_jax.fsdp.state.discovery import GatherSpec, module_name, module_path, sharded_params
from ciera_jax.fsdp.gather import gather, gather_region
from ciera_jax.fsdp.state.inventory import GatheredTensor
from ciera_jax.fsdp.state.setup import GatherSetup
from ciera_jax.runtime.partition import check_divisible
from ciera_jax.fsdp.state.stacking import stack_size
from ciera_jax.fsdp.state.stats import record


def copy_of(module):
    """A copy of ``module`` with fresh Variables (same values): what a call runs on."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


def write_back(module, copy) -> None:
    """The copy's state other than parameters into ``module`` (one write per Variable)."""
    nnx.update(module, nnx.state(copy, nnx.Not(nnx.Param)))


def checked_params(module, spec: GatherSpec, place: str) -> list:
    """The parameters a call of ``module`` gathers; raises when there are none."""
    where = module_name(module)
    params = sharded_params(module, spec)
    if place != UNSHARDED and not params:
        raise ValueError(
            f"{where}: decorated with @gathered(axis_name={spec.axis_name!r}) but none of "
            f"its parameters is split over {spec.axis_name!r}, so nothing would be "
            f"gathered; annotate them (nnx.with_partitioning(init, ({spec.axis_name!r}, "
            f"None)), fsdp_axis= metadata or rules=) or remove the decorator")
    if place != UNSHARDED and stack_size(module):
        raise ValueError(f"{where}: a layer stack is run with fsdp.scan_layers, not called")
    return params


def call_tensor(module, p, spec: GatherSpec, place: str) -> GatheredTensor:
    """The tensor one call gathers for parameter ``p`` (its full shape: the shard's over
    the gather axis inside ``shard_map``, the global one under ``jit``)."""
    value = p.var.get_value()
    shape = list(value.shape)
    if place == REGION:
        check_divisible(f"{module_name(module)}/{p.key}", tuple(shape), p.axis,
                        axis_size(spec.axis_name), spec.axis_name)
    else:
        shape[p.axis] *= axis_size(spec.axis_name)
    prefix = module_path(module)
    return GatheredTensor(f"{prefix}/{p.key}" if prefix else p.key, p.axis, tuple(shape),
                          spec.dtype or value.dtype, spec=p.spec)


def call(module, fn, args, kwargs, spec: GatherSpec, setup: GatherSetup):
    """A gathering module's call: gather its sharded params, run ``fn`` on the full ones."""
    place = placement(spec.axis_name, module_name(module))
    params = checked_params(module, spec, place)
    copy = copy_of(module)
    if place == UNSHARDED:  # whole already: only cast
        nodes = dict(nnx.iter_graph(copy))
        for p in params:
            if spec.dtype is not None:
                nodes[p.path].set_value(p.var.get_value().astype(spec.dtype))
    else:
        gathered_into(copy, module, params, spec, setup, place)
    out = fn(copy, *args, **kwargs)
    write_back(module, copy)
    return out


def call_inputs(module, params: list, spec: GatherSpec, setup: GatherSetup, place: str):
    """``(tensors, shards, caches)`` of one call of ``module`` gathering ``params``: every
    tensor, its shard in the compute dtype, and the caches of those it compresses."""
    tensors, shards, caches = {}, {}, {}
    for p in params:
        t = tensors[p.key] = call_tensor(module, p, spec, place)
        shards[p.key] = p.var.get_value().astype(t.dtype)
        if compresses(p, t, setup):
            caches[p.key] = cache_of(p, t, f"{module_name(module)}/{p.key}")
    return tensors, shards, caches


def compresses(p, t, setup: GatherSetup) -> bool:
    """Does a call gather parameter ``p`` (as tensor ``t``) compressed: ``ciera`` mode, a
    compressible dtype, and not named plain on its owner?"""
    return (setup.mode == "ciera" and bitfields.is_compressible(t.dtype)
            and p.name not in getattr(p.owner, PLAIN_ATTR, ()))


def gathered_into(copy, module, params: list, spec: GatherSpec, setup: GatherSetup, place: str):
    """Gather ``module``'s ``params`` (:func:`~ciera_jax.fsdp.gather`, or its region under
    ``jit``); the full weights, new caches and stats go into ``copy``. With rungs fixed by the
    host (``setup.rungs``), from the inputs made ahead of the step, at those rungs."""
    tensors, shards, caches = call_inputs(module, params, spec, setup, place)
    if setup.rungs and setup.mode == "ciera":
        fulls, new_caches, stats = gather_region(tensors, shards, caches, setup,
                                                 spec.axis_name, fixed_inputs(module, setup,
                                                                              place))
    else:
        run = gather if place == MANUAL else gather_region
        fulls, new_caches, stats = run(tensors, shards, caches, setup, spec.axis_name)
    nodes = dict(nnx.iter_graph(copy))
    for p in params:
        nodes[p.path].set_value(fulls[p.key])
        if new_caches.get(p.key) is not None:
            getattr(nodes[p.path[:-1]], cache_attr(p.name)).set_value(new_caches[p.key])
    record(copy, stats)


def fixed_inputs(module, setup: GatherSetup, place: str) -> dict:
    """``{key: (Encoded per rank, FixedRung)}``: the module's inputs made ahead, each at the
    rung the host fixed (guaranteed: the host read that it holds the demand, so no fallback
    and no conditional is compiled)."""
    where = module_name(module)
    if place != REGION:
        raise ValueError(f"{where}: a step with rungs fixed on the host (ciera_jax.train_step) "
                         f"gathers under jit with the mesh set; inside your own shard_map, "
                         f"prepare the step with fsdp.prepare")
    ahead, rungs = ahead_of(module), dict(setup.rungs)
    if set(ahead) != set(rungs):
        raise ValueError(f"{where}: rungs fixed for {sorted(rungs)} but the inputs made ahead "
                         f"are for {sorted(ahead)}; run the step through ciera_jax.train_step")
    return {k: (e, capacity.fix(agreed, rungs[k], needed, guaranteed=True))
            for k, (e, agreed, needed) in ahead.items()}


def cache_of(p, t: GatheredTensor, name: str):
    """The cache beside parameter ``p``, checked against the tensor it serves."""
    var = getattr(p.owner, cache_attr(p.name), None)
    if not isinstance(var, GatherCacheVar):
        raise ValueError(f"{name}: gather 'ciera' needs a cache beside this parameter and it "
                         f"has none: call ciera_jax.fsdp.attach_caches(model, mode='word') (or "
                         f"mode='exponent', or mode='auto' within a memory budget) once after "
                         f"building the model (or gather with fsdp.gather_mode(model, "
                         f"'plain'))")
    cache = var.get_value()
    shape = getattr(cache, "shape", None)
    if cache_lib.is_cache(cache) and shape is not None and tuple(shape) != t.shape:
        raise ValueError(f"{name}: its cache is for shape {tuple(shape)} but the gather is "
                         f"{t.shape}; layers stacked with nnx.vmap are recognised when built "
                         f"from Flax layers (Linear, Einsum, Embed, Conv, norms); otherwise "
                         f"call fsdp.attach_caches inside the function that builds one layer, "
                         f"or build the stack with fsdp.stack")
    return cache

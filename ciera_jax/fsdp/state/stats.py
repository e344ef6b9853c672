"""Gather stats as module state: each gathering module holds ``{parameter path: stats}`` in a
:class:`GatherStats` variable (``sow``-style), so they leave ``nnx.remat``, ``nnx.scan``,
``nnx.vmap`` and ``jit`` as values like any other state, and a recomputation in the backward
pass does not count again. The variable is created with the caches (zeros), never on a call,
so a step's module graph is the same on every call and ``nnx.jit`` traces it once.

A parameter's stats are held packed (:func:`pack`): one int32 vector and ``changed``, not one
scalar per stat. A layer loop stacks each of its outputs with a kernel of its own on a GPU, so
seven scalars per tensor per layer would cost seven kernels; the loop stacks one vector for all
of a layer's tensors. ``changed`` stays a
leaf of its own: it is a ``psum``'s result, which XLA:GPU moves out of the layer loop (one
all-reduce of the stacked counts after it) only while it goes straight into the loop's output;
packed with the rest, the loop is peeled instead (hundreds of kernels more). :func:`gather_stats` hands
them out by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from ciera_jax.fsdp.state.discovery import module_name, path_key

STATS_ATTR = "ciera_gather_stats"
STAT_KEYS = ("sent_bytes", "plain_bytes", "changed", "rung", "fallback", "verify_failed",
             "elements")
VECTOR_KEYS = tuple(s for s in STAT_KEYS if s != "changed")  # the packed vector's columns


class GatherStats(nnx.Variable):
    """Stats of the last gather of each parameter of one gathering module: rank-invariant
    int32 scalars (per layer under a scan) ``sent_bytes`` and ``plain_bytes`` (what one rank
    of the gather axis sends, summed over the other mesh axes the parameter stays split on),
    ``changed`` (exponents changed, whole tensor), ``rung`` (-1: plain), ``fallback``,
    ``verify_failed`` (shards whose self-check failed, summed over ranks; per rank inside a
    prepared train step, whose norm psum sums them), ``elements``. All zero before the first
    gather."""


def pack(stats: dict) -> dict:
    """``{stat: int32 (...)}`` (every one of :data:`STAT_KEYS`) -> ``{"vector": int32 (...,
    len(VECTOR_KEYS)), "changed": int32 (...)}``."""
    missing = [s for s in STAT_KEYS if s not in stats]
    if missing:
        raise ValueError(f"gather stats lack {missing}; they hold {sorted(stats)}")
    return {"vector": columns(stats, VECTOR_KEYS),
            "changed": jnp.asarray(stats["changed"]).astype(jnp.int32)}


def columns(stats: dict, names) -> jax.Array:
    """int32 ``(..., len(names))``: the named stats side by side."""
    return jnp.stack([jnp.asarray(stats[s]).astype(jnp.int32) for s in names], axis=-1)


def from_columns(array, names) -> dict:
    """:func:`columns`' inverse: ``{name: array[..., i]}``, host or traced values."""
    if array.shape[-1] != len(names):
        raise ValueError(f"packed stats have {array.shape[-1]} columns, not {len(names)}")
    return {s: array[..., i] for i, s in enumerate(names)}


def layer_stats(stats: dict) -> tuple:
    """One layer's ``{key: stats}`` as the layer loop stacks them: every key's packed vector
    in ONE array (one output of the loop, one kernel a layer on a GPU, not one a key) and each
    key's ``changed`` (a psum's result: XLA moves the psum out of the loop only while it goes
    straight into an output of its own, as the module docstring says)."""
    packed = {k: pack(st) for k, st in sorted(stats.items())}
    return (jnp.stack([p["vector"] for p in packed.values()], axis=-2) if packed else None,
            {k: p["changed"] for k, p in packed.items()})


def stats_by_key(stacked: tuple) -> dict:
    """:func:`layer_stats`' inverse (stacked over layers or not): ``{key: packed stats}``
    (the vectors' rows are the keys in sorted order)."""
    vectors, changed = stacked
    return {k: {"vector": vectors[..., i, :], "changed": changed[k]}
            for i, k in enumerate(sorted(changed))}


def unpack(packed: dict) -> dict:
    """:func:`pack`'s inverse, host or traced values."""
    return {**from_columns(packed["vector"], VECTOR_KEYS), "changed": packed["changed"]}


def is_packed(stats) -> bool:
    return isinstance(stats, dict) and set(stats) == {"vector", "changed"}


def empty_stats(keys, layers: int = 0) -> dict:
    """Zeros for every stat of every key, packed (``layers`` deep when nonzero)."""
    shape = (layers,) if layers else ()
    return {k: {"vector": jnp.zeros(shape + (len(VECTOR_KEYS),), jnp.int32),
                "changed": jnp.zeros(shape, jnp.int32)} for k in keys}


def ensure_stats(module, keys, layers: int = 0, place=None) -> None:
    """Create ``module``'s :class:`GatherStats` (zeros) for ``keys`` if it lacks any of them.
    ``place``: puts a new value where it belongs (e.g. replicated on the mesh)."""
    var = getattr(module, STATS_ATTR, None)
    have = dict(var.get_value()) if isinstance(var, GatherStats) else {}
    missing = [k for k in keys if k not in have]
    if not missing:
        return
    new = empty_stats(missing, layers)
    if place is not None:
        new = place(new)
    have.update(new)
    if isinstance(var, GatherStats):
        var.set_value(have)
    else:
        setattr(module, STATS_ATTR, GatherStats(have))


def record(module, stats: dict) -> None:
    """Leave ``{key below module: stats}`` on ``module`` (replacing the last call's); each
    key's stats a dict by name or :func:`pack`'s. The variable exists from
    ``attach_caches`` / ``shard`` on; creating it here, on a call, would change the module's
    graph (``nnx.jit`` would trace the step again)."""
    stats = {k: jax.tree.map(lambda a: lax.stop_gradient(a).astype(jnp.int32),
                             st if is_packed(st) else pack(st))
             for k, st in stats.items()}
    var = getattr(module, STATS_ATTR, None)
    if isinstance(var, GatherStats):
        old = var.get_value()
        if set(old) >= set(stats) and all(
                jnp.shape(old[k]["changed"]) == jnp.shape(st["changed"])
                for k, st in stats.items()):
            var.set_value({**old, **stats})
            return
        raise ValueError(
            f"{module_name(module)}: its gather stats were made for {sorted(old)} "
            f"but the call gathers {sorted(stats)}; call fsdp.attach_caches(model) after "
            f"fsdp.shard(...) and after building every layer")
    setattr(module, STATS_ATTR, GatherStats(stats))


def gather_stats(tree) -> dict:
    """``{parameter path: {stat: value}}`` from a module or a state holding
    :class:`GatherStats`."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, GatherStats)
    out = {}
    pairs = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda v: isinstance(v, GatherStats))[0]
    for path, var in pairs:
        if not isinstance(var, GatherStats):
            continue
        prefix = path_key(path).rpartition("/")[0]  # the module holding the variable
        for k, st in var.get_value().items():
            out[f"{prefix}/{k}" if prefix else k] = unpack(st)
    return out


def wire_ratio(stats: dict):
    """Bytes sent over the bytes a plain gather sends, over every tensor (and every layer of
    stacked ones) of ``stats`` (:func:`gather_stats`, host or traced values). Before any
    gather (all zero) it is 1."""
    sent, plain = jnp.float32(0), jnp.float32(0)
    for s in stats.values():
        sent = sent + jnp.sum(jnp.asarray(s["sent_bytes"], jnp.float32))
        plain = plain + jnp.sum(jnp.asarray(s["plain_bytes"], jnp.float32))
    ratio = jnp.where(plain > 0, sent / jnp.maximum(plain, 1), 1.0)
    return ratio if isinstance(ratio, jax.core.Tracer) else float(ratio)

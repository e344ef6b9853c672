"""Gather stats as module state: each decorated call leaves ``{parameter path: stats}`` in a
:class:`GatherStats` variable on its module (``sow``-style), so they leave ``nnx.remat``,
``nnx.scan``, ``nnx.vmap`` and ``jit`` as values like any other state, and a recomputation in
the backward pass does not count again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from ciera_jax.fsdp.discovery import path_key

STATS_ATTR = "ciera_gather_stats"
STAT_KEYS = ("sent_bytes", "plain_bytes", "changed", "tier", "fallback", "verify_failed",
             "elements")


class GatherStats(nnx.Variable):
    """Stats of the last gather of each parameter of one decorated module: rank-invariant int32
    scalars (per layer under a scan) ``sent_bytes`` and ``plain_bytes`` (what one rank sends),
    ``changed`` (exponents changed, whole tensor), ``tier`` (-1: plain), ``fallback``,
    ``verify_failed`` (shards whose self-check failed, summed over ranks; per rank inside a
    prepared train step, whose norm psum sums them), ``elements``."""


def record(module, stats: dict) -> None:
    """Leave ``{key below module: stats}`` on ``module`` (replacing the last call's)."""
    stats = {k: {s: lax.stop_gradient(jnp.asarray(v)) for s, v in st.items()}
             for k, st in stats.items()}
    var = getattr(module, STATS_ATTR, None)
    if isinstance(var, GatherStats):
        var.set_value(stats)
    else:
        setattr(module, STATS_ATTR, GatherStats(stats))


def gather_stats(tree) -> dict:
    """``{parameter path: stats}`` from a module or a state holding :class:`GatherStats`."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, GatherStats)
    out = {}
    pairs = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda v: isinstance(v, GatherStats))[0]
    for path, var in pairs:
        if not isinstance(var, GatherStats):
            continue
        prefix = path_key(path)[:-len(STATS_ATTR)].rstrip("/")
        for k, st in var.get_value().items():
            out[f"{prefix}/{k}" if prefix else k] = st
    return out

"""What to do when a gather's self-check fails: forget the caches that failed, redo the step.

A failed check means some rank rebuilt a shard that differs from what its owner holds (a
corrupted cache, a corrupted payload). The step that saw it must not be applied anywhere, and
the failed tensors' caches must be reset on *every* rank, so that the redo's gathers prime them
with plain gathers, bitwise exactly. The redo is then the step a fault-free run took.

The recipe inside ``shard_map`` (``ciera train`` does this, with the failure count riding on
the global-norm ``psum`` it does anyway; see ``ciera_jax.fsdp.clip_by_global_norm``):

    full, new_cache, st = ciera_jax.all_gather(x, cache, "fsdp")
    ...
    failed = lax.psum(st["verify_failed"], "fsdp")        # or fold into a psum you already do
    params = keep_if_failed(failed, params, new_params)    # no rank applies a failed step
    cache = reset_failed(new_cache, failed)                # every rank forgets that tensor
    # then run the same batch again
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ciera_jax.collective.cache import is_cache


def reset_failed(cache, failed):
    """``cache`` unprimed where ``failed > 0`` (per layer for stacked caches: ``failed`` is
    shaped like ``cache.primed``); its next gather primes it."""
    if not is_cache(cache):
        raise TypeError(f"reset_failed needs a CIERA cache, got {type(cache).__name__}")
    primed = jnp.where(jnp.asarray(failed) > 0, False, cache.primed)
    return dataclasses.replace(cache, primed=primed)


def keep_if_failed(failed, old, new):
    """``old`` where any shard failed (``failed``: a rank-invariant count), else ``new``."""
    bad = jnp.asarray(failed).sum() > 0
    return jax.tree.map(lambda o, n: jnp.where(bad, o, n), old, new)

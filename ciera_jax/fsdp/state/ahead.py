"""A gathering module's gather inputs made ahead of its step, as module state.

For each compressed tensor (or bucket) the module gathers: its ``Encoded`` (one per rank,
stacked on a leading axis split over the mesh axes the parameter is split on, so the inputs
cross ``jit`` and a ``shard_map``'s in_specs as ordinary global arrays), the agreed demand
(rank-invariant) and the rung that demand needs. The encode program that runs after a step
(:func:`ciera_jax.train_step`) writes them; a call whose setup fixes rungs
(:attr:`~ciera_jax.fsdp.state.setup.GatherSetup.rungs`) gathers from them. Derived state, like
the caches: made from the parameters and caches, never checkpointed; an optimizer over
``nnx.Param`` leaves it alone."""

from __future__ import annotations

from flax import nnx
from jax.sharding import PartitionSpec as P

from ciera_jax.runtime.partition import names_of

AHEAD_ATTR = "ciera_ahead"  # on a gathering module: its AheadInputs


class AheadInputs(nnx.Variable):
    """``{key: (Encoded per rank, agreed demand, needed rung)}`` of one gathering module."""


def ahead_of(module) -> dict:
    """The module's inputs made ahead (``{}``: none)."""
    var = getattr(module, AHEAD_ATTR, None)
    return var.get_value() if isinstance(var, AheadInputs) else {}


def set_ahead(module, value: dict) -> None:
    """Hold ``value`` as the module's inputs made ahead (a new Variable the first time)."""
    var = getattr(module, AHEAD_ATTR, None)
    if isinstance(var, AheadInputs):
        var.set_value(value)
    else:
        setattr(module, AHEAD_ATTR, AheadInputs(value))


def rank_spec(spec: tuple, layers: bool = False) -> P:
    """The spec of a per-rank stack of a parameter's encoded shards: its rank axis split over
    every mesh axis the parameter's (one layer's) ``spec`` names, in order; after a whole
    layer axis when ``layers``."""
    names = tuple(n for entry in spec for n in names_of(entry))
    rank = names if len(names) > 1 else names[0] if names else None
    return P(None, rank) if layers else P(rank)

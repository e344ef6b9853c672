"""Rungs fixed when a step is compiled: the escape section's size as a static number.

The agreement of a train step's gathers can run at the end of the previous step (its encode
does), so the host knows every tensor's demand before the step starts and can pick each
tensor's rung then. :class:`FixedRung` carries the agreed demand (a traced, rank-invariant
value) with that rung (static: part of the pytree's structure, so ``jit`` compiles one program
per rung vector). Its exchange sends the section at the fixed size inside the main transfer:
no ``lax.switch``, and no collective in a conditional except the fallback's, which runs only
when the demand is above the fixed rung (or the cache unprimed). ``rung=PLAIN_RUNG`` compiles
a plain gather of the bits (a priming step) and no codec at all.

``guaranteed=True``: the host promises that the rung holds every layer's agreed demand (it
picked a program whose rungs do, :class:`~ciera_jax.loop.rungs.RungPolicy` with
``holds``), so the exchange compiles no fallback and no conditional at all: a straight line,
what a GPU wants (a conditional there is a host sync). A broken promise drops escapes; the
self-check then fails and the step is redone with the caches re-primed, so even that stays
exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ciera_jax.codec.wire import PLAIN_RUNG, WordWire
from ciera_jax.codec.word_ladder import ESCAPES, RAW

__all__ = ["FixedRung", "PLAIN_RUNG", "exceeded", "exit_index", "fix", "is_fixed",
           "is_guaranteed", "needed_rung", "overflows"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FixedRung:
    """An agreed demand (``demand``: int32, the agreement's output, per layer for stacks) and
    the rung its gather is compiled at (``rung``: static; :data:`PLAIN_RUNG` for a plain
    gather). ``needed``: the rung the demand needs (:func:`needed_rung`, per layer like it),
    when the step that agreed on it computed that already (a train step's ``ahead``): then the
    gather compares it with ``rung`` instead of pricing the demand against the ladder again,
    a chain of compares per gather that XLA:GPU compiles as kernels of their own. Layer slices
    keep the rung."""

    demand: jax.Array
    rung: int = dataclasses.field(metadata=dict(static=True))
    needed: jax.Array | None = None
    exits: int = dataclasses.field(default=0, metadata=dict(static=True))
    guaranteed: bool = dataclasses.field(default=False, metadata=dict(static=True))


def fix(agreed, rung: int, needed=None, exits: int = 0, guaranteed: bool = False) -> FixedRung:
    """``exits``: word mode's overflow rungs compiled (``wire.overflow_rungs``): a demand up
    to that many rungs above ``rung`` still sends words, in the fallback's conditional.
    ``guaranteed``: the host knows the rung holds the demand: no fallback is compiled (and no
    overflow rung: ``exits`` is then ignored)."""
    guaranteed = bool(guaranteed)
    return FixedRung(agreed, int(rung), needed, 0 if guaranteed else int(exits), guaranteed)


def is_guaranteed(agreed) -> bool:
    """A fixed rung the host promised holds the demand (no fallback compiled)."""
    return isinstance(agreed, FixedRung) and agreed.guaranteed


def is_fixed(agreed) -> bool:
    return isinstance(agreed, FixedRung)


def exceeded(caps: tuple[int, ...], demand: jax.Array) -> jax.Array:
    """int32: how many capacities ``demand`` exceeds (``len(caps)``: above the top); the index
    of the smallest capacity that holds it."""
    return jnp.sum(demand[..., None] > jnp.asarray(caps, jnp.int32), axis=-1, dtype=jnp.int32)


def needed_rung(wire, demand: jax.Array) -> jax.Array:
    """int32 (per layer for stacks): the smallest rung of ``wire`` that holds the agreed
    ``demand``, or ``wire.rungs`` above the top (or for an unprimed cache). ``demand``: an
    exponent tensor's count, or a word tensor's (escapes, raw words, exponents) vector."""
    if isinstance(wire, WordWire):
        return jnp.maximum(exceeded(wire.caps1, demand[..., ESCAPES]),
                           exceeded(wire.caps2, demand[..., RAW]))
    return exceeded(wire.caps, demand)


def overflows(wire, fixed: FixedRung) -> jax.Array:
    """bool, rank-invariant: the agreed demand does not fit the fixed rung (the fallback)."""
    return _needed(wire, fixed) > fixed.rung


def exit_index(wire, fixed: FixedRung) -> jax.Array:
    """int32, rank-invariant: which way the gather at a fixed rung ends. 0: the rung holds the
    demand; ``i`` in 1..K: the demand needs ``wire.overflow_rungs(rung, exits)[i - 1]``;
    K + 1: the plain fallback (further above, or an unprimed cache)."""
    k = len(wire.overflow_rungs(fixed.rung, fixed.exits))
    over = _needed(wire, fixed) - fixed.rung
    return jnp.where(over <= 0, 0, jnp.minimum(over, k + 1)).astype(jnp.int32)


def _needed(wire, fixed: FixedRung) -> jax.Array:
    if not 0 <= fixed.rung < wire.rungs:
        raise ValueError(f"a fixed rung must be in 0..{wire.rungs - 1} for this tensor's "
                         f"{wire.rungs} capacities (or PLAIN_RUNG), got {fixed.rung}")
    return needed_rung(wire, fixed.demand) if fixed.needed is None else fixed.needed

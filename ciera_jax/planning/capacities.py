"""Which rungs a train step is compiled at: a host-side policy over the demands it already knows.

A step compiled with fixed rungs (:mod:`ciera_jax.collective.capacity`) sends each tensor's
escape section at a static size inside its main transfer. The host knows the next step's
demand exactly (the end of this step encoded and agreed on it), so it could fix the cheapest
rungs every step, but every new rung vector is a new program to compile. :class:`RungPolicy`
trades the two: it keeps the programs it has compiled, runs each step on the cheapest of them
for that step's demand (a tensor whose demand is above its fixed rung takes the fallback: a
plain gather, exact, at plain's bytes), and compiles a new one only when what the ones it has
sent above each step's ideal program adds up to ``patience`` steps of plain's bytes, up to
``max_programs``. A new program fits the last ``window`` steps' demands, not just this one's,
so the demand's drift (warm-up, peak, decay) needs few of them.

Pure Python over :mod:`ciera_jax.codec.wire`: the trainer feeds it the needed rungs the step
returned, and prices with the wire table.
"""

from __future__ import annotations

import collections
import dataclasses

import math

import numpy as np

from ciera_jax.codec.wire import PLAIN_RUNG, WordWire, rung_for

# Steady-state demands, as shares of a shard's elements, for a program compiled before any
# step ran (``ciera aot``): word mode's escapes at 3 bits (8-15% on small/tiny, the word-delta
# study) and exponent mode's changed exponents (0.1-0.2% after warm-up, the stability study).
STEADY_ESCAPES = 1 / 8
STEADY_EXPONENTS = 1 / 512

Rungs = tuple  # ((key, rung), ...) in key order: hashable, one per compiled program


@dataclasses.dataclass
class RungPolicy:
    """``wires``: ``{key: ExponentWire | WordWire}`` of one layer of each compressed tensor or
    bucket (:func:`ciera_jax.fsdp.wires`). Deterministic: every process of a multi-host run
    feeds it the same (agreed) demands and so compiles and runs the same programs.

    A new program is compiled when the bytes the compiled ones sent above each step's ideal,
    summed since the last new one, pass ``patience`` steps of plain's bytes (a rent-or-buy
    rule: a short spike does not buy a program, a lasting drift does); it is the rung vector
    that would have sent the fewest bytes over the last ``window`` steps."""

    wires: dict
    max_programs: int = 8
    patience: float = 1.0
    window: int = 4
    programs: list = dataclasses.field(default_factory=list)
    _history: collections.deque = dataclasses.field(init=False, repr=False)
    _regret: float = dataclasses.field(default=0.0, init=False, repr=False)

    def __post_init__(self):
        if self.max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {self.max_programs}")
        if not self.patience >= 0:
            raise ValueError(f"patience must be >= 0, got {self.patience}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        self._history = collections.deque(maxlen=self.window)

    def choose(self, needed: dict, steps_left: int | None = None) -> tuple[dict, bool]:
        """``needed``: ``{key: needed rung}`` (an int, or an array per layer for stacks;
        ``wire.rungs``: above the top or unprimed); ``steps_left``: the steps the run has left,
        this one included, when known (a new program must save ``patience`` plain steps'
        worth of bytes over them at this step's rate, or it is not bought). Returns
        (``{key: rung}`` to run the step at, whether that is a program not compiled before)."""
        needed = {k: np.atleast_1d(np.asarray(needed[k])) for k in sorted(self.wires)}
        ideal = self._best_for([needed])
        if any(r != PLAIN_RUNG for r in ideal.values()):  # a priming step tells nothing
            self._history.append(needed)
        if not self.programs:
            return self._compile(ideal)
        best = dict(min(self.programs, key=lambda v: self.cost(dict(v), needed)))
        self._regret += self.cost(best, needed) - self.cost(ideal, needed)
        if (self._regret <= self.patience * self.plain_cost(needed)
                or len(self.programs) >= self.max_programs):
            return best, False
        new = self._best_for(list(self._history))
        if program_key(new) in self.programs or self.cost(new, needed) >= self.cost(best, needed):
            new = ideal  # the window's program does not help this step: this step's does
        saving = self.cost(best, needed) - self.cost(new, needed)
        if steps_left is not None and saving * steps_left < self.patience * self.plain_cost(
                needed):
            return best, False  # too late in the run to pay for itself
        return self._compile(new)

    def _compile(self, rungs: dict) -> tuple[dict, bool]:
        self.programs.append(program_key(rungs))
        self._regret = 0.0
        return rungs, True

    def cost(self, rungs: dict, needed: dict) -> int:
        """Bytes one rank sends for every layer of every tensor at ``rungs``."""
        return sum(self._bytes(k, rungs[k], needed[k]) for k in needed)

    def plain_cost(self, needed: dict) -> int:
        return sum(self.wires[k].plain_bytes * np.size(needed[k]) for k in needed)

    def _bytes(self, key, rung: int, need) -> int:
        wire = self.wires[key]
        return sum(wire.bytes_at(rung, int(n)) for n in np.ravel(need))

    def _best_for(self, steps: list) -> dict:
        """Per key, the rung (or PLAIN_RUNG) that sends the fewest bytes over ``steps``."""
        out = {}
        for key, wire in self.wires.items():
            options = (PLAIN_RUNG, *range(wire.rungs))
            out[key] = min(options, key=lambda r: (sum(self._bytes(key, r, s[key])
                                                       for s in steps), r))
        return out


def rungs_holding(wires: dict, escapes: float = STEADY_ESCAPES,
                  exponents: float = STEADY_EXPONENTS) -> dict:
    """``{key: rung}``: the smallest rung of each wire that holds the given share of its
    elements (word mode: escapes, with raw words at the level-2 share; exponent mode: changed
    exponents); the top rung where none does."""
    out = {}
    for key, wire in wires.items():
        if isinstance(wire, WordWire):
            rung = rung_for(wire.caps1, math.ceil(wire.n * escapes))
        else:
            rung = rung_for(wire.caps, math.ceil(wire.n * exponents))
        out[key] = wire.rungs - 1 if rung is None else rung
    return out


def program_key(rungs: dict) -> Rungs:
    """A rung vector as one hashable key (what names a compiled program)."""
    return tuple(sorted(rungs.items()))

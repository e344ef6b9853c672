"""Which compiled program a step runs: every compressed tensor's rung, picked on the host from
the demands the encode program agreed on (read before the step), so the step holds no
conditional. Pure Python over :mod:`ciera_jax.codec.wire` (through ``collective``).

A program holds a step when each tensor's rung is at or above the rung its demand needs, or
plain (:data:`PLAIN_RUNG`: a plain gather of the bits, which also primes the cache). Every
new rung vector is a compile, so a step runs the cheapest compiled program that holds it
while that one sends at most ``slack`` more bytes than the step's own rungs would; otherwise
the step's own rungs are compiled, up to ``max_programs``, and past that the all-plain
program (which holds any demand) runs what no compiled one holds. Deterministic: every
process of a multi-host run reads the same agreed demands and picks the same programs."""

from __future__ import annotations

import dataclasses

from ciera_jax.collective import PLAIN_RUNG


def target(needed: dict, wires: dict) -> dict:
    """``{unit: rung}`` holding each unit's ``needed`` rung exactly (plain above the top, or
    for an unprimed cache)."""
    return {u: n if n < wires[u].rungs else PLAIN_RUNG for u, n in needed.items()}


def holds(program: dict, want: dict) -> bool:
    """Does ``program`` hold every unit of ``want`` (:func:`target`)?"""
    return all(program[u] == PLAIN_RUNG or (r != PLAIN_RUNG and program[u] >= r)
               for u, r in want.items())


def sent_bytes(program: dict, wires: dict) -> int:
    """Bytes one rank sends over every unit with a ``program`` that holds the step."""
    return sum(wires[u].bytes_at(rung, 0) for u, rung in program.items())


@dataclasses.dataclass
class RungChoice:
    """The programs compiled so far and the rule that picks each step's (module docstring)."""

    max_programs: int = 8
    slack: float = 0.25
    programs: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.max_programs < 1 or self.slack < 0:
            raise ValueError(f"max_programs must be >= 1 and slack >= 0, got "
                             f"{self.max_programs} and {self.slack}")

    def choose(self, needed: dict, wires: dict) -> dict:
        """``{unit: rung}`` for a step whose demands need ``needed`` (``{unit: rung}``; a
        unit is any hashable naming one compressed tensor or bucket), ``wires``: each unit's
        wire (``ExponentWire`` / ``WordWire`` of one shard)."""
        want = target(needed, wires)
        ideal = sent_bytes(want, wires)
        held = [p for p in self.programs if set(p) == set(want) and holds(p, want)]
        best = min(held, key=lambda p: sent_bytes(p, wires), default=None)
        full = len(self.programs) >= self.max_programs
        if best is not None and (full or sent_bytes(best, wires) <= (1 + self.slack)
                                 * ideal):
            return best
        pick = want if not full else {u: PLAIN_RUNG for u in want}
        if pick not in self.programs:
            self.programs.append(pick)
        return pick

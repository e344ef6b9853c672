"""Walking a jaxpr's equations, nested bodies included: what the structure tests count."""

from __future__ import annotations

from jax.extend import core as jcore


def subjaxprs(eqn) -> list:
    """The sub-jaxprs of ``eqn`` (a cond's branches, a loop's body, a pjit's jaxpr, ...)."""
    out = []
    for v in eqn.params.values():
        for j in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(j, jcore.ClosedJaxpr):
                j = j.jaxpr
            if isinstance(j, jcore.Jaxpr):
                out.append(j)
    return out


def walk(jaxpr):
    """Every equation, nested bodies included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in subjaxprs(eqn):
            yield from walk(sub)


def outside(jaxpr, primitive: str):
    """Every equation not inside a body of a ``primitive`` equation (``"cond"``: not in any
    branch; ``"while"``: not in any loop); other nesting is followed."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name != primitive:
            for sub in subjaxprs(eqn):
                yield from outside(sub, primitive)

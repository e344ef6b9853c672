"""Which tensor is split on which mesh axis: rule tables (regex -> split axis, EasyLM style),
PartitionSpecs of one split axis, what a parameter's own spec keeps after the gather (its other
mesh axes), and the divisibility check. Pure Python below every user of it: the memory model,
calibration and :mod:`ciera_jax.fsdp` read it. The library ships no table naming a model's
weights: a model passes its own to :func:`~ciera_jax.fsdp.gathered` (``ciera_models/model/sharding.py``
is ours)."""

from __future__ import annotations

import re

from jax.sharding import PartitionSpec as P


AXIS = "fsdp"  # the gather axis a mesh names unless told otherwise

Rules = tuple[tuple[str, "int | None"], ...]

_LETTERS = re.compile(r"_([A-Za-z0-9]+(?:x[A-Za-z0-9]+)+)$")


def d_axis(name: str) -> int | None:
    """The shape-letter convention (``w_gate_ExDxF``): split the first ``D`` (model width) axis
    of a name that carries two or more shape letters; None for anything else. A convention,
    not a table: the memory model prices the library's shape inventory with it."""
    m = _LETTERS.search(name)
    if not m:
        return None
    letters = m.group(1).split("x")
    return letters.index("D") if "D" in letters else None


def rule_axis(name: str, rules: Rules | None = None) -> int | None:
    """The split axis of weight ``name`` by the first rule whose regex fully matches it (None:
    replicated, also when no rule matches). ``rules=None``: the :func:`d_axis` convention."""
    if rules is None:
        return d_axis(name)
    for pattern, axis in rules:
        if re.fullmatch(pattern, name):
            return axis
    return None


def rule_matches(name: str, rules: Rules) -> tuple[bool, int | None]:
    """(some rule matched, its axis): a matched None says "replicated", unlike no match."""
    for pattern, axis in rules:
        if re.fullmatch(pattern, name):
            return True, axis
    return False, None


def spec_for(axis: int | None, ndim: int, axis_name: str = AXIS) -> P:
    """``P(None, .., axis_name, .., None)``: ``ndim`` dims, ``axis`` split (None: ``P()``)."""
    if axis is None:
        return P()
    return P(*([None] * axis + [axis_name] + [None] * (ndim - axis - 1)))


def check_divisible(name: str, shape: tuple[int, ...], axis: int | None, n: int,
                    axis_name: str = AXIS) -> None:
    if axis is not None and shape[axis] % n:
        raise ValueError(
            f"mesh size {axis_name}={n} does not divide dimension {axis} (size {shape[axis]}) of "
            f"weight {name} {tuple(shape)}; choose a device count that divides it")


def names_of(entry) -> tuple:
    """The mesh axes one PartitionSpec entry names (None: none)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def without_axis(spec: tuple, axis_name: str = AXIS) -> tuple:
    """``spec`` (one entry per dimension) with ``axis_name`` taken out: what stays sharded
    after a gather over it (tensor-, expert-parallel axes)."""
    out = []
    for e in spec:
        rest = tuple(a for a in names_of(e) if a != axis_name)
        out.append(None if not rest else rest[0] if len(rest) == 1 else rest)
    return tuple(out)


def kept_axes(spec: tuple, axis_name: str = AXIS) -> tuple[str, ...]:
    """The mesh axes other than ``axis_name`` that ``spec`` shards over, in order."""
    return tuple(a for e in spec for a in names_of(e) if a != axis_name)

"""Reading a compiled program's HLO text: its computations, and which run inside branches.

Used to check where the collectives of a compiled step landed (a transfer inside a conditional
branch runs serialized with the compute around it on a GPU): ``benchmarks/compile_time.py``
counts them, the tests assert on them.
"""

from __future__ import annotations

import re

_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")


def computations(hlo: str) -> dict[str, str]:
    """``{name: body text}`` of every computation in an HLO module's text."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, body = m.group(1), []
        elif line == "}" and name:
            comps[name], name = "\n".join(body), None
        elif name:
            body.append(line)
    return comps


def inside_branches(comps: dict[str, str]) -> set[str]:
    """Names of the computations that run only inside a conditional's branch (transitively:
    fusions and loops called from a branch too)."""
    todo = []
    for text in comps.values():
        for m in re.finditer(r"branch_computations=\{([^}]*)\}", text):
            todo += [b.strip().lstrip("%") for b in m.group(1).split(",")]
        todo += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", text)
    seen = set()
    while todo:
        c = todo.pop()
        if c in comps and c not in seen:
            seen.add(c)
            todo += _CALLS.findall(comps[c])
    return seen


def all_gathers(text: str) -> list[tuple[str, list[int]]]:
    """``(element type, dims)`` of every all-gather result in some HLO text."""
    return [(m.group(1), [int(d) for d in m.group(2).split(",") if d])
            for m in re.finditer(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", text)]

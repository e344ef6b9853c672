"""The step's two in-order streams (compute, communication): a step's groups of work
(:class:`Group`, built by :mod:`ciera_jax.sim.step`) replayed with their dependencies, prefetch
depth one, and the overlap-aware choice of which groups stay compressed."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    fwd_s: float
    bwd_s: float
    gather_s: float  # the forward all-gather of the group (link time)
    regather_s: float  # the backward re-gather (0 when every tensor holds its weights)
    codec_s: float  # decode (+ encode) of the forward gather, on the compute stream
    recodec_s: float  # the same for the backward re-gather
    rs_s: float  # plain bf16 reduce-scatter of the group's gradients
    wire_bytes: float  # forward gather
    rewire_bytes: float  # backward re-gather
    plain_bytes: float
    n_compressed: int = 0
    extra_memory: int = 0  # cache / held-weight bytes per GPU
    modes: tuple = ()  # (TensorSpec, mode) of each gathered tensor



def schedule(groups: list[Group], agreement_s: float = 0.0) -> tuple[float, float, float]:
    """Two in-order streams with dependencies; returns (step end, compute busy, comm busy)."""
    ops: dict[str, tuple[str, float, list[tuple[str, str]]]] = {}  # id -> (stream, dur, deps)
    order = {"compute": [], "comm": []}

    def add(op, stream, dur, deps):
        ops[op] = (stream, dur, deps)
        order[stream].append(op)

    add("agree", "comm", agreement_s, [])
    names = [g.name for g in groups]
    G = {g.name: g for g in groups}
    for i, n in enumerate(names):  # forward
        add(f"AGf:{n}", "comm", G[n].gather_s,
            [("agree", "end")] + ([(f"Cf:{names[i - 1]}", "start")] if i else []))
    for n in names:
        add(f"Df:{n}", "compute", G[n].codec_s, [(f"AGf:{n}", "end")])
        add(f"Cf:{n}", "compute", G[n].fwd_s, [])
    rev = names[::-1]
    for i, n in enumerate(rev):  # backward
        prev = f"Cb:{rev[i - 1]}" if i else f"Cf:{names[-1]}"
        add(f"AGb:{n}", "comm", G[n].regather_s, [(prev, "start")])
        if i:
            add(f"RS:{rev[i - 1]}", "comm", G[rev[i - 1]].rs_s, [(f"Cb:{rev[i - 1]}", "end")])
        add(f"Db:{n}", "compute", G[n].recodec_s, [(f"AGb:{n}", "end")])
        add(f"Cb:{n}", "compute", G[n].bwd_s, [])
    add(f"RS:{rev[-1]}", "comm", G[rev[-1]].rs_s, [(f"Cb:{rev[-1]}", "end")])

    start: dict[str, float] = {}
    end: dict[str, float] = {}
    free = {"compute": 0.0, "comm": 0.0}
    head = {"compute": 0, "comm": 0}
    while any(head[s] < len(order[s]) for s in order):
        progressed = False
        for s in ("compute", "comm"):
            while head[s] < len(order[s]):
                op = order[s][head[s]]
                _, dur, deps = ops[op]
                if not all(d in (start if w == "start" else end) for d, w in deps):
                    break
                t0 = max([free[s]] + [(start if w == "start" else end)[d] for d, w in deps])
                start[op], end[op] = t0, t0 + dur
                free[s] = end[op]
                head[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlock (dependency cycle)")
    busy = {s: sum(ops[o][1] for o in order[s]) for s in order}
    return max(end.values()), busy["compute"], busy["comm"]


def on_stream(groups: list[Group], codec_stream: str) -> list[Group]:
    if codec_stream == "compute":
        return groups
    return [dataclasses.replace(g, gather_s=g.gather_s + g.codec_s, codec_s=0.0,
                                regather_s=g.regather_s + g.recodec_s, recodec_s=0.0)
            for g in groups]


def overlap_aware(planned: list[Group], plain: list[Group], agreement_s: float,
                  codec_stream: str) -> list[Group]:
    """Keep a group compressed only where that shortens the step.

    The per-tensor planner prices a gather in isolation; a gather that prefetch already hides
    behind compute gains nothing from compression and still pays its codec. Greedily, group by
    group, fall back to the plain gather wherever the replayed step is no slower (which also
    frees that group's cache memory). A step's agreement is paid while any group is compressed,
    so no single fallback may shorten the step where all of them together do: the all-plain
    step is kept whenever it is no slower.
    """
    groups = list(planned)
    best = schedule(on_stream(groups, codec_stream), agreement_s)[0]
    for i, alt in enumerate(plain):
        if groups[i].n_compressed == 0:
            continue
        trial = groups[:i] + [alt] + groups[i + 1:]
        t = schedule(on_stream(trial, codec_stream), agreement_s)[0]
        if t <= best:
            groups, best = trial, t
    if schedule(on_stream(plain, codec_stream), 0.0)[0] <= best:  # no agreement to pay
        return list(plain)
    return groups

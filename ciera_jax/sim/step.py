"""One FSDP training step, replayed on two in-order streams (compute, communication).

Work items, per group of weights (``embed``, each decoder layer, ``head`` = final norm + head):

- forward:  all-gather the group's weights (one bucketed collective, FSDP flat-parameter style),
            decode them (compute stream), run the forward;
- backward: re-gather, decode, run the backward (2x forward FLOPs), reduce-scatter the
            gradients (always plain bf16: gradient compression is out of scope).

Prefetch depth one: the gather of group g+1 may start once the compute of group g starts (one
extra gathered layer in memory), so it overlaps that compute. Collectives are hierarchical
(NVLink ring inside a node, IB ring across nodes); the wire bytes and codec time of each method
come from :mod:`ciera_jax.costmodel`, and CIERA's compress-or-not per tensor from the planner.
CIERA also pays one agreement collective (pmax of all change counts) at the start of the step.

Compute: 2 FLOPs per active parameter per token forward (routed experts count top_k/n_experts),
plus causal attention 2*seq*d_model per layer per token forward; backward is twice forward; the
GPU sustains peak * MFU. Codec work (decode of a gathered layer, encode of the local shard)
runs by default on the compute stream: it uses the SMs and HBM that the matmuls use, so the
GPU does one or the other (conservative when compute-bound, right when communication-bound:
the SMs are idle then). ``codec_stream="comm"`` instead serializes it with the transfers, as
part of the prefetched gather (conservative when communication-bound).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ciera_jax import costmodel as cm
from ciera_jax.planner import plan_tensor
from ciera_jax.sim.cluster import Cluster, get_cluster
from ciera_jax.sim.trace import Trace, default_trace

BYTES_PER_ELEM = 2  # bf16 weights and gradients


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    fwd_s: float
    bwd_s: float
    gather_s: float  # one all-gather of the group with this method (link time)
    codec_s: float  # decode (+ encode) of one gather, on the compute stream
    rs_s: float  # plain bf16 reduce-scatter of the group's gradients
    wire_bytes: float
    plain_bytes: float
    n_compressed: int = 0


@dataclasses.dataclass(frozen=True)
class StepResult:
    method: str
    gpus: int
    step_s: float
    compute_s: float  # model FLOPs only
    codec_s: float  # codec work per step (all gathers)
    comm_s: float  # busy time of the communication stream
    exposed_comm_s: float  # step time not covered by compute stream work
    wire_bytes_per_gather_pass: float
    plain_bytes_per_gather_pass: float
    tensors_compressed: int
    codec_stream: str = "compute"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _groups(cfg: Any) -> list[tuple[str, list]]:
    from ciera_jax.shapes import global_tensors, layer_tensors

    g = {t.name: t for t in global_tensors(cfg)}
    out = [("embed", [g["embed_VxD"]])]
    out += [(f"layer{l}", layer_tensors(cfg, l)) for l in range(cfg.n_layers)]
    out.append(("head", [g["final_norm"], g["head_DxV"]]))
    return out


def _fwd_flops_per_token(cfg: Any, name: str, tensors: list) -> float:
    if name == "embed":
        return 0.0  # a lookup
    active = sum(t.size * (cfg.top_k / cfg.n_experts if t.kind.startswith("expert_") else 1)
                 for t in tensors if len(t.shape) > 1)
    attn = 2.0 * cfg.seq_len * cfg.d_model if name.startswith("layer") else 0.0
    return 2.0 * active + attn


def build_groups(cfg: Any, N: int, cluster: Cluster, method: str, tokens_per_gpu: int,
                 trace: Trace) -> list[Group]:
    topo = cluster.topology
    groups = _groups(cfg)
    n_tensors = sum(len(ts) for _, ts in groups)
    share = cm.agreement_time(N, topo) / n_tensors
    out = []
    for name, ts in groups:
        fwd = _fwd_flops_per_token(cfg, name, ts) * tokens_per_gpu / cluster.flops
        wire = codec = plain = 0.0
        n_comp = 0
        for t in ts:
            plain += t.size * BYTES_PER_ELEM
            m = method
            if method == "ciera":
                d = plan_tensor(t, "bfloat16", N, topo, trace.rate(t.kind), share)
                m = "ciera" if d.compress else "plain"
                n_comp += d.compress
            c = cm.gather_cost(m, t.size, N, BYTES_PER_ELEM, topo, trace.rate(t.kind))
            wire += c.wire_bytes
            codec += c.codec_s
        out.append(Group(name, fwd, 2 * fwd, cm.gather_time(wire, N, topo), codec,
                         cm.reduce_scatter_time(plain, N, topo), wire, plain, n_comp))
    return out


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
        add(f"AGb:{n}", "comm", G[n].gather_s, [(prev, "start")])
        if i:
            add(f"RS:{rev[i - 1]}", "comm", G[rev[i - 1]].rs_s, [(f"Cb:{rev[i - 1]}", "end")])
        add(f"Db:{n}", "compute", G[n].codec_s, [(f"AGb:{n}", "end")])
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


def _on_stream(groups: list[Group], codec_stream: str) -> list[Group]:
    if codec_stream == "compute":
        return groups
    return [dataclasses.replace(g, gather_s=g.gather_s + g.codec_s, codec_s=0.0) for g in groups]


def overlap_aware(planned: list[Group], plain: list[Group], agreement_s: float,
                  codec_stream: str) -> list[Group]:
    """Keep a group compressed only where that shortens the step.

    The per-tensor planner prices a gather in isolation; a gather that prefetch already hides
    behind compute gains nothing from compression and still pays its codec. Greedily, group by
    group, fall back to the plain gather wherever the replayed step is no slower.
    """
    groups = list(planned)
    best = schedule(_on_stream(groups, codec_stream), agreement_s)[0]
    for i, alt in enumerate(plain):
        if groups[i].n_compressed == 0:
            continue
        trial = groups[:i] + [alt] + groups[i + 1:]
        t = schedule(_on_stream(trial, codec_stream), agreement_s)[0]
        if t <= best:
            groups, best = trial, t
    return groups


def simulate_step(cfg: Any, gpus: int, cluster: Cluster | str = "h100", method: str = "plain",
                  tokens_per_gpu: int = 4096, trace: Trace | None = None,
                  codec_stream: str = "compute") -> StepResult:
    from ciera_jax.shapes import get_config

    if isinstance(cfg, str):
        cfg = get_config(cfg)
    if isinstance(cluster, str):
        cluster = get_cluster(cluster)
    if method not in cm.METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(cm.METHODS)}")
    if gpus < 1:
        raise ValueError(f"gpu count must be positive, got {gpus}")
    if codec_stream not in ("comm", "compute"):
        raise ValueError(f"codec_stream must be 'comm' or 'compute', not {codec_stream!r}")
    trace = trace or default_trace()
    groups = build_groups(cfg, gpus, cluster, method, tokens_per_gpu, trace)
    agree = cm.agreement_time(gpus, cluster.topology) if method == "ciera" else 0.0
    if method == "ciera":
        plain = build_groups(cfg, gpus, cluster, "plain", tokens_per_gpu, trace)
        groups = overlap_aware(groups, plain, agree, codec_stream)
    codec = 2 * sum(g.codec_s for g in groups)  # forward gather + backward re-gather
    step, busy_compute, busy_comm = schedule(_on_stream(groups, codec_stream), agree)
    compute = sum(g.fwd_s + g.bwd_s for g in groups)
    return StepResult(method, gpus, step, compute, codec, busy_comm, step - busy_compute,
                      sum(g.wire_bytes for g in groups), sum(g.plain_bytes for g in groups),
                      sum(g.n_compressed for g in groups), codec_stream)


def sweep(cfg: Any, gpu_counts: list[int], cluster: Cluster | str = "h100",
          tokens_per_gpu: int = 4096, trace: Trace | None = None,
          methods: tuple[str, ...] = cm.METHODS, codec_stream: str = "compute") -> dict:
    """Every method at every GPU count, and CIERA's speedup over each other method."""
    from ciera_jax.shapes import get_config

    if isinstance(cfg, str):
        cfg = get_config(cfg)
    if isinstance(cluster, str):
        cluster = get_cluster(cluster)
    trace = trace or default_trace()
    results = {}
    for N in gpu_counts:
        r = {m: simulate_step(cfg, N, cluster, m, tokens_per_gpu, trace, codec_stream)
             for m in methods}
        entry = {"methods": {m: v.to_json() for m, v in r.items()}}
        if "ciera" in r:
            entry["speedup_ciera_over"] = {m: r[m].step_s / r["ciera"].step_s
                                          for m in methods if m != "ciera"}
        results[str(N)] = entry
    return {
        "model": cfg.name,
        "cluster": cluster.to_json(),
        "tokens_per_gpu": tokens_per_gpu,
        "codec_stream": codec_stream,
        "trace": trace.to_json(),
        "assumptions": [
            "FSDP over all GPUs; one bucketed all-gather per layer (forward and backward "
            "re-gather) and one plain bf16 reduce-scatter of gradients per layer",
            "hierarchical collectives: NVLink ring in a node, then ring across nodes",
            f"prefetch depth one; codec work on the {codec_stream} stream; optimizer step "
            "not modelled",
            "compute = 6 x active params x tokens + causal attention, at peak x MFU",
        ],
        "results": results,
    }


def simulate_gather(n_bytes: float, N: int, profile: cm.Link | str, method: str = "plain",
                    change_rate: float = 0.0, bytes_per_elem: int = BYTES_PER_ELEM) -> float:
    """Predicted seconds for one all-gather of a tensor of ``n_bytes`` (full size, as stored)
    on ``N`` ranks; CIERA includes the tier-rounded patches, codec and one agreement. Use it
    to compare with measured gathers (see :func:`compare_to_measurements`)."""
    link = profile if isinstance(profile, cm.Topology) else cm.get_profile(profile)
    n = math.ceil(n_bytes / bytes_per_elem)
    c = cm.gather_cost(method, n, N, bytes_per_elem, link, change_rate)
    t = cm.gather_time(c.wire_bytes, N, link) + c.codec_s
    return t + (cm.agreement_time(N, link) if method == "ciera" else 0.0)


def compare_to_measurements(records: list[dict], profile: cm.Link | str) -> list[dict]:
    """``records``: dicts with n_bytes, N, method, seconds (and optionally change_rate).
    Returns each with ``predicted_s`` and ``ratio`` = predicted / measured."""
    out = []
    for r in records:
        pred = simulate_gather(r["n_bytes"], r["N"], profile, r.get("method", "plain"),
                               r.get("change_rate", 0.0))
        out.append({**r, "predicted_s": pred, "ratio": pred / r["seconds"]})
    return out

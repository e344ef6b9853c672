"""One FSDP training step, replayed on two in-order streams (compute, communication).

Work items, per group of weights (``embed``, each decoder layer, ``head`` = final norm + head):

- forward:  all-gather the group's weights (one bucketed collective, FSDP flat-parameter style),
            decode them (compute stream), run the forward;
- backward: re-gather, decode, run the backward (2x forward FLOPs), reduce-scatter the
            gradients (always plain bf16: gradient compression is out of scope). Exponent
            mode's re-gather sends the payload only: its cache holds this step's exponents.

Each gathered tensor has a mode: ``plain``; ``plain-noreshard`` (FSDP that keeps the gathered
weights from forward to backward, ZeRO-2 style: no backward re-gather, the full bf16 weights
held); ``int8``; ``entropy``; ``exponent`` (CIERA exponent reuse); ``word`` (CIERA word mode: the
forward gather sends word deltas, and the cache *is* the full weights, so the backward re-gather
is gone, like plain-noreshard). The methods compared are mode assignments: every tensor plain /
plain-noreshard / int8 / entropy; ``ciera`` exponent mode where the planner says it pays; ``word``
word mode where it pays; or any per-tensor plan (e.g. the budgeted planner's). Every result
states the extra memory its caches (or held weights) take per GPU (:mod:`ciera_jax.planning.memory`).

Prefetch depth one: the gather of group g+1 may start once the compute of group g starts (one
extra gathered layer in memory), so it overlaps that compute. Collectives are hierarchical
(NVLink ring inside a node, IB ring across nodes); the wire bytes and codec time of each method
come from :mod:`ciera_jax.planning.costmodel`, and so do a host's fresh-memory faults and copies
beyond its cache (0 on GPUs; a calibrated CPU host pays them). Replicated tensors (norms, biases)
are not gathered. CIERA also pays one agreement collective (pmax of all change counts) at the
start of the step. :func:`simulate_gather` is a step of one gather and nothing else: what the
real-socket sweep measures, priced by the same terms.

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
from typing import Any, Callable, Mapping

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import memory
from ciera_jax.planning.planner import (HEADROOM_GB, cache_budget, plan_model_modes, plan_tensor,
                                        room_bytes)
from ciera_jax.planning.shapes import TensorSpec, get_config, global_tensors, layer_tensors
from ciera_jax.sim.cluster import Cluster, get_cluster
from ciera_jax.sim.streams import Group, on_stream, overlap_aware, schedule
from ciera_jax.planning.traces import Trace, WordTrace, default_trace, default_word_trace

BYTES_PER_ELEM = 2  # bf16 weights and gradients
# "fit": the budgeted planner's plan within the GPU's memory (fitting_plan), the one a run gets
METHODS = ("plain", "plain-noreshard", "int8", "entropy", "ciera", "word", "fit")
TENSOR_MODES = ("plain", "plain-noreshard", "int8", "entropy", "exponent", "word")
NO_REGATHER = ("plain-noreshard", "word")  # the backward reads the held weights / the cache
MEMORY_MODE = {"plain-noreshard": "plain-noreshard", "exponent": "exponent", "word": "word"}


@dataclasses.dataclass(frozen=True)
class StepResult:
    method: str
    gpus: int
    step_s: float
    compute_s: float  # model FLOPs only
    codec_s: float  # codec work per step (all gathers)
    comm_s: float  # busy time of the communication stream
    exposed_comm_s: float  # step time not covered by compute stream work
    wire_bytes_per_gather_pass: float  # the forward gathers
    plain_bytes_per_gather_pass: float
    tensors_compressed: int
    codec_stream: str = "compute"
    wire_bytes_per_step: float = 0.0  # forward gathers + backward re-gathers
    gather_only_s: float = 0.0  # every weight gather of the step, back to back, codec included
    extra_memory_bytes: int = 0  # per GPU over plain FSDP: caches or held weights
    memory_bytes: int = 0  # per GPU in all: the memory model's plain step + extra_memory_bytes
    fits: bool = True  # memory_bytes within the GPU's memory less the planner's headroom

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _groups(cfg: Any) -> list[tuple[str, list]]:
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


def method_modes(method: str, N: int, topo: links.Link, trace: Trace, word_trace: WordTrace,
                 phase: str, share_s: float) -> Callable:
    """The mode of each tensor under a method: a function of the TensorSpec."""
    if method in ("plain", "plain-noreshard", "int8", "entropy"):
        return lambda t: method
    if method == "ciera":
        return lambda t: ("exponent" if plan_tensor(t, "bfloat16", N, topo, trace.rate(t.kind),
                                                    share_s).compress else "plain")
    if method == "word":
        def word(t):
            tp = cm.t_plain(t.size, N, BYTES_PER_ELEM, topo)
            tw = cm.t_word(t.size, N, BYTES_PER_ELEM, word_trace.bpw(t.kind, phase), topo,
                           share_s)
            return "word" if N > 1 and tw < 2 * tp else "plain"
        return word
    raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")


@dataclasses.dataclass(frozen=True)
class Fit:
    """The budgeted planner within one GPU's memory: what the step needs without caches
    (``base``), what is left for caches (``budget``, bytes) and the plan within it
    (``plan``: the planner's choices); ``plan`` None, with ``reason``, when the step does not
    fit even without caches."""

    base: memory.Memory
    budget: float | None = None
    plan: list | None = None
    reason: str | None = None

    @property
    def modes(self) -> dict | None:
        """``{(layer, name): mode}`` of the tensors the plan does not gather plainly."""
        if self.plan is None:
            return None
        return {(c.layer, c.name): c.mode for c in self.plan if c.mode != "plain"}


def plan_within_memory(cfg: Any, gpus: int, cluster: Cluster, tokens_per_gpu: int,
                       trace: Trace, word_trace: WordTrace, phase: str = "steady",
                       remat: str = "full") -> Fit:
    """The plan a run gets (as ``ciera plan`` and ``--cache auto`` choose): the budgeted
    planner's modes within the GPU's memory less ``planner.HEADROOM_GB`` and what the step
    needs under ``remat``."""
    topo = cluster.topology
    base = memory.memory_per_gpu(cfg, gpus, tokens_per_gpu=tokens_per_gpu, remat=remat)
    try:
        budget = cache_budget(topo.memory_gb, base, headroom_gb=HEADROOM_GB)
    except ValueError as e:  # not even the training state fits
        return Fit(base, reason=str(e))
    if topo.memory_gb is not None and base.total > room_bytes(topo.memory_gb):
        return Fit(base, reason=f"{memory.fmt_gb(base.total)} GB per GPU without caches")
    return Fit(base, budget, plan_model_modes(cfg, gpus, topo, budget, trace, word_trace, phase))


def fitting_plan(cfg: Any, gpus: int, cluster: Cluster, tokens_per_gpu: int, trace: Trace,
                 word_trace: WordTrace, phase: str = "steady",
                 remat: str = "full") -> dict | None:
    """:func:`plan_within_memory`'s modes, ``{(layer, name): mode}`` of the tensors not plain;
    None when the step does not fit even without caches."""
    return plan_within_memory(cfg, gpus, cluster, tokens_per_gpu, trace, word_trace, phase,
                              remat).modes


def _plan_modes(plan: Mapping) -> Callable:
    bad = sorted({m for m in plan.values() if m not in TENSOR_MODES})
    if bad:
        raise ValueError(f"unknown tensor mode(s) {', '.join(bad)} in the plan; choose from: "
                         f"{', '.join(TENSOR_MODES)}")
    return lambda t: plan.get(memory.key(t), "plain")


def tensor_gathers(mode: str, n: int, N: int, link: links.Link, change_rate: float,
                   word_bpw: float | None) -> tuple[str, cm.GatherCost, cm.GatherCost | None]:
    """One tensor of ``n`` elements in tensor mode ``mode``, as the step prices it: the mode it
    gets (exponent mode above its top rung gathers plain bits), its forward gather's cost and its
    backward re-gather's (None where the backward reads held weights or the cache; exponent
    mode's sends the payload only, the exponents are cached)."""
    if mode == "word":
        c = cm.gather_cost("word", n, N, BYTES_PER_ELEM, link, word_bpw=word_bpw)
    else:
        gm = {"exponent": "ciera", "plain-noreshard": "plain"}.get(mode, mode)
        c = cm.gather_cost(gm, n, N, BYTES_PER_ELEM, link, change_rate)
        if c.fallback:
            mode, c = "plain", cm.gather_cost("plain", n, N, BYTES_PER_ELEM, link)
    if mode in NO_REGATHER:
        return mode, c, None
    again = (cm.gather_cost("payload", n, N, BYTES_PER_ELEM, link) if mode == "exponent"
             else c)
    return mode, c, again


def build_group(name: str, fwd_s: float, tensors: list, N: int, link: links.Link,
                mode_of: Callable, trace: Trace, word_trace: WordTrace,
                phase: str = "steady") -> Group:
    """One group: its forward compute (``fwd_s``, the backward twice it) and the bucketed gathers
    of its tensors in the modes ``mode_of(t)`` gives. A gather's time on the comm stream is the
    link's for the group's wire bytes plus the host's fresh-memory faults and copies beyond its
    cache (0 on GPUs); its codec runs after it on the compute stream."""
    wire = rewire = codec = recodec = host = rehost = plain = 0.0
    n_comp = extra = 0
    modes = []
    for t in tensors:
        if not memory.gathered(t):
            continue
        m = mode_of(t)
        bpw = word_trace.bpw(t.kind, phase) if m == "word" else None
        m, c, again = tensor_gathers(m, t.size, N, link, trace.rate(t.kind), bpw)
        plain += t.size * BYTES_PER_ELEM
        modes.append((t, m))
        n_comp += m in ("exponent", "word")
        extra += memory.cache_bytes(t, MEMORY_MODE.get(m, "plain"))
        wire, codec, host = wire + c.wire_bytes, codec + c.codec_s, host + c.host_s + c.spill_s
        if again is not None:
            rewire += again.wire_bytes
            recodec += again.codec_s
            rehost += again.host_s + again.spill_s
    return Group(name, fwd_s, 2 * fwd_s, cm.gather_time(wire, N, link) + host,
                 cm.gather_time(rewire, N, link) + rehost if rewire else 0.0, codec, recodec,
                 cm.reduce_scatter_time(plain, N, link), wire, rewire, plain, n_comp, extra,
                 tuple(modes))


def build_groups(cfg: Any, N: int, cluster: Cluster, mode_of: Callable, tokens_per_gpu: int,
                 trace: Trace, word_trace: WordTrace | None = None,
                 phase: str = "steady") -> list[Group]:
    """Per group: compute, and the gathers of its tensors in the modes ``mode_of(t)`` gives."""
    word_trace = word_trace or default_word_trace()
    return [build_group(name, _fwd_flops_per_token(cfg, name, ts) * tokens_per_gpu
                        / cluster.flops, ts, N, cluster.topology, mode_of, trace, word_trace,
                        phase)
            for name, ts in _groups(cfg)]


def simulate_step(cfg: Any, gpus: int, cluster: Cluster | str = "h100-ib400", method: str = "plain",
                  tokens_per_gpu: int = 4096, trace: Trace | None = None,
                  codec_stream: str = "compute", *, word_trace: WordTrace | None = None,
                  phase: str = "steady", plan: Mapping | None = None,
                  overlap: bool = True, remat: str = "full") -> StepResult:
    """One step of ``method`` (see :data:`METHODS`), or of ``plan`` (``{(layer, name): mode}``,
    modes from :data:`TENSOR_MODES`, unnamed tensors plain) when given, on ``gpus`` GPUs.
    ``overlap``: fall back to plain for groups whose compression does not shorten the step.
    The result's ``memory_bytes`` and ``fits`` count the step's memory per GPU under ``remat``
    (:mod:`ciera_jax.planning.memory`) against the GPU's."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    if isinstance(cluster, str):
        cluster = get_cluster(cluster)
    if plan is None and method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if gpus < 1:
        raise ValueError(f"gpu count must be positive, got {gpus}")
    if codec_stream not in ("comm", "compute"):
        raise ValueError(f"codec_stream must be 'comm' or 'compute', not {codec_stream!r}")
    trace = trace or default_trace()
    word_trace = word_trace or default_word_trace()
    topo = cluster.topology
    n_gathered = sum(memory.gathered(t) for _, ts in _groups(cfg) for t in ts)
    share = cm.agreement_time(gpus, topo) / max(n_gathered, 1)
    if plan is None and method == "fit":
        fit = fitting_plan(cfg, gpus, cluster, tokens_per_gpu, trace, word_trace, phase, remat)
        mode_of = _plan_modes(fit or {})
    else:
        mode_of = (_plan_modes(plan) if plan is not None
                   else method_modes(method, gpus, topo, trace, word_trace, phase, share))
    args = (tokens_per_gpu, trace, word_trace, phase)
    groups = build_groups(cfg, gpus, cluster, mode_of, *args)
    agree = cm.agreement_time(gpus, topo) if any(g.n_compressed for g in groups) else 0.0
    if agree and overlap:
        plain = build_groups(cfg, gpus, cluster, lambda t: "plain", *args)
        groups = overlap_aware(groups, plain, agree, codec_stream)
        if not any(g.n_compressed for g in groups):
            agree = 0.0
    codec = sum(g.codec_s + g.recodec_s for g in groups)
    step, busy_compute, busy_comm = schedule(on_stream(groups, codec_stream), agree)
    compute = sum(g.fwd_s + g.bwd_s for g in groups)
    gather_only = agree + sum(g.gather_s + g.regather_s + g.codec_s + g.recodec_s for g in groups)
    extra = sum(g.extra_memory for g in groups)
    total = memory.memory_per_gpu(cfg, gpus, tokens_per_gpu=tokens_per_gpu,
                                  remat=remat).total + extra
    room = topo.memory_gb
    return StepResult("plan" if plan is not None else method, gpus, step, compute, codec,
                      busy_comm, step - busy_compute,
                      sum(g.wire_bytes for g in groups), sum(g.plain_bytes for g in groups),
                      sum(g.n_compressed for g in groups), codec_stream,
                      sum(g.wire_bytes + g.rewire_bytes for g in groups), gather_only, extra,
                      total, room is None or total <= room_bytes(room))


def sweep(cfg: Any, gpu_counts: list[int], cluster: Cluster | str = "h100-ib400",
          tokens_per_gpu: int = 4096, trace: Trace | None = None,
          methods: tuple[str, ...] = METHODS,
          codec_stream: str = "compute", *, word_trace: WordTrace | None = None,
          phase: str = "steady") -> dict:
    """Every method at every GPU count, and each CIERA mode's speedup over each other method."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    if isinstance(cluster, str):
        cluster = get_cluster(cluster)
    trace = trace or default_trace()
    word_trace = word_trace or default_word_trace()
    results = {}
    for N in gpu_counts:
        r = {m: simulate_step(cfg, N, cluster, m, tokens_per_gpu, trace, codec_stream,
                              word_trace=word_trace, phase=phase) for m in methods}
        entry = {"methods": {m: v.to_json() for m, v in r.items()}}
        for c in ("ciera", "word", "fit"):
            if c in r:
                entry[f"speedup_{c}_over"] = {m: r[m].step_s / r[c].step_s
                                              for m in methods if m != c}
        results[str(N)] = entry
    return {
        "model": cfg.name,
        "cluster": cluster.to_json(),
        "tokens_per_gpu": tokens_per_gpu,
        "codec_stream": codec_stream,
        "trace": trace.to_json(),
        "word_trace": word_trace.to_json(),
        "phase": phase,
        "assumptions": [
            "FSDP over all GPUs; one bucketed all-gather per layer forward, a backward "
            "re-gather except for word mode and plain-noreshard (the weights are held), one "
            "plain bf16 reduce-scatter of gradients per layer; norms replicated, not gathered",
            "hierarchical collectives: NVLink ring in a node, then ring across nodes",
            f"prefetch depth one; codec work on the {codec_stream} stream; optimizer step "
            "not modelled",
            "compute = 6 x active params x tokens + causal attention, at peak x MFU",
            f"word mode at the word trace's '{phase}' bytes per weight; exponent mode at the "
            "exponent trace's change rates",
            "extra_memory_bytes: per GPU over plain FSDP (caches, or the held bf16 weights)",
            "memory_bytes, fits: the memory model's step under --remat full plus the extra, "
            f"against the GPU's memory less the planner's {HEADROOM_GB:g} GB headroom; 'fit' is "
            "the budgeted planner's plan within it (what ciera plan and --cache auto choose)",
        ],
        "results": results,
    }


def simulate_gather(n_bytes: float, N: int, profile: links.Link | str, method: str = "plain",
                    change_rate: float = 0.0, word_bpw: float | None = None) -> float:
    """Predicted seconds for one all-gather of a bf16 tensor of ``n_bytes`` (full size) on
    ``N`` ranks, as the step model prices it: a step whose only work is that gather's forward
    (:func:`build_group` of one tensor, :func:`schedule`d), so a measured gather checks the
    very terms a step adds up. ``method``: ``plain``, ``ciera`` (exponent mode at
    ``change_rate``) or ``word`` (at ``word_bpw`` bytes per weight); both CIERA modes pay
    their rung's wire bytes, codec and one agreement, every method its host's fresh-memory
    faults and copies beyond its cache (0 on GPU profiles)."""
    modes = {"plain": "plain", "ciera": "exponent", "word": "word"}
    if method not in modes:
        raise ValueError(f"unknown gather method {method!r}; choose one of: {', '.join(modes)}")
    if method == "word" and not (word_bpw and word_bpw > 0):
        raise ValueError(f"word mode is priced at a measured word_bpw > 0, got {word_bpw!r}")
    link = links.get_link(profile)
    # any weight the FSDP rule shards: only its element count is priced
    t = TensorSpec("w_DxF", (math.ceil(n_bytes / BYTES_PER_ELEM),), "dense")
    trace = Trace({}, default=change_rate)
    words = WordTrace({"steady": {"overall": word_bpw}})
    g = build_group("gather", 0.0, [t], N, link, lambda _: modes[method], trace, words)
    g = dataclasses.replace(g, regather_s=0.0, recodec_s=0.0, rs_s=0.0)  # the forward only
    return schedule([g], cm.agreement_time(N, link) if g.n_compressed else 0.0)[0]


def compare_to_measurements(records: list[dict], profile: links.Link | str) -> list[dict]:
    """``records``: dicts with n_bytes, N, method, seconds (and optionally change_rate).
    Returns each with ``predicted_s`` and ``ratio`` = predicted / measured."""
    out = []
    for r in records:
        pred = simulate_gather(r["n_bytes"], r["N"], profile, r.get("method", "plain"),
                               r.get("change_rate", 0.0))
        out.append({**r, "predicted_s": pred, "ratio": pred / r["seconds"]})
    return out

"""Compress only where it pays: per-tensor decisions from the cost model, under a memory budget.

Exponent mode alone (:func:`plan_tensor`, :func:`plan_model`, :func:`plan_tree`): a tensor is
gathered with CIERA when the cost model predicts ``t_ciera < t_plain`` on the given link. Small
tensors (norms, routers, biases) stay plain: the per-gather latency, the codec launch and the
agreement share eat the byte saving. Dtypes other than bfloat16 and float32 always stay plain.

Budgeted (:func:`plan_model_modes`, :func:`plan_modes`): each tensor is plain, exponent or word
mode, priced as ``ciera train`` runs it: per step a plain tensor is gathered twice (forward,
backward re-gather), an exponent one compressed in the forward and by its sign + mantissa bytes
alone in the backward (the forward left this step's exponents in its cache), a word one once
(the backward reads the full weights from its cache), and every tensor's gradient is
reduce-scattered once. Each mode costs cache memory on every GPU (:mod:`ciera_jax.planning.memory`);
the planner maximizes the step-time saving within a cache budget: a multiple-choice knapsack,
solved by dynamic programming (a greedy by saving per byte falls short of the optimum on OLMoE:
the big expert tensors do not pack greedily).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Union

import jax
import numpy as np

from ciera_jax.codec import bitfields
from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import clusters
from ciera_jax.planning import memory
from ciera_jax.planning.shapes import get_config, tensor_inventory
from ciera_jax.planning.traces import default_trace, default_word_trace

# bytes per element, payload bytes per element for the dtypes the codec knows
CODEC_DTYPES = {"bfloat16": (2, 1), "float32": (4, 3)}


@dataclasses.dataclass(frozen=True)
class Decision:
    compress: bool
    t_plain: float  # seconds, one all-gather of the full tensor
    t_ciera: float  # seconds, the compressed gather (== plain + agreement share if it falls back)
    reason: str
    name: str = ""
    shape: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    kind: str = ""
    layer: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _bytes_per_elem(self.dtype)

    @property
    def t_chosen(self) -> float:
        return self.t_ciera if self.compress else self.t_plain


def dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(getattr(dtype, "name", dtype))


def _bytes_per_elem(dtype: str) -> int:
    if dtype in CODEC_DTYPES:
        return CODEC_DTYPES[dtype][0]
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 2


def plan_tensor(spec_or_shape: Any, dtype: Any, N: int, profile: Union[str, links.Link],
                change_rate: float, agreement_share_s: float | None = None) -> Decision:
    """Decide one tensor. ``spec_or_shape`` is a :class:`ciera_jax.planning.shapes.TensorSpec` or a shape."""
    link = clusters.get_link(profile)
    name, kind, layer = "", "", None
    if hasattr(spec_or_shape, "shape") and hasattr(spec_or_shape, "kind"):
        name, kind, layer = spec_or_shape.name, spec_or_shape.kind, spec_or_shape.layer
        shape = tuple(spec_or_shape.shape)
    else:
        shape = tuple(spec_or_shape)
    dt = dtype_name(dtype)
    n = math.prod(shape)
    b = _bytes_per_elem(dt)
    tp = cm.t_plain(n, N, b, link)
    meta = dict(name=name, shape=shape, dtype=dt, kind=kind, layer=layer)
    if dt not in CODEC_DTYPES:
        return Decision(False, tp, tp, f"dtype {dt} has no codec: plain", **meta)
    if N <= 1:
        return Decision(False, tp, tp, "single rank: nothing to gather", **meta)
    payload = CODEC_DTYPES[dt][1]
    tc = cm.t_ciera(n, N, payload, change_rate, link, agreement_share_s)
    cost = cm.gather_cost("ciera", n, N, b, link, change_rate)
    if cost.fallback:
        return Decision(False, tp, tc, "change rate above the top escape rung: plain", **meta)
    if tc < tp:
        return Decision(True, tp, tc, f"saves {(tp - tc) * 1e6:.1f} us", **meta)
    return Decision(False, tp, tc, "latency + codec overhead exceeds the byte saving", **meta)


def _rate(trace: Any, kind: str) -> float:
    if trace is None:
        trace = default_trace()
    if isinstance(trace, (int, float)):
        return float(trace)
    if hasattr(trace, "rate"):
        return trace.rate(kind)
    if isinstance(trace, Mapping):
        return float(trace.get(kind, trace.get("default", 1e-3)))
    raise TypeError(f"trace must be a number, a mapping kind->rate or a Trace, not {type(trace)}")


def plan_model(cfg: Any, N: int, profile: Union[str, links.Link], trace: Any = None,
               dtype: Any = "bfloat16") -> list[Decision]:
    """One exponent-or-plain decision per tensor of ``tensor_inventory(cfg)`` (``cfg`` a
    ModelConfig or its name).

    ``trace`` gives the per-kind exponent change rate per step: a number, a mapping
    ``{kind: rate}``, a :class:`ciera_jax.planning.traces.Trace`, or None for the shipped default.
    The single per-step agreement collective is shared evenly by all tensors.
    """
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    link = clusters.get_link(profile)
    inv = tensor_inventory(cfg)
    share = cm.agreement_time(N, link) / max(len(inv), 1)
    return [plan_tensor(t, dtype, N, link, _rate(trace, t.kind), share) for t in inv]


def plan_tree(params_tree: Any, axis_size: int, profile: Union[str, links.Link],
              change_rate: float = 1e-3) -> Any:
    """A pytree of bools matching ``params_tree`` (leaves: arrays or ShapeDtypeStructs): True
    where the leaf should go through the compressed gather. Non-codec dtypes are False."""
    link = clusters.get_link(profile)
    leaves, treedef = jax.tree_util.tree_flatten(params_tree)
    share = cm.agreement_time(axis_size, link) / max(len(leaves), 1)

    def decide(x: Any) -> bool:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return False
        return plan_tensor(tuple(x.shape), x.dtype, axis_size, link, change_rate, share).compress

    return jax.tree_util.tree_unflatten(treedef, [decide(x) for x in leaves])


def summarize(decisions: list[Decision]) -> dict:
    """Totals over one gather pass of every tensor (a step gathers twice: forward + backward)."""
    t_plain = sum(d.t_plain for d in decisions)
    t_plan = sum(d.t_chosen for d in decisions)
    comp = [d for d in decisions if d.compress]
    return {
        "tensors": len(decisions),
        "compressed": len(comp),
        "bytes_total": sum(d.nbytes for d in decisions),
        "bytes_compressed": sum(d.nbytes for d in comp),
        "t_plain_s": t_plain,
        "t_planned_s": t_plan,
        "saving_per_pass_s": t_plain - t_plan,
        "saving_per_step_s": 2 * (t_plain - t_plan),
        "speedup": t_plain / t_plan if t_plan > 0 else 1.0,
    }


# ----------------------------------------------------------------------------- budgeted modes

MODES = ("plain", "exponent", "word")


@dataclasses.dataclass(frozen=True)
class ModeChoice:
    """One tensor's mode. ``options[mode] = (cache bytes per GPU, gather seconds per step)``
    for every mode it may take (plain always; others only for codec dtypes on >1 rank)."""

    name: str
    layer: int | None
    kind: str
    shape: tuple[int, ...]
    mode: str
    options: dict

    @property
    def cache_bytes(self) -> int:
        return self.options[self.mode][0]

    @property
    def step_s(self) -> float:
        return self.options[self.mode][1]

    @property
    def saving_s(self) -> float:
        return self.options["plain"][1] - self.step_s

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * memory.GATHER_BYTES


# What the backward of ``ciera train`` gathers again, by mode (the forward gathers every
# tensor once): plain the whole tensor; exponent mode its payload (sign + mantissa), merged with
# the exponents the forward left in the cache; word mode nothing (its cache holds the weights).
BACKWARD_GATHER = {"plain": "plain", "exponent": "payload", "word": None}


def mode_options(n: int, N: int, dtype: Any, link: links.Link, change_rate: float, word_bpw: float,
                 share_s: float, cache_elem_bytes: int | None = None) -> dict:
    """``{mode: (cache bytes per GPU, communication seconds per step)}`` for one tensor of
    ``n`` elements, as ``ciera train`` runs it (:data:`BACKWARD_GATHER`): plain gathers twice
    per step, exponent once compressed and once its payload, word once (the compressed modes
    plus the agreement share), and every mode reduce-scatters the gradient once (the same in
    every mode, so it changes no choice)."""
    dt = dtype_name(dtype)
    b = _bytes_per_elem(dt)
    rs = cm.reduce_scatter_time(n * b, N, link) if N > 1 else 0.0
    tp = cm.t_plain(n, N, b, link)
    out = {"plain": (0, 2 * tp + rs)}
    if dt not in CODEC_DTYPES or N <= 1:
        return out
    flag = memory.CACHE_FLAG_BYTES
    tc = cm.t_ciera(n, N, CODEC_DTYPES[dt][1], change_rate, link, agreement_share_s=share_s)
    if not cm.gather_cost("ciera", n, N, b, link, change_rate).fallback:
        out["exponent"] = (n + flag, tc + cm.t_payload(n, N, b, link) + rs)
    word_b = b if cache_elem_bytes is None else cache_elem_bytes
    out["word"] = (n * word_b + flag, cm.t_word(n, N, b, word_bpw, link, share_s) + rs)
    return out


def step_wire_bytes(mode: str, plain_bytes: float, gather_bytes: float | None = None,
                    agreement_bytes: float = 0, dtype: Any = "bfloat16") -> float:
    """Bytes one rank sends per step for one tensor as ``ciera train`` runs it: the forward's
    gather (``gather_bytes``; plain: ``plain_bytes``, the rank's shard of the gathered
    ``dtype``), the backward's (:data:`BACKWARD_GATHER`), its share of the step's one
    agreement, and the gradient's reduce-scatter (``plain_bytes``: a ring reduce-scatter moves
    what a ring all-gather of the same tensor moves)."""
    if mode not in BACKWARD_GATHER:
        raise ValueError(f"unknown mode {mode!r}; choose one of {tuple(BACKWARD_GATHER)}")
    if mode == "plain":
        return 3 * plain_bytes
    if gather_bytes is None:
        raise ValueError(f"step_wire_bytes({mode!r}, ...): give the forward's gather_bytes")
    again = {"payload": plain_bytes * payload_share(dtype), None: 0}[BACKWARD_GATHER[mode]]
    return gather_bytes + again + agreement_bytes + plain_bytes


def payload_share(dtype: Any) -> float:
    """Sign + mantissa bytes over the word's (bf16: 1/2, float32: 3/4)."""
    fmt = bitfields.word_format(dtype)
    return fmt.payload_bytes / fmt.word.itemsize


UNITS = 1 << 14  # budget resolution of the knapsack


def choose_modes(options: list[dict], budget: float | None, units: int = UNITS) -> list[str]:
    """One mode per tensor maximizing the summed saving (plain seconds - mode seconds) with
    summed cache bytes <= ``budget`` (None: unlimited): a multiple-choice knapsack, solved
    exactly by dynamic programming over ``units`` slices of the budget, each cost rounded *up*
    to whole slices (so the plan always fits; it loses at most one slice per tensor)."""
    def saving(o, m):
        return o["plain"][1] - o[m][1]

    best = [max(o, key=lambda m: (saving(o, m), -o[m][0])) for o in options]
    if budget is None or sum(o[m][0] for o, m in zip(options, best)) <= budget:
        return best
    modes = ["plain"] * len(options)
    if budget <= 0:
        return modes
    unit = budget / units
    dp = np.zeros(units + 1)  # best saving within k slices
    picks = []
    for o in options:
        names = [m for m in o if m != "plain" and saving(o, m) > 0]
        new, pick = dp.copy(), np.full(units + 1, -1, np.int8)
        for j, m in enumerate(names):
            k = math.ceil(o[m][0] / unit)
            if k > units:
                continue
            cand = dp[:units + 1 - k] + saving(o, m)
            better = cand > new[k:]
            new[k:][better] = cand[better]
            pick[k:][better] = j
        dp = new
        picks.append((names, pick))
    k = units
    for i in range(len(options) - 1, -1, -1):
        names, pick = picks[i]
        j = pick[k]
        if j >= 0:
            modes[i] = names[j]
            k -= math.ceil(options[i][names[j]][0] / unit)
    return modes


def check_budget(budget: Any, what: str = "cache budget") -> float | None:
    """None (unlimited) or a non-negative number of bytes; anything else is a clear error."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.number)):
        raise TypeError(f"{what} must be a number of bytes or None (unlimited), "
                        f"not {type(budget).__name__} {budget!r}")
    if math.isnan(budget) or budget < 0:
        raise ValueError(f"{what} must be >= 0 bytes (None: unlimited), got {budget!r}")
    return float(budget)


HEADROOM_GB = 4.0  # what a plan leaves free of the GPU's memory (allocator, scheduler, estimate)


def room_bytes(memory_gb: float) -> float:
    """The bytes a step may use on a device of ``memory_gb``: all of it less
    :data:`HEADROOM_GB`."""
    return (memory_gb - HEADROOM_GB) * memory.GB


def cache_budget(memory_gb: Any, mem: memory.Memory, what: str = "",
                 headroom_gb: float = 0.0) -> float | None:
    """Bytes left for caches when a GPU has ``memory_gb`` (None: unlimited): the device memory
    less ``headroom_gb``, the training state, the transient gathered layers and the activations
    (0 when those already fill it). Error when the device cannot hold the training state
    itself."""
    if memory_gb is None:
        return None
    try:
        gb = float(memory_gb)
    except (TypeError, ValueError):
        raise ValueError(f"memory budget must be a number of GB, got {memory_gb!r}") from None
    if math.isnan(gb) or gb < 0:
        raise ValueError(f"memory budget must be >= 0 GB, got {memory_gb!r}")
    if gb * memory.GB < mem.state:
        raise ValueError(f"memory budget {gb:g} GB is smaller than the training state alone "
                         f"({memory.fmt_gb(mem.state)} GB per GPU: float32 params, AdamW "
                         f"moments, gradients{what}); use more GPUs or a larger budget")
    return max(0.0, (gb - headroom_gb) * memory.GB - mem.state - mem.gathered - mem.activations)


def fit_advice(cfg: Any, N: int, memory_gb: float | None, tokens_per_gpu: int,
               remat: str = "full", headroom_gb: float = HEADROOM_GB) -> str | None:
    """None when the step fits without caches in ``memory_gb`` less ``headroom_gb`` as the
    memory model counts it; otherwise one line saying so and naming what would fit: a remat
    policy that saves less at these tokens per GPU, or the tokens per GPU that fit with
    ``full`` (activations are linear in tokens), or that nothing does on ``N`` GPUs."""
    if memory_gb is None:
        return None
    cfg = memory.get_config(cfg) if isinstance(cfg, str) else cfg
    limit = (float(memory_gb) - headroom_gb) * memory.GB

    def total(policy: str, tokens: int) -> int:
        return memory.memory_per_gpu(cfg, N, tokens_per_gpu=tokens, remat=policy).total

    need = total(remat, tokens_per_gpu)
    if need <= limit:
        return None
    head = (f"{cfg.name} on {N} GPUs does not fit: {memory.fmt_gb(need)} GB per GPU without "
            f"caches at {tokens_per_gpu} tokens per GPU, --remat {remat}; the GPU has "
            f"{float(memory_gb):g} GB, less {headroom_gb:g} GB headroom")
    order = memory.REMAT_POLICIES[::-1]  # none, save_dot_except_mlp, full: least recompute first
    for policy in order[order.index(remat) + 1:] if remat in order else ():
        if total(policy, tokens_per_gpu) <= limit:
            return f"{head}; --remat {policy} fits"
    fixed, per_token = total("full", 0), total("full", 1) - total("full", 0)
    tokens = int((limit - fixed) // per_token) if per_token else 0
    if tokens <= 0:
        return f"{head}; no remat policy or batch fits: use more GPUs"
    return f"{head}; --remat full fits up to {tokens} tokens per GPU"


def _word_bpw(word_trace: Any, kind: str, phase: str) -> float:
    if word_trace is None:
        word_trace = default_word_trace()
    if isinstance(word_trace, (int, float)):
        return float(word_trace)
    return word_trace.bpw(kind, phase)


def plan_model_modes(cfg: Any, N: int, profile: Union[str, links.Link],
                     cache_budget_bytes: float | None = None, trace: Any = None,
                     word_trace: Any = None, phase: str = "steady") -> list[ModeChoice]:
    """Plain / exponent / word per gathered tensor of ``cfg`` on ``N`` ranks, best step-time
    saving within ``cache_budget_bytes`` of caches per GPU (None: unlimited). ``trace``: exponent
    change rates (as :func:`plan_model`); ``word_trace``: a WordTrace, a bytes-per-weight number,
    or None for the default, read at ``phase``. Replicated tensors (norms) are not gathered and
    are left out."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    budget = check_budget(cache_budget_bytes)
    link = clusters.get_link(profile)
    inv = [t for t in tensor_inventory(cfg) if memory.gathered(t)]
    share = cm.agreement_time(N, link) / max(len(inv), 1)
    opts = [mode_options(t.size, N, "bfloat16", link, _rate(trace, t.kind),
                         _word_bpw(word_trace, t.kind, phase), share) for t in inv]
    modes = choose_modes(opts, budget)
    return [ModeChoice(t.name, t.layer, t.kind, tuple(t.shape), m, o)
            for t, m, o in zip(inv, modes, opts)]


def modes_summary(choices: list[ModeChoice]) -> dict:
    """Gather seconds per step (plain vs planned), cache bytes per GPU, tensors per mode."""
    t_plain = sum(c.options["plain"][1] for c in choices)
    t_plan = sum(c.step_s for c in choices)
    by_mode = {m: sum(1 for c in choices if c.mode == m) for m in MODES}
    return {"tensors": len(choices), "tensors_by_mode": by_mode,
            "cache_bytes": sum(c.cache_bytes for c in choices),
            "gather_plain_s": t_plain, "gather_planned_s": t_plan,
            "saving_per_step_s": t_plain - t_plan,
            "gather_speedup": t_plain / t_plan if t_plan > 0 else 1.0}


def plan_modes(params_tree: Any, axis_size: int, profile: Union[str, links.Link],
               cache_budget_bytes: float | None = None, change_rate: float | None = None,
               word_bpw: float | None = None) -> Any:
    """For the trainer (``ciera train --cache auto``): a pytree of "plain" / "exponent" /
    "word" matching ``params_tree`` (leaves: arrays or ShapeDtypeStructs of the FULL gathered
    shape and the gathered dtype), best saving within ``cache_budget_bytes`` of caches per
    device (None: unlimited; 0: all plain). ``change_rate`` / ``word_bpw`` default to the
    shipped traces' steady-state figures (default rate; overall bytes per weight)."""
    budget = check_budget(cache_budget_bytes)
    link = clusters.get_link(profile)
    if change_rate is None:
        change_rate = _rate(None, "default")
    if word_bpw is None:
        word_bpw = _word_bpw(None, "default", "steady")
    leaves, treedef = jax.tree_util.tree_flatten(params_tree)
    share = cm.agreement_time(axis_size, link) / max(len(leaves), 1)
    opts = [mode_options(math.prod(x.shape), axis_size, x.dtype, link, change_rate, word_bpw,
                         share) if hasattr(x, "shape") and hasattr(x, "dtype")
            else {"plain": (0, 0.0)} for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, choose_modes(opts, budget))

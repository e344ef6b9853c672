"""Which gathered tensors ``ciera train`` compresses: the cost model's plan, plus a policy.

``cost``: the planner alone; ``auto`` (default): the planner, plus the routed expert weights
always (the tensors CIERA exists for); ``all``: every tensor of a codec dtype. "The planner" is
the exponent-mode decision (``ciera_jax.planning.planner.plan_tree``) and, with ``--cache auto``
(default), also the budgeted mode planner (``planner.plan_modes``), which prices what the
trainer runs: a word-cache tensor gathered once per step (the backward reads its cache), an
exponent or plain one twice. So every tensor whose word cache pays and fits is compressed.
"""

from __future__ import annotations

import functools
import math
import re
import sys

import jax

from ciera_jax.planning import memory, planner
from ciera_jax.planning.links import default_profile
from ciera_models.train.config import PLANS
EXPERT_WEIGHT = re.compile(r"w_(gate|up|down)_Ex\w+")


NO_CACHE = "none"  # a tensor gathered plainly: its cache is empty


def cache_modes(tc, tensors: dict, compress: dict, n: int, platform: str) -> dict[str, str]:
    """Cache mode per gathered tensor (``--cache``): ``exponent`` (1 B/param) or ``word``
    (2 B/param, sends a few bits per weight) for the compressed ones; ``auto``: the planner's
    per-tensor choice (``planner.plan_modes``) within the memory the caches may use
    (:func:`cache_budget_bytes`), exponent where it would not compress or a word cache does not
    fit. Tensors that are not compressed get :data:`NO_CACHE` (an empty cache: no bytes)."""
    if tc.cache != "auto":
        return {k: tc.cache if compress[k] else NO_CACHE for k in tensors}
    chosen = planned_modes(tc, tensors, n, platform)
    return {k: ("word" if chosen[k] == "word" else "exponent") if compress[k] else NO_CACHE
            for k in tensors}


def planned_modes(tc, tensors: dict, n: int, platform: str) -> dict[str, str]:
    """``planner.plan_modes`` for the trainer's tensors: plain / exponent / word per tensor
    within the cache budget. A stacked tensor is priced as one tensor of all its layers'
    elements, so its cache bytes (every layer's) count against the budget exactly."""
    tree = {k: jax.ShapeDtypeStruct(((t.stack or 1) * math.prod(t.shape),), t.dtype)
            for k, t in tensors.items()}
    return planner.plan_modes(tree, n, tc.profile or default_profile(platform),
                              cache_budget_bytes=cache_budget_bytes(tc, n, platform))


@functools.lru_cache(maxsize=32)
def _say_once(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def memory_gb(tc, platform: str) -> float | None:
    """The memory a plan works in, per device: ``--memory-gb``, or an accelerator's own (what
    its allocator may hold); None on CPU without ``--memory-gb``."""
    if tc.memory_gb is not None or platform == "cpu":
        return tc.memory_gb
    # this process's device: jax.devices()[0] is process 0's on a pod
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit", 0) / memory.GB or None


def cache_budget_bytes(tc, n: int, platform: str) -> float | None:
    """Bytes per device the caches may hold: ``--memory-gb`` (or an accelerator's own memory)
    less ``planner.HEADROOM_GB`` and what the memory model says the training state, gathered
    layers and activations need under ``--remat``; None (unlimited) on CPU without
    ``--memory-gb``. When even no cache would fit, one line on stderr says so (and what
    would fit) before the step compiles."""
    gb = memory_gb(tc, platform)
    if gb is None:
        return None
    tokens = tc.batch_size * tc.length // n
    advice = planner.fit_advice(tc.model, n, gb, tokens, tc.remat)
    if advice:  # before any compile: the step would not fit, whatever the caches
        _say_once(f"ciera: {advice}")
    mem = memory.memory_per_gpu(tc.model, n, tokens_per_gpu=tokens, remat=tc.remat)
    return planner.cache_budget(gb, mem, f" of {tc.config} on {n} devices",
                                headroom_gb=planner.HEADROOM_GB)


def choose_compressed(tc, tensors: dict, n: int, platform: str) -> tuple[dict, str]:
    """Compress-or-plain per gathered tensor (``tc``: a TrainConfig, read for ``plan`` and
    ``profile``; ``tensors``: ``fsdp.gathered_tensors``). Returns ``({key: bool}, one-line
    summary)``."""
    if tc.plan not in PLANS:
        raise ValueError(f"unknown plan {tc.plan!r}; choose one of: {', '.join(PLANS)}")
    profile = tc.profile or default_profile(platform)
    tree = {f"{k}#{layer}": jax.ShapeDtypeStruct(t.shape, t.dtype)
            for k, t in tensors.items() for layer in range(t.stack or 1)}
    decided = planner.plan_tree(tree, n, profile)
    by_cost = {k: decided[f"{k}#0"] for k in tensors}
    size = {k: math.prod(t.shape) * (t.stack or 1) for k, t in tensors.items()}
    budget = None
    if tc.cache == "auto" and tc.gather == "ciera":  # the modes the trainer would run
        modes = planned_modes(tc, tensors, n, platform)
        budget = cache_budget_bytes(tc, n, platform)
        if budget is None:
            by_cost = {k: by_cost[k] or modes[k] != "plain" for k in tensors}
        else:  # within a memory budget the budgeted planner alone decides
            by_cost = {k: modes[k] != "plain" for k in tensors}
    forced = {k: tc.plan == "all" or (tc.plan == "auto"
                                       and bool(EXPERT_WEIGHT.fullmatch(k.rsplit("/", 1)[-1])))
              for k in tensors}
    left_out = 0
    if budget is not None:  # a forced tensor gets an exponent cache only while it fits
        used = sum(size[k] * memory.CACHE_BYTES["word" if modes[k] == "word" else "exponent"]
                   for k in tensors if by_cost[k])
        for k in sorted(tensors, key=size.get):
            if forced[k] and not by_cost[k]:
                need = size[k] * memory.CACHE_BYTES["exponent"]
                forced[k] = used + need <= budget
                used += need if forced[k] else 0
                left_out += not forced[k]
    compress = {k: bool(by_cost[k] or forced[k]) for k in tensors}
    frac = sum(size[k] for k in tensors if compress[k]) / max(sum(size.values()), 1)
    n_cost = sum(by_cost.values())
    n_forced = sum(1 for k in tensors if compress[k] and not by_cost[k])
    summary = (f"plan: profile={getattr(planner.clusters.get_link(profile), 'name', profile)} "
               f"ranks={n} --plan {tc.plan}: compress {sum(compress.values())}/{len(tensors)} "
               f"tensors ({100 * frac:.1f}% of gathered bytes): {n_cost} by the cost model"
               + (f", {n_forced} forced ({'expert weights' if tc.plan == 'auto' else 'all'})"
                  if n_forced else "")
               + (f", {left_out} left plain (no room in the memory budget)" if left_out else ""))
    return compress, summary

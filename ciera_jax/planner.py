"""Compress only where it pays: per-tensor decisions from the cost model.

A tensor is gathered with CIERA when the cost model predicts ``t_ciera < t_plain`` on the
given link. Small tensors (norms, routers, biases) stay plain: the per-gather latency, the
codec launch and the agreement share eat the byte saving. Dtypes other than bfloat16 and
float32 always stay plain (the codec has no layout for them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Union

import numpy as np

from ciera_jax import costmodel as cm

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


def plan_tensor(spec_or_shape: Any, dtype: Any, N: int, profile: Union[str, cm.Link],
                change_rate: float, agreement_share_s: float | None = None,
                patch_bytes: int = cm.PATCH_BYTES) -> Decision:
    """Decide one tensor. ``spec_or_shape`` is a :class:`ciera_jax.shapes.TensorSpec` or a shape."""
    link = profile if isinstance(profile, cm.Topology) else cm.get_profile(profile)
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
    tc = cm.t_ciera(n, N, payload, change_rate, link, patch_bytes, agreement_share_s)
    cost = cm.gather_cost("ciera", n, N, b, link, change_rate, patch_bytes)
    if cost.fallback:
        return Decision(False, tp, tc, "change rate above the top patch tier: plain", **meta)
    if tc < tp:
        return Decision(True, tp, tc, f"saves {(tp - tc) * 1e6:.1f} us", **meta)
    return Decision(False, tp, tc, "latency + codec overhead exceeds the byte saving", **meta)


def _rate(trace: Any, kind: str) -> float:
    if trace is None:
        from ciera_jax.sim.trace import default_trace
        trace = default_trace()
    if isinstance(trace, (int, float)):
        return float(trace)
    if hasattr(trace, "rate"):
        return trace.rate(kind)
    if isinstance(trace, Mapping):
        return float(trace.get(kind, trace.get("default", 1e-3)))
    raise TypeError(f"trace must be a number, a mapping kind->rate or a Trace, not {type(trace)}")


def plan_model(cfg: Any, N: int, profile: Union[str, cm.Link], trace: Any = None,
               dtype: Any = "bfloat16") -> list[Decision]:
    """One decision per tensor of ``tensor_inventory(cfg)`` (``cfg`` a ModelConfig or its name).

    ``trace`` gives the per-kind exponent change rate per step: a number, a mapping
    ``{kind: rate}``, a :class:`ciera_jax.sim.trace.Trace`, or None for the shipped default.
    The single per-step agreement collective is shared evenly by all tensors.
    """
    from ciera_jax.shapes import get_config, tensor_inventory

    if isinstance(cfg, str):
        cfg = get_config(cfg)
    link = profile if isinstance(profile, cm.Topology) else cm.get_profile(profile)
    inv = tensor_inventory(cfg)
    share = cm.agreement_time(N, link) / max(len(inv), 1)
    return [plan_tensor(t, dtype, N, link, _rate(trace, t.kind), share) for t in inv]


def plan_tree(params_tree: Any, axis_size: int, profile: Union[str, cm.Link],
              change_rate: float = 1e-3) -> Any:
    """A pytree of bools matching ``params_tree`` (leaves: arrays or ShapeDtypeStructs): True
    where the leaf should go through the compressed gather. Non-codec dtypes are False."""
    import jax

    link = profile if isinstance(profile, cm.Topology) else cm.get_profile(profile)
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

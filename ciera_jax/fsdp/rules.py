"""Which axis of each weight is split over the ``fsdp`` mesh axis: the rule table and how a
parameter's ``fsdp_axis`` metadata overrides it. The single source of the sharding policy."""

from __future__ import annotations

import re

from flax import nnx
from jax.sharding import PartitionSpec as P


AXIS = "fsdp"

# The whole FSDP policy of models/, one row per weight family: which axis is split over `fsdp`.
# Every matrix is split along its d_model (D) axis: D is present in every weight, the same for
# all of them, and divisible by the usual mesh sizes in every config (expert counts such as 60
# are not). Vectors (norms, biases) are small and stay replicated.
RULES: tuple[tuple[str, int | None], ...] = (
    (r"embed_VxD", 1),
    (r"head_DxV", 0),
    (r"w[qkv]_Dx[DK]", 0),
    (r"wo_DxD", 1),
    (r"(shared_)?router_Dx[E1]", 0),
    (r"w_(gate|up)_ExDxF", 1),
    (r"w_down_ExFxD", 2),
    (r"(shared|dense)_(gate|up)_Dx[SF]", 0),
    (r"(shared|dense)_down_[SF]xD", 1),
    (r".*", None),  # norms, biases, anything else: replicated
)


def rule_axis(name: str, rules=RULES) -> int | None:
    """The axis of weight ``name`` split over ``fsdp`` (None: replicated), by the first matching rule."""
    for pattern, axis in rules:
        if re.fullmatch(pattern, name):
            return axis
    return None


def param_axis(name: str, var: nnx.Variable, rules=RULES) -> int | None:
    """A parameter's ``fsdp_axis`` metadata wins over the rule table."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    if "fsdp_axis" in meta:
        return meta["fsdp_axis"]
    return rule_axis(name, rules)


def spec_for(axis: int | None, ndim: int, axis_name: str = AXIS) -> P:
    if axis is None:
        return P()
    return P(*([None] * axis + [axis_name] + [None] * (ndim - axis - 1)))


def check_divisible(name: str, shape: tuple[int, ...], axis: int | None, n: int) -> None:
    if axis is not None and shape[axis] % n:
        raise ValueError(
            f"mesh size fsdp={n} does not divide dimension {axis} (size {shape[axis]}) of "
            f"weight {name} {tuple(shape)}; choose a device count that divides it")


def _sharded_params(module: nnx.Module, rules) -> list[tuple[str, nnx.Param, int]]:
    out = []
    for name, var in vars(module).items():
        if isinstance(var, nnx.Param):
            axis = param_axis(name, var, rules)
            if axis is not None:
                out.append((name, var, axis))
    return out

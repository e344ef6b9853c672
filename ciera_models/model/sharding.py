"""The FSDP policy of models/: which axis of each weight is split over the ``fsdp`` mesh axis,
one row per weight family, passed to every ``@gathered`` of the model.

Every matrix is split along its d_model (D) axis: D is present in every weight, the same for
all of them, and divisible by the usual mesh sizes in every config (expert counts such as 60
are not). Vectors (norms, biases) are small and stay replicated without a rule.
"""

# (weight name, split axis); a decoder layer gathers its attention's and MLP's weights, so
# the rules match the name below any sub-module path (``attn/wq_DxD``).
WEIGHT_AXES: tuple[tuple[str, int | None], ...] = (
    (r"embed_VxD", 1),
    (r"head_DxV", 0),
    (r"w[qkv]_Dx[DK]", 0),
    (r"wo_DxD", 1),
    (r"(shared_)?router_Dx[E1]", 0),
    (r"w_(gate|up)_ExDxF", 1),
    (r"w_down_ExFxD", 2),
    (r"(shared|dense)_(gate|up)_Dx[SF]", 0),
    (r"(shared|dense)_down_[SF]xD", 1),
)
RULES: tuple[tuple[str, int | None], ...] = tuple(
    (rf"(?:.+/)?{name}", axis) for name, axis in WEIGHT_AXES)

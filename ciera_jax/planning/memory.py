"""What one GPU holds during FSDP training, per part: the memory half of the cost model.

A CIERA cache is the *full* tensor on every rank of the gather group (exponent mode 1 B per
element, word mode the whole word, 2 B for bf16) and does not shrink as GPUs are added, while
FSDP's own state (float32 master weights, AdamW's two float32 moments, float32 gradients: 16 B
per parameter, all sharded) does. So the planner must count caches against the device memory.

Per GPU, for a config, ``N`` ranks on the fsdp axis and a plan (``{(layer, name): mode}``):

    params       float32 shards of every sharded weight, replicated weights (norms) in full
    optimizer    AdamW: two float32 moments shaped like params + two int32 step counters
    gradients    float32, shaped like params
    caches       per mode: exponent 1 B/element, word and "plain-noreshard" (FSDP that keeps the
                 gathered weights from forward to backward) 2 B/element (the bf16 word), full
                 size; + a 1-byte ``primed`` flag per tensor and layer. A word cache is also
                 what ``ciera train``'s backward reads (no second copy, no backward gather:
                 ``tests/test_word_backward.py`` measures the compiled step against this)
    gathered     weight-shaped transients (:func:`layer_transient_bytes`): the bf16 full weights
                 of the layer in use, ``prefetch`` layers ahead and the backward's; one layer's
                 float32 gradient before its reduce-scatter; the float32 gradient the experts'
                 blocked matmul accumulates; twice, for XLA's while-loop double buffering
    activations  per remat policy (``full``, ``save_dot_except_mlp``, ``none``, as ``ciera
                 train --remat``) for ``tokens_per_gpu`` tokens: what the layer scan saves of
                 every layer, one layer's working set (its recompute and backward: the top-k
                 copies' float32 rows dominate an MoE layer), and the loss's float32 logits;
                 derived from the shapes, with cuDNN's fused attention (no L x L scores) and
                 the blocked experts' matmul (no experts x rows buffer)

params, optimizer and caches are exact (tested against JAX's array sizes); gathered and
activations are estimates. XLA's own count of the compiled step (``ciera aot``) is elastic:
the latency-hiding scheduler keeps buffers live longer to overlap collectives while the step
stays under its memory limit (a share of the GPU less the inputs), so the same step counts more
with the default limit than with a tighter one. With this model's total as its limit
(``gpu_targets.plan_slop_percent``) XLA's count stays close to this one (docs/results.md,
section 7, "Memory"); ``ciera train`` and ``ciera aot`` set that limit only where XLA's own
schedule would not fit the GPU (``ciera_models.train.memory_limit``): this model counts what a
step needs, not the room XLA takes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

from ciera_jax.runtime.partition import rule_axis
from ciera_jax.planning.shapes import ModelConfig, TensorSpec, get_config, tensor_inventory

MASTER_BYTES = 4  # float32 master weights, moments and gradients
GATHER_BYTES = 2  # the gathered (computed-with) dtype, bfloat16
OPT_MOMENTS = 2  # AdamW: mu, nu
OPT_COUNTER_BYTES = 8  # int32 step counts of scale_by_adam and the learning-rate schedule
CACHE_FLAG_BYTES = 1  # a cache's bool ``primed``, one per tensor and layer
# cache bytes per element of the gathered (bf16) tensor, by mode
CACHE_BYTES = {"plain": 0, "exponent": 1, "word": GATHER_BYTES, "plain-noreshard": GATHER_BYTES}
MODES = tuple(CACHE_BYTES)
GB = 1e9

Key = tuple  # (layer or None, tensor name)


def key(t: TensorSpec) -> Key:
    return (t.layer, t.name)


def gathered(t: TensorSpec) -> bool:
    """Is ``t`` sharded over fsdp (and so gathered)? Vectors (norms, biases) stay replicated."""
    return rule_axis(t.name) is not None


def shard_elems(t: TensorSpec, N: int) -> int:
    """Elements of ``t`` one rank holds: its share of the split axis, or all of a replicated one."""
    axis = rule_axis(t.name)
    if axis is None:
        return t.size
    return t.size // t.shape[axis] * math.ceil(t.shape[axis] / N)


def cache_bytes(t: TensorSpec, mode: str) -> int:
    """Bytes of ``t``'s cache in ``mode`` on every rank (0 for plain and replicated tensors)."""
    if mode not in CACHE_BYTES:
        raise ValueError(f"unknown mode {mode!r} for tensor {t.name}; choose one of: "
                         f"{', '.join(MODES)}")
    if not CACHE_BYTES[mode] or not gathered(t):
        return 0
    return t.size * CACHE_BYTES[mode] + CACHE_FLAG_BYTES


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per GPU, by part. ``caches`` maps mode -> bytes (modes with none are absent)."""

    params: int
    optimizer: int
    gradients: int
    caches: dict
    gathered: int
    activations: int

    @property
    def state(self) -> int:
        """What FSDP training needs before any cache: params, optimizer state, gradients."""
        return self.params + self.optimizer + self.gradients

    @property
    def cache(self) -> int:
        return sum(self.caches.values())

    @property
    def total(self) -> int:
        return self.state + self.cache + self.gathered + self.activations

    def rows(self) -> list[tuple[str, int]]:
        """(part, bytes) in print order."""
        out = [("params (float32 shards)", self.params),
               ("optimizer (AdamW moments)", self.optimizer),
               ("gradients (float32 shards)", self.gradients)]
        out += [(f"cache: {m}", b) for m, b in self.caches.items()]
        out += [("layer transients (bf16 weights, f32 gradients)", self.gathered),
                ("activations (estimate)", self.activations), ("total", self.total)]
        return out

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "state": self.state, "cache": self.cache,
                "total": self.total}


def _mode_of(modes: Mapping | Callable | str | None) -> Callable[[TensorSpec], str]:
    if modes is None:
        return lambda t: "plain"
    if isinstance(modes, str):
        return lambda t: modes
    if callable(modes):
        return modes
    return lambda t: modes.get(key(t), "plain")


def _layer_groups(cfg: ModelConfig) -> list[list[TensorSpec]]:
    """The weights gathered together: embed, each layer, head."""
    inv = tensor_inventory(cfg)
    glob = [t for t in inv if t.layer is None]
    layers: dict[int, list] = {}
    for t in inv:
        if t.layer is not None:
            layers.setdefault(t.layer, []).append(t)
    return ([[t for t in glob if t.kind == "embed"]] + list(layers.values())
            + [[t for t in glob if t.kind != "embed"]])


REMAT_POLICIES = ("full", "save_dot_except_mlp", "none")  # as ``ciera train --remat`` names them
RESIDUAL_BYTES = 4  # the residual stream, norms, matmul outputs and softmaxes are float32


def _policy(remat: bool | str) -> str:
    """``remat`` as a policy name (True: ``full``, False: ``none``, the older booleans)."""
    if remat is True or remat is False:
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; choose one of: "
                         f"{', '.join(REMAT_POLICIES)}")
    return remat


def _moe(cfg: ModelConfig, layer: int) -> bool:
    return layer >= cfg.n_dense_layers


def saved_bytes_per_token(cfg: ModelConfig, layer: int, remat: bool | str = "full") -> int:
    """What the layer scan's forward keeps of one layer per token for its backward.

    ``full``: the layer's input (float32). ``save_dot_except_mlp``: also the attention's q, k,
    v and output projections (float32 matmul outputs). ``none``: every residual the layer's
    autodiff keeps: normed inputs, projections, rotated q / k (bf16), the attention's output,
    and the MoE's router logits and probabilities, the sorted bf16 inputs of the experts, their
    float32 gate / up outputs and bf16 product, their float32 outputs in both orders."""
    policy = _policy(remat)
    D, K, R = cfg.d_model, cfg.kv_dim, RESIDUAL_BYTES
    saved = R * D
    if policy == "full":
        return saved
    proj = R * (2 * D + 2 * K)  # q, k, v, out
    if policy == "save_dot_except_mlp":
        return saved + proj
    attn = R * D + proj + GATHER_BYTES * (2 * D + 2 * K)  # normed x; q, k rotated, v; out
    if not _moe(cfg, layer):
        F = cfg.d_dense
        return saved + attn + R * D + R * 2 * F + GATHER_BYTES * F
    k, F, E = cfg.top_k, cfg.d_expert, cfg.n_experts
    mlp = R * D + 2 * R * E + k * (GATHER_BYTES * D + 2 * R * F + GATHER_BYTES * F + 2 * R * D)
    if cfg.n_shared_experts:
        mlp += 2 * R * cfg.d_shared + GATHER_BYTES * cfg.d_shared
    return saved + attn + mlp


def working_bytes_per_token(cfg: ModelConfig) -> int:
    """One layer's forward again and its backward, per token: what is live at once beyond the
    saved activations (the largest layer). A routed layer: the top-k copies' float32 outputs
    and their gradients (``[A, D]``: outputs in expert and in token order, their cotangents,
    the two input gradients of the gate and up matmuls), the float32 gate / up outputs and
    their gradients (``[A, F]``: four, and the product's), the sorted bf16 inputs; the
    attention's float32 q, k, v, out and their gradients."""
    D, K, R = cfg.d_model, cfg.kv_dim, RESIDUAL_BYTES
    attn = 2 * R * (2 * D + 2 * K) + 3 * R * D
    if cfg.n_layers <= cfg.n_dense_layers:
        return attn + 6 * R * cfg.d_dense
    k, F = cfg.top_k, cfg.d_expert
    moe = k * (5 * R * D + 5 * R * F + GATHER_BYTES * (D + F))
    dense = 6 * R * cfg.d_dense if cfg.n_dense_layers else 0
    return attn + max(moe, dense)


def loss_bytes_per_token(cfg: ModelConfig) -> int:
    """The head's float32 logits, their log-softmax and its gradient."""
    return 3 * MASTER_BYTES * cfg.vocab_size


def activations(cfg: ModelConfig, tokens_per_gpu: int, remat: bool | str = "full") -> int:
    """Activation bytes for ``tokens_per_gpu`` tokens under the remat policy (True: ``full``,
    False: ``none``): every layer's saved activations, one layer's working set, the loss's."""
    saved = sum(saved_bytes_per_token(cfg, l, remat) for l in range(cfg.n_layers))
    per_token = saved + working_bytes_per_token(cfg) + loss_bytes_per_token(cfg)
    return int(tokens_per_gpu * per_token)


def layer_transient_bytes(cfg: ModelConfig, prefetch: int = 1, loop_copies: int = 2) -> int:
    """Weight-shaped buffers of the layers being computed: the bf16 full weights of the layer
    in use, ``prefetch`` layers ahead and the backward's regathered one; the float32 gradient
    of a layer before its reduce-scatter; the float32 gradient the experts' blocked matmul
    accumulates for one expert tensor. ``loop_copies``: XLA:GPU's while-loop double buffering
    (on in the FSDP flags ``ciera aot`` compiles with) unrolls the layer scan by two, so two
    layers' bf16 weights are live; the float32 gradients are not doubled (XLA's count of
    Mixtral-8x7B on 128 H100s stays below a model that doubles them, at any scheduler
    limit)."""
    groups = _layer_groups(cfg)
    biggest = max(sum(t.size for t in g if gathered(t)) for g in groups)
    experts = [t.size for t in tensor_inventory(cfg) if t.kind.startswith("expert_")]
    carry = max(experts, default=0) * MASTER_BYTES
    return (loop_copies * (prefetch + 2) * biggest * GATHER_BYTES + biggest * MASTER_BYTES
            + carry)


def memory_per_gpu(cfg: ModelConfig | str, N: int, modes: Mapping | Callable | str | None = None,
                   *, tokens_per_gpu: int = 4096, remat: bool | str = "full",
                   prefetch: int = 1, loop_copies: int = 2) -> Memory:
    """Memory of one GPU training ``cfg`` with FSDP over ``N`` ranks; ``modes`` gives each
    tensor's gather mode (a mapping ``{(layer, name): mode}``, a function of the TensorSpec, one
    mode for all, or None: all plain)."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    if N < 1:
        raise ValueError(f"GPU count must be positive, got {N}")
    if tokens_per_gpu < 0 or prefetch < 0:
        raise ValueError("tokens_per_gpu and prefetch must be non-negative")
    mode_of = _mode_of(modes)
    inv = tensor_inventory(cfg)
    params = sum(shard_elems(t, N) for t in inv) * MASTER_BYTES
    caches: dict[str, int] = {}
    for t in inv:
        m = mode_of(t)
        c = cache_bytes(t, m)
        if c:
            caches[m] = caches.get(m, 0) + c
    return Memory(params=params, optimizer=OPT_MOMENTS * params + OPT_COUNTER_BYTES,
                  gradients=params, caches=caches,
                  gathered=layer_transient_bytes(cfg, prefetch, loop_copies),
                  activations=activations(cfg, tokens_per_gpu, remat))


def fmt_gb(b: float) -> str:
    return f"{b / GB:.2f}"

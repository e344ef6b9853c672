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
    gathered     transient bf16 full weights: the layer being computed, ``prefetch`` layers
                 ahead, and the full cotangent of one layer before its reduce-scatter
    activations  an estimate for ``tokens_per_gpu`` tokens: with rematerialization the layer
                 inputs of every layer + one layer's internals; without, every layer's internals
                 (bf16, flash attention: no seq x seq scores) + float32 logits

params, optimizer and caches are exact (tested against JAX's array sizes); gathered and
activations are estimates that ignore XLA's buffer reuse and fragmentation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

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
        out += [("gathered layers (transient, bf16)", self.gathered),
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


def activation_bytes_per_token(cfg: ModelConfig, layer: int) -> int:
    """Saved activations of one layer per token without remat, bf16 (an estimate)."""
    D, K = cfg.d_model, cfg.kv_dim
    attn = 4 * D + 2 * K  # input, normed input, q, attention output (+ k, v); no scores
    if layer < cfg.n_dense_layers:
        mlp = 2 * D + 3 * cfg.d_dense
    else:
        mlp = 2 * D + cfg.top_k * (D + 3 * cfg.d_expert) + 2 * cfg.n_experts  # + router f32
        if cfg.n_shared_experts:
            mlp += 3 * cfg.d_shared
    return GATHER_BYTES * (attn + mlp)


def activations(cfg: ModelConfig, tokens_per_gpu: int, remat: bool = True) -> int:
    """Activation estimate for ``tokens_per_gpu`` tokens (see the module docstring)."""
    per_layer = [activation_bytes_per_token(cfg, l) for l in range(cfg.n_layers)]
    logits = MASTER_BYTES * cfg.vocab_size
    if remat:
        per_token = cfg.n_layers * GATHER_BYTES * cfg.d_model + max(per_layer) + logits
    else:
        per_token = sum(per_layer) + logits
    return int(tokens_per_gpu * per_token)


def memory_per_gpu(cfg: ModelConfig | str, N: int, modes: Mapping | Callable | str | None = None,
                   *, tokens_per_gpu: int = 4096, remat: bool = True,
                   prefetch: int = 1) -> Memory:
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
    biggest = max(sum(t.size for t in g if gathered(t)) for g in _layer_groups(cfg))
    return Memory(params=params, optimizer=OPT_MOMENTS * params + OPT_COUNTER_BYTES,
                  gradients=params, caches=caches,
                  gathered=(prefetch + 2) * biggest * GATHER_BYTES,
                  activations=activations(cfg, tokens_per_gpu, remat))


def fmt_gb(b: float) -> str:
    return f"{b / GB:.2f}"

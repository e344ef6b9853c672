"""Model shapes the planner, the memory model and the simulator price: named MoE configs and
the tensor inventory they imply.

The inventory (name, shape, kind of every weight) is the single source the Flax model in
``ciera_models/``, the planner and the simulator all read, so parameter counts cannot drift between
them. The library owns the shapes; the model that trains on them lives in ``ciera_models/``.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_experts: int
    top_k: int
    d_expert: int  # hidden width of one routed expert
    n_shared_experts: int = 0
    d_shared: int = 0  # hidden width of the shared-expert MLP (all shared experts fused)
    shared_expert_gate: bool = False  # Qwen-style sigmoid gate on the shared expert
    n_dense_layers: int = 0  # leading layers with a dense MLP instead of MoE (DeepSeek)
    d_dense: int = 0
    qk_norm: bool = True
    qkv_bias: bool = False
    seq_len: int = 4096
    rope_theta: float = 10000.0
    published_total_params: float | None = None  # from the model card, for the tests
    published_active_params: float | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One weight: ``layer`` is None for global tensors (embedding, head, final norm)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # embed | head | norm | attention | router | expert_up | expert_gate | expert_down | shared | dense
    layer: int | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def layer_tensors(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """The weights of one decoder layer, in execution order."""
    D, H = cfg.d_model, cfg.kv_dim
    t = [
        TensorSpec("attn_norm", (D,), "norm", layer),
        TensorSpec("wq_DxD", (D, D), "attention", layer),
        TensorSpec("wk_DxK", (D, H), "attention", layer),
        TensorSpec("wv_DxK", (D, H), "attention", layer),
        TensorSpec("wo_DxD", (D, D), "attention", layer),
    ]
    if cfg.qkv_bias:
        t += [TensorSpec("bq_D", (D,), "norm", layer), TensorSpec("bk_K", (H,), "norm", layer),
              TensorSpec("bv_K", (H,), "norm", layer)]
    if cfg.qk_norm:
        t += [TensorSpec("q_norm", (D,), "norm", layer), TensorSpec("k_norm", (H,), "norm", layer)]
    t.append(TensorSpec("mlp_norm", (D,), "norm", layer))
    if layer < cfg.n_dense_layers:
        F = cfg.d_dense
        return t + [TensorSpec("dense_gate_DxF", (D, F), "dense", layer),
                    TensorSpec("dense_up_DxF", (D, F), "dense", layer),
                    TensorSpec("dense_down_FxD", (F, D), "dense", layer)]
    E, F = cfg.n_experts, cfg.d_expert
    t += [
        TensorSpec("router_DxE", (D, E), "router", layer),
        TensorSpec("w_gate_ExDxF", (E, D, F), "expert_gate", layer),
        TensorSpec("w_up_ExDxF", (E, D, F), "expert_up", layer),
        TensorSpec("w_down_ExFxD", (E, F, D), "expert_down", layer),
    ]
    if cfg.n_shared_experts:
        S = cfg.d_shared
        t += [TensorSpec("shared_gate_DxS", (D, S), "shared", layer),
              TensorSpec("shared_up_DxS", (D, S), "shared", layer),
              TensorSpec("shared_down_SxD", (S, D), "shared", layer)]
        if cfg.shared_expert_gate:
            t.append(TensorSpec("shared_router_Dx1", (D, 1), "router", layer))
    return t


def global_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    D, V = cfg.d_model, cfg.vocab_size
    return [TensorSpec("embed_VxD", (V, D), "embed"), TensorSpec("final_norm", (D,), "norm"),
            TensorSpec("head_DxV", (D, V), "head")]


def tensor_inventory(cfg: ModelConfig) -> list[TensorSpec]:
    out = global_tensors(cfg)
    for layer in range(cfg.n_layers):
        out += layer_tensors(cfg, layer)
    return out


def total_params(cfg: ModelConfig) -> int:
    return sum(t.size for t in tensor_inventory(cfg))


CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        # allenai/OLMoE-1B-7B-0924: 6.92B total, 1.28B active.
        ModelConfig(name="olmoe-1b-7b", vocab_size=50304, d_model=2048, n_layers=16,
                    n_heads=16, n_kv_heads=16, n_experts=64, top_k=8, d_expert=1024,
                    published_total_params=6.92e9, published_active_params=1.28e9),
        # mistralai/Mixtral-8x7B-v0.1: 46.7B total, 12.9B active; GQA with 8 KV heads.
        ModelConfig(name="mixtral-8x7b", vocab_size=32000, d_model=4096, n_layers=32,
                    n_heads=32, n_kv_heads=8, n_experts=8, top_k=2, d_expert=14336,
                    qk_norm=False, rope_theta=1e6, published_total_params=46.7e9,
                    published_active_params=12.9e9),
        # deepseek-ai/deepseek-moe-16b-base: 16.4B total, 2.8B active; 2 shared experts,
        # first layer dense.
        ModelConfig(name="deepseek-moe-16b", vocab_size=102400, d_model=2048, n_layers=28,
                    n_heads=16, n_kv_heads=16, n_experts=64, top_k=6, d_expert=1408,
                    n_shared_experts=2, d_shared=2 * 1408, n_dense_layers=1, d_dense=10944,
                    qk_norm=False, published_total_params=16.4e9, published_active_params=2.8e9),
        # Qwen/Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B active; shared expert with sigmoid gate.
        ModelConfig(name="qwen1.5-moe-a2.7b", vocab_size=151936, d_model=2048, n_layers=24,
                    n_heads=16, n_kv_heads=16, n_experts=60, top_k=4, d_expert=1408,
                    n_shared_experts=1, d_shared=5632, shared_expert_gate=True, qk_norm=False,
                    qkv_bias=True, published_total_params=14.3e9, published_active_params=2.7e9),
        # Trains on 2 CPU cores at about a step per second.
        ModelConfig(name="tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                    n_kv_heads=4, n_experts=8, top_k=2, d_expert=64, seq_len=64),
        # A few times larger, for the exponent-stability study.
        ModelConfig(name="small", vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                    n_kv_heads=4, n_experts=16, top_k=4, d_expert=128, seq_len=128),
    ]
}


def get_config(name: str) -> ModelConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown config {name!r}; choose one of: {', '.join(CONFIGS)}") from None

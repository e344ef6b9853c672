"""OLMoE-style decoder in Flax NNX: attention with RoPE/QK-norm, dropless MoE FFN every layer.

Parameter names and per-layer shapes are exactly ``models.configs.tensor_inventory`` (names
carry their shapes: ``w_gate_ExDxF``); the decoder layers are stacked on a leading layer axis
and run with ``lax.scan``. Parameters are float32; every layer is ``@gathered`` with the rule
table of :mod:`models.sharding`: inside ``shard_map`` over ``fsdp`` it casts its float32
shards to bfloat16 and all-gathers them just before use (CIERA, plain or int8, see
``ciera_jax.fsdp``). Matmuls take bf16 operands and accumulate in float32; the residual
stream, norms, softmaxes and losses are float32.

Activation names carry shapes too: B batch, L sequence, D model, H heads, K kv heads,
Q head dim, E experts, F expert hidden, T tokens (B*L), A assignments (T*top_k).

The attention's projections are tagged with MaxText's checkpoint names (``query_proj``,
``key_proj``, ``value_proj``, ``out_proj``), which a remat policy may save
(:mod:`ciera_jax.fsdp.remat`); the attention itself is ``jax.nn.dot_product_attention``
with the implementation the trainer names (:data:`ATTENTIONS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ciera_jax import fsdp
from ciera_jax.fsdp import gathered
from ciera_models.model.configs import ModelConfig
from ciera_models.model.grouped_matmul import grouped_matmul
from ciera_models.model.sharding import RULES

BF16, F32 = jnp.bfloat16, jnp.float32
INIT_STD = 0.02
# jax.nn.dot_product_attention's implementations: XLA's (any platform: materializes the
# B x H x L x L scores) or cuDNN's fused flash attention (GPU only).
ATTENTIONS = ("xla", "cudnn")
# The experts' grouped matmul: lax.ragged_dot (XLA:GPU densifies it over every expert: float32
# buffers of experts x rows per layer) or ciera_models.model.grouped_matmul's loop over blocks
# of rows (bounded on GPU).
EXPERTS_MATMULS = ("ragged", "blocked")


def rms_norm(x, scale, eps: float = 1e-6):
    x = x.astype(F32)
    x = x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return x * scale.astype(F32)


def mm(x, w):
    """bf16 x bf16 -> f32 matmul over the last axis of x and the first of w."""
    return jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=F32)


def rope(x_BxLxHxQ, positions_L, theta: float):
    half = x_BxLxHxQ.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=F32) / half)
    ang_LxQ2 = positions_L.astype(F32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(ang_LxQ2)[None, :, None, :], jnp.cos(ang_LxQ2)[None, :, None, :]
    x1, x2 = x_BxLxHxQ[..., :half], x_BxLxHxQ[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _param(rngs: nnx.Rngs, shape, std=INIT_STD):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, F32))


def _ones(shape):
    return nnx.Param(jnp.ones(shape, F32))


def _zeros(shape):
    return nnx.Param(jnp.zeros(shape, F32))


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embed_VxD = _param(rngs, (cfg.vocab_size, cfg.d_model))

    @gathered(rules=RULES)
    def __call__(self, tokens_BxL):
        return jnp.take(self.embed_VxD[...], tokens_BxL, axis=0).astype(F32)


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.final_norm = _ones((cfg.d_model,))
        self.head_DxV = _param(rngs, (cfg.d_model, cfg.vocab_size))

    @gathered(rules=RULES)
    def __call__(self, x_BxLxD):
        return mm(rms_norm(x_BxLxD, self.final_norm[...]), self.head_DxV[...])


def attention(q_BxLxHxQ, k_BxLxKxQ, v_BxLxKxQ, implementation: str):
    """Causal (grouped-query) attention of bf16 operands: ``jax.nn.dot_product_attention``,
    scores and softmax in float32 (both implementations), output bf16."""
    if implementation not in ATTENTIONS:
        raise ValueError(f"unknown attention {implementation!r}; choose one of: "
                         f"{', '.join(ATTENTIONS)}")
    return jax.nn.dot_product_attention(
        q_BxLxHxQ.astype(BF16), k_BxLxKxQ.astype(BF16), v_BxLxKxQ.astype(BF16),
        is_causal=True, implementation=implementation)


class Attention(nnx.Module):
    """Pre-norm multi-head / grouped-query attention with RoPE; returns the residual update.
    ``implementation``: :data:`ATTENTIONS` (a static field: part of the graph definition)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, implementation: str = "xla"):
        D, K = cfg.d_model, cfg.kv_dim
        out_std = INIT_STD / (2 * cfg.n_layers) ** 0.5
        self.cfg = cfg
        self.implementation = implementation
        self.attn_norm = _ones((D,))
        self.wq_DxD = _param(rngs, (D, D))
        self.wk_DxK = _param(rngs, (D, K))
        self.wv_DxK = _param(rngs, (D, K))
        self.wo_DxD = _param(rngs, (D, D), out_std)
        if cfg.qkv_bias:
            self.bq_D, self.bk_K, self.bv_K = _zeros((D,)), _zeros((K,)), _zeros((K,))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _ones((D,)), _ones((K,))

    def __call__(self, x_BxLxD, positions_L):
        cfg = self.cfg
        B, L, _ = x_BxLxD.shape
        H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h = rms_norm(x_BxLxD, self.attn_norm[...])
        q = checkpoint_name(mm(h, self.wq_DxD[...]), "query_proj")
        k = checkpoint_name(mm(h, self.wk_DxK[...]), "key_proj")
        v = checkpoint_name(mm(h, self.wv_DxK[...]), "value_proj")
        if cfg.qkv_bias:
            q, k, v = q + self.bq_D[...], k + self.bk_K[...], v + self.bv_K[...]
        if cfg.qk_norm:
            q, k = rms_norm(q, self.q_norm[...]), rms_norm(k, self.k_norm[...])
        q_BxLxHxQ = rope(q.reshape(B, L, H, Q), positions_L, cfg.rope_theta)
        k_BxLxKxQ = rope(k.reshape(B, L, K, Q), positions_L, cfg.rope_theta)
        v_BxLxKxQ = v.reshape(B, L, K, Q)
        o_BxLxHxQ = attention(q_BxLxHxQ, k_BxLxKxQ, v_BxLxKxQ, self.implementation)
        return checkpoint_name(mm(o_BxLxHxQ.reshape(B, L, H * Q), self.wo_DxD[...]), "out_proj")


def swiglu(h, w_gate, w_up, w_down):
    return mm(jax.nn.silu(mm(h, w_gate)) * mm(h, w_up), w_down)


class DenseMLP(nnx.Module):
    """Dense SwiGLU FFN (DeepSeek's leading dense layers)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_dense
        self.mlp_norm = _ones((D,))
        self.dense_gate_DxF = _param(rngs, (D, F))
        self.dense_up_DxF = _param(rngs, (D, F))
        self.dense_down_FxD = _param(rngs, (F, D), INIT_STD / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x_BxLxD):
        h = rms_norm(x_BxLxD, self.mlp_norm[...])
        out = swiglu(h, self.dense_gate_DxF[...], self.dense_up_DxF[...], self.dense_down_FxD[...])
        return out, {"lb_loss": F32(0), "z_loss": F32(0)}


class MoE(nnx.Module):
    """Softmax router, top-k, dropless SwiGLU experts via grouped matmul (``lax.ragged_dot``).

    Token copies are sorted by expert so each expert's rows are contiguous; ``ragged_dot``
    multiplies each group by its expert's weights. Optional shared experts (DeepSeek, Qwen)
    with an optional sigmoid gate (Qwen). Returns the residual update and the aux losses.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, experts: str = "ragged"):
        if experts not in EXPERTS_MATMULS:
            raise ValueError(f"unknown experts matmul {experts!r}; choose one of: "
                             f"{', '.join(EXPERTS_MATMULS)}")
        D, E, F = cfg.d_model, cfg.n_experts, cfg.d_expert
        out_std = INIT_STD / (2 * cfg.n_layers) ** 0.5
        self.cfg = cfg
        self.experts = experts
        self.mlp_norm = _ones((D,))
        self.router_DxE = _param(rngs, (D, E))
        self.w_gate_ExDxF = _param(rngs, (E, D, F))
        self.w_up_ExDxF = _param(rngs, (E, D, F))
        self.w_down_ExFxD = _param(rngs, (E, F, D), out_std)
        if cfg.n_shared_experts:
            S = cfg.d_shared
            self.shared_gate_DxS = _param(rngs, (D, S))
            self.shared_up_DxS = _param(rngs, (D, S))
            self.shared_down_SxD = _param(rngs, (S, D), out_std)
            if cfg.shared_expert_gate:
                self.shared_router_Dx1 = _param(rngs, (D, 1))

    def __call__(self, x_BxLxD):
        cfg = self.cfg
        B, L, D = x_BxLxD.shape
        E, k = cfg.n_experts, cfg.top_k
        h_TxD = rms_norm(x_BxLxD, self.mlp_norm[...]).reshape(B * L, D)
        logits_TxE = mm(h_TxD, self.router_DxE[...])
        probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
        top_p_Txk, top_e_Txk = lax.top_k(probs_TxE, k)
        # Dropless routing: sort the T*k token copies by expert, one ragged group per expert.
        e_A = top_e_Txk.reshape(-1)
        order_A = jnp.argsort(e_A, stable=True)
        tok_A = order_A // k
        sizes_E = jnp.zeros((E,), jnp.int32).at[e_A].add(1)
        xs_AxD = h_TxD.astype(BF16)[tok_A]
        gmm = self._grouped
        g_AxF = gmm(xs_AxD, self.w_gate_ExDxF[...], sizes_E)
        u_AxF = gmm(xs_AxD, self.w_up_ExDxF[...], sizes_E)
        a_AxF = (jax.nn.silu(g_AxF) * u_AxF).astype(BF16)
        y_AxD = gmm(a_AxF, self.w_down_ExFxD[...], sizes_E)
        y_TxkxD = y_AxD[jnp.argsort(order_A)].reshape(B * L, k, D)  # back to token order
        out_TxD = jnp.sum(y_TxkxD * top_p_Txk[..., None], axis=1)
        if cfg.n_shared_experts:
            sh = swiglu(h_TxD, self.shared_gate_DxS[...], self.shared_up_DxS[...],
                        self.shared_down_SxD[...])
            if cfg.shared_expert_gate:
                sh = sh * jax.nn.sigmoid(mm(h_TxD, self.shared_router_Dx1[...]))
            out_TxD = out_TxD + sh
        # Switch-style load balance: E * sum_e (fraction of copies to e) * (mean prob of e).
        frac_E = sizes_E.astype(F32) / (B * L * k)
        lb_loss = E * jnp.sum(frac_E * jnp.mean(probs_TxE, axis=0))
        z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits_TxE, axis=-1)))
        return out_TxD.reshape(B, L, D), {"lb_loss": lb_loss, "z_loss": z_loss}

    def _grouped(self, x_AxK, w_ExKxN, sizes_E):
        """Each expert's rows of ``x`` (sorted by expert) times its matrix, float32."""
        if self.experts == "blocked":
            return grouped_matmul(x_AxK, w_ExKxN.astype(x_AxK.dtype), sizes_E)
        return lax.ragged_dot(x_AxK, w_ExKxN, sizes_E, preferred_element_type=F32)


class Block(nnx.Module):
    """One decoder layer: attention then the MoE (or, ``dense=True``, a dense SwiGLU) FFN.

    The layer is the unit that gathers, as FSDP wraps a transformer block: its small tensors
    (norms, attention, router) travel as one bucket, its large ones alone."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dense: bool = False,
                 attention: str = "xla", experts: str = "ragged"):
        self.attn = Attention(cfg, rngs, attention)
        self.mlp = DenseMLP(cfg, rngs) if dense else MoE(cfg, rngs, experts)

    @gathered(rules=RULES)
    def __call__(self, x_BxLxD, positions_L):
        x_BxLxD = x_BxLxD + self.attn(x_BxLxD, positions_L)
        delta, aux = self.mlp(x_BxLxD)
        return x_BxLxD + delta, aux


class Transformer(nnx.Module):
    """Embedding, the decoder layers stacked on a leading layer axis (``layers``: the MoE
    layers; ``dense_layers``: DeepSeek's leading dense layers, when the config has them), head.

    A stacked parameter is the per-layer tensor of ``configs.tensor_inventory`` with the layer
    axis first (``layers/mlp/w_gate_ExDxF``: (L, E, D, F)); the stack runs under ``lax.scan``
    (:func:`ciera_jax.fsdp.scan_layers`), so one layer body is traced and compiled.
    ``attention``: the attention's implementation (:data:`ATTENTIONS`); ``experts``: the
    experts' grouped matmul (:data:`EXPERTS_MATMULS`).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attention: str = "xla",
                 experts: str = "ragged"):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)
        n_dense = cfg.n_dense_layers
        self.dense_layers = (fsdp.stack(lambda r: Block(cfg, r, dense=True, attention=attention),
                                        n_dense, rngs) if n_dense else None)
        self.layers = fsdp.stack(lambda r: Block(cfg, r, attention=attention, experts=experts),
                                 cfg.n_layers - n_dense, rngs)
        self.head = Head(cfg, rngs)

    def stacks(self) -> list[tuple[int, nnx.Module]]:
        """(index of the first layer, stack) in execution order."""
        out = [(0, self.dense_layers)] if self.dense_layers is not None else []
        return out + [(self.cfg.n_dense_layers, self.layers)]

    def __call__(self, tokens_BxL):
        positions_L = jnp.arange(tokens_BxL.shape[1])
        x = self.embed(tokens_BxL)
        lb, z = F32(0), F32(0)
        for _, layers in self.stacks():
            x, aux = fsdp.scan_layers(layers, x, positions_L)
            lb, z = lb + jnp.sum(aux["lb_loss"]), z + jnp.sum(aux["z_loss"])
        n_moe = max(1, self.cfg.n_layers - self.cfg.n_dense_layers)
        return self.head(x), {"lb_loss": lb / n_moe, "z_loss": z / n_moe}

    def loss(self, tokens_BxL1, lb_coef: float = 0.01, z_coef: float = 0.001):
        """Next-token cross-entropy (mean over tokens) + load-balance and router z-losses."""
        logits_BxLxV, aux = self(tokens_BxL1[:, :-1])
        targets_BxL = tokens_BxL1[:, 1:]
        logp = jax.nn.log_softmax(logits_BxLxV, axis=-1)
        ce = -jnp.mean(jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1))
        total = ce + lb_coef * aux["lb_loss"] + z_coef * aux["z_loss"]
        return total, {"ce": ce, **aux}


def param_count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with shapes only (no memory): for parameter counts of the big configs."""
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))

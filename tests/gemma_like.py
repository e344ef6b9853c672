"""A small Gemma-like model written the way Flax's ``examples/gemma`` writes its modules:
kernels declare their sharding through Flax metadata (``kernel_metadata={'out_sharding': ...}``
from a :class:`ShardingConfig` over ``('fsdp', 'tp')``), activations pass ``out_sharding`` on
an Explicit mesh, and the layers are a plain ``nnx.List`` run in a Python loop. Nothing in it
knows about ciera_jax: tests wrap it by instance (``fsdp.shard``), or use the decorated
variant, or the ``nnx.vmap``-stacked one run with ``nnx.scan``."""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from ciera_jax import fsdp

VOCAB, D, HEADS, HEAD_DIM, F, T = 32, 16, 2, 8, 32, 8
INIT = nnx.initializers.lecun_normal()


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Mesh axis names, as Gemma's: None keeps a dimension whole."""

    fsdp: str | None = "fsdp"
    tp: str | None = "tp"
    batch: tuple = ("fsdp",)


def explicit() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and all(t == AxisType.Explicit for t in mesh.axis_types)


def out(*spec):
    """An ``out_sharding`` on Explicit meshes; None (propagation decides) otherwise."""
    return P(*spec) if explicit() else None


def meta(*names):
    return {"out_sharding": names}


class Attention(nnx.Module):
    def __init__(self, sh: ShardingConfig, rngs):
        self.sh = sh
        self.q = nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, HEAD_DIM), kernel_init=INIT,
                            kernel_metadata=meta(sh.fsdp, sh.tp, None), rngs=rngs)
        self.kv = nnx.Einsum("BSD,CDNH->CBSNH", (2, D, HEADS, HEAD_DIM), kernel_init=INIT,
                             kernel_metadata=meta(None, sh.fsdp, sh.tp, None), rngs=rngs)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), kernel_init=INIT,
                            kernel_metadata=meta(sh.tp, None, sh.fsdp), rngs=rngs)

    def __call__(self, x):
        sh = self.sh
        q = self.q(x, out_sharding=out(sh.batch, None, sh.tp, None))
        k, v = self.kv(x, out_sharding=out(None, sh.batch, None, sh.tp, None))
        s = jnp.einsum("BTNH,BSNH->BNTS", q, k, out_sharding=out(sh.batch, sh.tp, None, None))
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        p = jax.nn.softmax(jnp.where(mask, s / np.sqrt(HEAD_DIM), -1e9), axis=-1)
        a = jnp.einsum("BNTS,BSNH->BTNH", p, v, out_sharding=out(sh.batch, None, sh.tp, None))
        return self.o(a, out_sharding=out(sh.batch, None, None))


class FeedForward(nnx.Module):
    def __init__(self, sh: ShardingConfig, rngs):
        self.sh = sh
        self.gate_up = nnx.Einsum("BTD,CDF->CBTF", (2, D, F), kernel_init=INIT,
                                  kernel_metadata=meta(None, sh.fsdp, sh.tp), rngs=rngs)
        self.down = nnx.Einsum("BTF,FD->BTD", (F, D), kernel_init=INIT,
                               kernel_metadata=meta(sh.tp, sh.fsdp), rngs=rngs)

    def __call__(self, x):
        gate, up = self.gate_up(x, out_sharding=out(None, self.sh.batch, None, self.sh.tp))
        return self.down(jax.nn.gelu(gate) * up, out_sharding=out(self.sh.batch, None, None))


class Block(nnx.Module):
    def __init__(self, sh: ShardingConfig, rngs):
        self.pre_attn = nnx.RMSNorm(D, rngs=rngs)
        self.attn = Attention(sh, rngs)
        self.pre_ffw = nnx.RMSNorm(D, rngs=rngs)
        self.ffw = FeedForward(sh, rngs)

    def __call__(self, x):
        x = x + self.attn(self.pre_attn(x))
        return x + self.ffw(self.pre_ffw(x))


class DecoratedBlock(Block):
    """The same block for code you own: the decorator instead of wrapping by instance."""

    @fsdp.gathered()
    def __call__(self, x):
        return super().__call__(x)


class Embedder(nnx.Module):
    def __init__(self, sh: ShardingConfig, rngs):
        self.sh = sh
        self.table = nnx.Embed(VOCAB, D, embedding_init=nnx.with_partitioning(
            INIT, (sh.tp, sh.fsdp)), rngs=rngs)

    def encode(self, tokens):
        return self.table(tokens, out_sharding=out(self.sh.batch, None, None)) * np.sqrt(D)

    def decode(self, x):
        return self.table.attend(x, out_sharding=out(self.sh.batch, None, None))


class Transformer(nnx.Module):
    """Embedder, an ``nnx.List`` of blocks run in a loop, final norm, tied logits."""

    def __init__(self, rngs, sh: ShardingConfig = ShardingConfig(), layers: int = 2,
                 block=Block):
        self.embedder = Embedder(sh, rngs)
        self.blocks = nnx.List([block(sh, rngs) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embedder.encode(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embedder.decode(self.final_norm(x))


class DecoratedTransformer(Transformer):
    def __init__(self, rngs, sh: ShardingConfig = ShardingConfig(), layers: int = 2):
        super().__init__(rngs, sh, layers, block=DecoratedBlock)

    @fsdp.gathered()
    def __call__(self, tokens):
        return super().__call__(tokens)


class ScannedTransformer(nnx.Module):
    """The blocks stacked with ``nnx.vmap`` (the layer axis enters the kernels' sharding
    metadata as None) and run with ``nnx.scan``."""

    def __init__(self, rngs, sh: ShardingConfig = ShardingConfig(), layers: int = 2):
        self.embedder = Embedder(sh, rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def build(r):
            return Block(sh, r)

        self.layers = build(rngs)
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embedder.encode(tokens)
        x = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                     transform_metadata={nnx.PARTITION_NAME: None})(x, self.layers)
        return self.embedder.decode(self.final_norm(x))


def shard_gemma(model):
    """Wrap by instance, as a PyTorch user would: every block, then the root."""
    fsdp.shard(model, where=lambda path, m: isinstance(m, Block))
    return fsdp.shard(model)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB, dtype=jnp.float32)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def make_mesh(shape, names=("fsdp", "tp"), explicit_axes=True):
    kind = AxisType.Explicit if explicit_axes else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def batches(mesh, steps, batch=8, sh: ShardingConfig = ShardingConfig()):
    spec = jax.sharding.NamedSharding(mesh, P(sh.batch))
    return [jax.device_put(jax.random.randint(jax.random.key(i), (batch, T + 1), 0, VOCAB), spec)
            for i in range(steps)]


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def train(build, mesh, tokens, mode=None, gather="ciera", lr=3e-3):
    """``build(rngs)`` under the mesh, caches in ``mode`` (None: none), AdamW steps under
    ``nnx.jit`` inside ``fsdp.gather_mode(gather)``. Returns ``(model, history, counts)``:
    stats per step, and ``counts`` with the losses, traces of the step and XLA compiles
    during each step."""
    counts = {"losses": [], "traces": 0, "compiles": []}
    compiles = []

    def listen(event, _secs, **_):
        if event == COMPILE_EVENT:
            compiles.append(1)

    with jax.set_mesh(mesh):
        model = build(nnx.Rngs(0))
        if mode is not None:
            model = fsdp.attach_caches(model, mode=mode)
        opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, toks):
            counts["traces"] += 1
            loss, grads = nnx.value_and_grad(loss_fn)(model, toks)
            opt.update(model, grads)
            return loss, fsdp.gather_stats(model)

        history = []
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            with fsdp.gather_mode(model, gather):
                for toks in tokens:
                    before = len(compiles)
                    loss, stats = step(model, opt, toks)
                    history.append(jax.device_get(stats))
                    counts["losses"].append(float(loss))
                    counts["compiles"].append(len(compiles) - before)
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    return model, history, counts


def params_sha256(model) -> str:
    """sha256 over every parameter's bytes in path order (paths included)."""
    h = hashlib.sha256()
    pairs = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    for path, x in sorted(pairs, key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes())
    return h.hexdigest()


class MoE(nnx.Module):
    """Soft-routed experts: the expert kernels are split over an ``expert`` axis and
    FSDP-sharded within it; the router stays whole."""

    def __init__(self, rngs, experts: int = 2):
        self.router = nnx.Linear(D, experts, kernel_init=nnx.with_partitioning(INIT, (None, None)),
                                 rngs=rngs)
        self.w_in = nnx.Param(nnx.with_partitioning(INIT, ("expert", "fsdp", None))(
            rngs.params(), (experts, D, F)))
        self.w_out = nnx.Param(nnx.with_partitioning(INIT, ("expert", None, "fsdp"))(
            rngs.params(), (experts, F, D)))

    def __call__(self, x):
        gates = jax.nn.softmax(self.router(x), axis=-1)
        h = jax.nn.gelu(jnp.einsum("BTD,EDF->BTEF", x, self.w_in[...]))
        y = jnp.einsum("BTEF,EFD->BTED", h, self.w_out[...])
        return x + jnp.einsum("BTED,BTE->BTD", y, gates)


class MoEModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=nnx.with_partitioning(
            INIT, (None, "fsdp")), rngs=rngs)
        self.moe = MoE(rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, tokens):
        return self.embed.attend(self.norm(self.moe(self.embed(tokens))))

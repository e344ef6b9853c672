"""Small models written the way the Flax sharding guide teaches (Flax layers, kernels annotated
with ``nnx.with_partitioning``, built under ``jax.set_mesh``), with one ``@gathered`` each, and
the two ways to train them: inside the user's ``shard_map``, and under ``nnx.jit`` alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from ciera_jax import fsdp

VOCAB, D, F, H = 64, 32, 64, 8


def part(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def make_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


class MLP(nnx.Module):
    """A Flax MLP block; ``@gathered`` gathers the kernels of its two Linear layers."""

    def __init__(self, d, f, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)  # vectors: replicated, no annotation needed
        self.up = nnx.Linear(d, f, kernel_init=part("fsdp", None), rngs=rngs)
        self.down = nnx.Linear(f, d, kernel_init=part(None, "fsdp"), rngs=rngs)

    @fsdp.gathered(axis_name="fsdp")
    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class LM(nnx.Module):
    """Embedding, an MLP block (gathers its own), head: the outer decorator gathers the
    embedding table and the head kernel."""

    def __init__(self, rngs, vocab=VOCAB, d=D, f=F):
        self.embed = nnx.Embed(vocab, d, embedding_init=part(None, "fsdp"), rngs=rngs)
        self.block = MLP(d, f, rngs)
        self.head = nnx.Linear(d, vocab, kernel_init=part("fsdp", None), rngs=rngs)

    @fsdp.gathered(axis_name="fsdp")
    def __call__(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def batches(mesh, steps, batch=8, length=9):
    spec = P(tuple(mesh.axis_names))
    return [jax.device_put(jax.random.randint(jax.random.key(i), (batch, length), 0, VOCAB),
                           jax.sharding.NamedSharding(mesh, spec)) for i in range(steps)]


def bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def same_bits(a, b) -> bool:
    """Bitwise equal pytrees (the same structure, every leaf the same bytes)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(np.array_equal(x, y) for x, y in zip(bits(a), bits(b)))


def all_compressed(stats) -> bool:
    """Every tensor (every layer of a stacked one) of one step's ``fsdp.gather_stats`` went
    compressed: no plain fallback, and fewer bytes sent than a plain gather sends."""
    return bool(stats) and all(
        np.all(np.asarray(s["fallback"]) == 0)
        and np.all(np.asarray(s["sent_bytes"]) < np.asarray(s["plain_bytes"]))
        for s in stats.values())


def wire_ratio(history, skip=1) -> float:
    """Bytes ciera sent over the bytes plain sends, after the priming step(s)."""
    sent = sum(int(s["sent_bytes"]) for st in history[skip:] for s in st.values())
    plain = sum(int(s["plain_bytes"]) for st in history[skip:] for s in st.values())
    return sent / plain


def train_jit(make, mesh, mode, tokens, lr=3e-3, cache="exponent"):
    """``nnx.jit`` + ``nnx.Optimizer`` (AdamW), no shard_map in user code; ``cache``: the
    caches' mode (``fsdp.attach_caches``)."""
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(make(nnx.Rngs(0)), cache)
        opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, toks):
            with fsdp.gather_mode(model, mode):
                loss, grads = nnx.value_and_grad(lm_loss)(model, toks)
            opt.update(model, grads)
            return loss, fsdp.gather_stats(model)

        history, losses = [], []
        for toks in tokens:
            loss, stats = step(model, opt, toks)
            history.append(jax.device_get(stats))
            losses.append(float(loss))
        return nnx.state(model, nnx.Param), history, losses


def train_shard_map(make, mesh, mode, tokens, lr=3e-3, cache="exponent"):
    """The user's own ``jax.shard_map`` over the mesh, optax AdamW on the shards."""
    axes = tuple(mesh.axis_names)
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(make(nnx.Rngs(0)), cache)
    graphdef, params, caches, rest = nnx.split(model, nnx.Param, fsdp.ExponentCacheVar, ...)
    specs = fsdp.state_specs(model, params, n=mesh.shape["fsdp"])
    tx = optax.adamw(lr)
    opt_state = tx.init(params)
    full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, params,
                        is_leaf=lambda s: isinstance(s, P))
    opt_specs = optax.tree_map_params(tx, lambda _, s: s, opt_state, full,
                                      transform_non_params=lambda _: P(),
                                      is_leaf=lambda s: isinstance(s, P))

    def loss_fn(params, caches, toks):
        m = fsdp.merge(graphdef, params, caches, rest)
        with fsdp.gather_mode(m, mode):
            loss = lm_loss(m, toks) / jax.lax.axis_size(axes)  # mean over the global batch
        return loss, (nnx.state(m, fsdp.ExponentCacheVar), fsdp.gather_stats(m))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(), opt_specs, P(axes)),
                       out_specs=(specs, P(), opt_specs, P(), P()))
    def step(params, caches, opt_state, toks):
        (loss, (caches, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, caches, toks)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), caches, opt_state,
                jax.lax.psum(loss, axes), stats)

    history, losses = [], []
    for toks in tokens:
        params, caches, opt_state, loss, stats = step(params, caches, opt_state, toks)
        history.append(jax.device_get(stats))
        losses.append(float(loss))
    return params, history, losses

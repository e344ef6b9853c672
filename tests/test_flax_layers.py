"""Every Flax layer kind under a decorated block is gathered: ``nnx.MultiHeadAttention`` (its
``LinearGeneral`` projections), ``nnx.Conv``, ``nnx.Einsum``, ``nnx.Linear``, ``nnx.Embed``.
With exponent and with word caches, the step after the priming one sends every kernel
compressed, and its forward and gradients are bitwise those of the plain gather; the same math
as the unsharded module."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ciera_jax import fsdp
from flax_nets import LM, MLP, all_compressed, make_mesh, part, same_bits

D, H, F, V = 16, 8, 32, 24


class Block(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, embedding_init=part(None, "fsdp"), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, kernel_init=part("fsdp", None, None),
                                           use_bias=False, decode=False, rngs=rngs)
        self.conv = nnx.Conv(D, D, kernel_size=(3,), kernel_init=part(None, "fsdp", None),
                             rngs=rngs)
        self.up = nnx.Einsum("bld,df->blf", (D, F), kernel_init=part("fsdp", None), rngs=rngs)
        self.down = nnx.LinearGeneral(F, D, kernel_init=part(None, "fsdp"), rngs=rngs)

    @fsdp.gathered()
    def __call__(self, tokens):
        x = self.embed(tokens).astype(jnp.float32)
        x = x + self.attn(x) + self.conv(x)
        return x + self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.parametrize("cache", ["exponent", "word"])
def test_every_flax_layer_kind_is_gathered(cache):
    """Two steps on the same caches: the first primes them (a plain fallback), the second
    sends every layer kind's kernel compressed; both are bitwise plain's."""
    mesh = make_mesh((8,), ("fsdp",))
    toks = jax.random.randint(jax.random.key(1), (8, 5), 0, V)
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(Block(nnx.Rngs(0)), cache)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=0)
    def run(mode, state, toks):
        """One SGD step: (loss, grads, stats, the state after it: caches and params)."""
        m = nnx.merge(graphdef, state)
        with fsdp.gather_mode(m, mode):
            y, grads = nnx.value_and_grad(lambda m: jnp.sum(jnp.square(m(toks))))(m)
        params = nnx.state(m, nnx.Param)
        nnx.update(m, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads))
        return y, grads, fsdp.gather_stats(m), nnx.state(m)

    with jax.set_mesh(mesh):
        toks_s = jax.device_put(toks, jax.sharding.NamedSharding(mesh, jax.P("fsdp")))
        out = {}
        for mode in ("ciera", "plain"):
            first = run(mode, state, toks_s)
            out[mode] = first, run(mode, first[3], toks_s)
    for step in (0, 1):
        assert same_bits(out["ciera"][step][:2], out["plain"][step][:2]), step
    assert same_bits(nnx.state(nnx.merge(graphdef, out["ciera"][1][3]), nnx.Param),
                     nnx.state(nnx.merge(graphdef, out["plain"][1][3]), nnx.Param))
    first, second = out["ciera"][0][2], out["ciera"][1][2]
    assert sorted(second) == ["attn/key/kernel", "attn/out/kernel", "attn/query/kernel",
                              "attn/value/kernel", "conv/kernel", "down/kernel",
                              "embed/embedding", "up/kernel"]
    assert all(int(s["fallback"]) == 1 for s in first.values())  # priming
    assert all_compressed(second), second
    if cache == "word":
        return
    # the same math as the unsharded module (no mesh: it runs on what it holds, cast to bf16)
    ref_y, ref_g, _, _ = run("ciera", jax.device_get(state), toks)
    np.testing.assert_allclose(float(out["ciera"][0][0]), float(ref_y), rtol=1e-3)
    for a, b in zip(jax.tree.leaves(out["ciera"][0][1]), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-2, atol=5e-2)


def test_inventory_and_specs_of_a_flax_model():
    # What the trainer and the planner read: every gathered kernel with its split axis and
    # full shape, and shard_map specs; the inner decorated block's own, under its path.
    with jax.set_mesh(make_mesh((8,), ("fsdp",))):
        model = fsdp.attach_caches(LM(nnx.Rngs(0)))
    tensors = fsdp.gathered_tensors(model)
    assert {k: (t.axis, t.shape) for k, t in tensors.items()} == {
        "embed/embedding": (1, (64, 32)), "head/kernel": (0, (32, 64)),
        "block/up/kernel": (0, (32, 64)), "block/down/kernel": (1, (64, 32))}
    assert all(t.dtype == jnp.bfloat16 for t in tensors.values())
    params = nnx.state(model, nnx.Param)
    specs = fsdp.state_specs(model, params, n=8)
    assert specs["block"]["down"]["kernel"] == jax.P(None, "fsdp")
    assert specs["block"]["norm"]["scale"] == jax.P() and specs["head"]["bias"] == jax.P()
    # the caches sit beside their kernels, keyed like them
    caches = fsdp.cache_dict(nnx.state(model, fsdp.ExponentCacheVar))
    assert sorted(caches) == sorted(tensors)


def test_one_agreement_per_decorated_call():
    # LM: the outer decorated call (embedding, head) and the block's: two pmax, no more
    mesh = make_mesh((8,), ("fsdp",))
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(LM(nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(
            state, jnp.zeros((8, 4), jnp.int32))
    text = str(jaxpr)
    assert text.count("pmax") == 2, text.count("pmax")
    assert text.count("shard_map") == 2  # one region per decorated call, opened by the decorator


def test_explicit_mesh_axes_jax_default():
    # jax.make_mesh's default axis types are Explicit: sharding in types works the same
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 16)),
                       jax.NamedSharding(mesh, jax.P(("data", "fsdp"))))
    out = {}
    for mode in ("ciera", "plain"):
        with jax.set_mesh(mesh):
            model = fsdp.attach_caches(MLP(16, 32, nnx.Rngs(0)))
            opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

            @nnx.jit
            def step(model, opt, x):
                with fsdp.gather_mode(model, mode):
                    grads = nnx.grad(lambda m: jnp.mean(jnp.square(m(x))))(model)
                opt.update(model, grads)
                return fsdp.gather_stats(model)

            stats = [step(model, opt, x) for _ in range(3)]
        assert model.up.kernel[...].sharding.spec == jax.P("fsdp", None)  # still sharded
        out[mode] = nnx.state(model, nnx.Param), stats
    assert same_bits(out["ciera"][0], out["plain"][0])
    last = out["ciera"][1][-1]
    assert all(int(s["sent_bytes"]) < int(s["plain_bytes"]) for s in last.values())

"""Decorated Flax modules under the transforms Flax users wrap layers in: ``nnx.remat`` /
``jax.checkpoint`` with a policy, ``nnx.scan`` over stacked layers, ``nnx.vmap``. Stats and
caches leave through module state, so every transform carries them as values; ciera stays
bitwise equal to plain, and a rematerialized call counts and updates its caches once."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ciera_jax import fsdp
from flax_nets import MLP, all_compressed, make_mesh, same_bits

D, F, STEPS = 16, 32, 3
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def xs(mesh, steps=STEPS):
    spec = jax.sharding.NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return [jax.device_put(jax.random.normal(jax.random.key(i), (8, D)), spec)
            for i in range(steps)]


def fit_jit(make, apply, mode, mesh, cache="exponent"):
    """AdamW steps under nnx.jit (no shard_map); returns (params, stats per step, caches)."""
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(make(nnx.Rngs(0)), cache)
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x):
            def loss_fn(model):
                return jnp.mean(jnp.square(apply(model, x) - jnp.roll(x, 1, axis=-1)))

            with fsdp.gather_mode(model, mode):
                grads = nnx.grad(loss_fn)(model)
            opt.update(model, grads)
            return fsdp.gather_stats(model)

        history = [jax.device_get(step(model, opt, x)) for x in xs(mesh)]
        return (nnx.state(model, nnx.Param), history,
                jax.device_get(nnx.state(model, fsdp.ExponentCacheVar)))


def compressed(history) -> bool:
    """Some gather after the priming step went compressed (not the plain fallback), and the
    last step sent every tensor compressed (no fallback, fewer bytes than plain)."""
    return (any(np.any(np.asarray(s["fallback"]) == 0) for st in history[1:] for s in st.values())
            and all_compressed(history[-1]))


def call(m, x):
    return m(x)


def checkpointed(m, x):
    """jax.checkpoint on a pure function of the module's state: the state leaves as values."""
    graphdef, state = nnx.split(m)

    @functools.partial(jax.checkpoint, policy=POLICY)
    def f(state, x):
        m2 = nnx.merge(graphdef, state)
        return m2(x), nnx.state(m2)

    y, state = f(state, x)
    nnx.update(m, state)
    return y


REMATS = {"nnx.remat": nnx.remat(call, policy=POLICY), "jax.checkpoint": checkpointed}


@functools.cache
def direct_run():
    """The MLP trained without remat (shared by both remat variants)."""
    return fit_jit(functools.partial(MLP, D, F), call, "ciera", make_mesh((8,), ("fsdp",)))


@pytest.mark.parametrize("remat", ["nnx.remat", "jax.checkpoint"])
def test_remat_under_jit_bitwise_counts_once(remat):
    mesh = make_mesh((8,), ("fsdp",))
    wrap = REMATS[remat]
    make = functools.partial(MLP, D, F)
    runs = {(mode, True): fit_jit(make, wrap, mode, mesh) for mode in ("ciera", "plain")}
    runs["ciera", False] = direct_run()
    assert same_bits(runs["ciera", True][0], runs["plain", True][0])
    assert same_bits(runs["ciera", True][0], runs["ciera", False][0])
    # stats and caches of the rematerialized call: those of one forward gather, not two
    assert same_bits(runs["ciera", True][1], runs["ciera", False][1])
    assert same_bits(runs["ciera", True][2], runs["ciera", False][2])
    assert compressed(runs["ciera", True][1])


def test_remat_inside_user_shard_map():
    """The issue's repro: nnx.remat around a decorated call inside shard_map raised
    UnexpectedTracerError when stats left through a Python dict."""
    mesh = make_mesh((8,), ("fsdp",))
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(MLP(D, F, nnx.Rngs(0)))
    graphdef, params, caches, rest = nnx.split(model, nnx.Param, fsdp.ExponentCacheVar, ...)
    specs = fsdp.state_specs(model, params, n=8)

    def run(mode, wrap):
        def loss_fn(params, caches, x):
            m = fsdp.merge(graphdef, params, caches, rest)
            with fsdp.gather_mode(m, mode):
                y = wrap(m, x)
            loss = jnp.mean(jnp.square(y)) / jax.lax.axis_size("fsdp")
            return loss, (nnx.state(m, fsdp.ExponentCacheVar), fsdp.gather_stats(m))

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(), P("fsdp")),
                           out_specs=(specs, (P(), P())))
        def step(params, caches, x):
            return jax.grad(loss_fn, has_aux=True)(params, caches, x)

        out, c = [], caches
        for i, x in enumerate(xs(mesh)):
            p = jax.tree.map(lambda a: a * (1 + 1e-3 * i), params)
            grads, (c, stats) = step(p, c, x)
            out.append((grads, c, stats))
        return out

    ciera, plain = run("ciera", REMATS["nnx.remat"]), run("plain", REMATS["nnx.remat"])
    direct = run("ciera", call)
    for (gc, cc, sc), (gp, _, _), (gd, cd, sd) in zip(ciera, plain, direct):
        assert same_bits(gc, gp) and same_bits(gc, gd)
        assert same_bits(cc, cd) and same_bits(sc, sd)
    assert compressed([s for _, _, s in ciera])


def stacked(n):
    """``n`` MLP layers stacked by nnx.vmap the Flax way; each builds its own caches."""

    def make(rngs):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def build(r):
            return fsdp.attach_caches(MLP(D, F, r))

        return build(rngs)

    return make


class ScanNet(nnx.Module):
    def __init__(self, rngs):
        self.layers = stacked(3)(rngs)

    def __call__(self, x):
        return nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0),
                        out_axes=nnx.Carry)(x, self.layers)


def test_nnx_scan_over_stacked_layers():
    mesh = make_mesh((2, 4), ("data", "fsdp"))
    (pc, hc, cc), (pp, _, _) = [fit_jit(ScanNet, call, mode, mesh) for mode in ("ciera", "plain")]
    assert same_bits(pc, pp)
    assert sorted(hc[0]) == ["layers/down/kernel", "layers/up/kernel"]
    assert np.asarray(hc[0]["layers/up/kernel"]["rung"]).shape == (3,)  # stats per layer
    assert np.asarray(jax.tree.leaves(cc)[-1]).shape[0] == 3  # caches per layer
    assert compressed(hc)


def test_nnx_vmap_over_an_ensemble():
    ensemble = nnx.vmap(call, in_axes=(0, None), out_axes=0)
    mesh = make_mesh((8,), ("fsdp",))
    (pc, hc, _), (pp, _, _) = [fit_jit(stacked(2), lambda m, x: ensemble(m, x).mean(0), mode,
                                       mesh) for mode in ("ciera", "plain")]
    assert same_bits(pc, pp)
    assert np.asarray(hc[0]["up/kernel"]["rung"]).shape == (2,)
    assert compressed(hc)

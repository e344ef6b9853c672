"""The backward's payload-only gather (:mod:`ciera_jax.fsdp.regather`): bit for bit
``lax.all_gather`` when the exponent caches are the full tensors' exponents, alone and as a
bucket, on adversarial words; it really reads them (a wrong cache shows); and prepared steps
with weights kept split over a ``tp`` axis train plain's parameters."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp
from ciera_jax.codec import bitfields
from ciera_jax.fsdp.regather import regather
from bitdata import BF16, F32, adversarial, bits_of, churn, weights
from harness import mesh_of
from flax_nets import all_compressed

N = 8
# (key, full shape, gather axis, dtype): q, k, b travel as one bucket; w32 and v alone
TENSORS = (("q", (N * 4, 16), 0, BF16), ("k", (6, N * 2), 1, BF16), ("b", (N * 3,), 0, BF16),
           ("w32", (3, N * 2, 4), 1, F32), ("v", (5, N * 2), 1, BF16))
GROUPS = (("q", "k", "b"), ("w32",), ("v",))


@functools.cache
def _fn():
    mesh = mesh_of((N,), ("fsdp",))
    ts = {k: fsdp.GatheredTensor(k, ax, shape, dt) for k, shape, ax, dt in TENSORS}
    specs = {k: fsdp.spec_for(t.axis, len(t.shape), "fsdp") for k, t in ts.items()}

    def body(shards, caches):
        fulls = regather(ts, shards, caches, GROUPS, "fsdp", N)
        refs = {k: lax.all_gather(bitfields.to_bits(s), "fsdp", axis=ts[k].axis, tiled=True)
                for k, s in shards.items()}
        per_rank = lambda tree: jax.tree.map(lambda v: v[None], tree)  # noqa: E731
        return per_rank({k: bitfields.to_bits(f) for k, f in fulls.items()}), per_rank(refs)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()),
                               out_specs=(P("fsdp"), P("fsdp"))))

    def run(x, caches):
        shards = {k: jax.device_put(jnp.asarray(v), jax.sharding.NamedSharding(mesh, specs[k]))
                  for k, v in x.items()}
        return fn(shards, caches)

    return run


def _exp_caches(x: dict) -> dict:
    return {k: ciera_jax.ExponentCache(bitfields.exponent(jnp.asarray(v)), jnp.bool_(True),
                                       np.dtype(v.dtype)) for k, v in x.items()}


def test_payload_regather_is_bitwise_with_the_right_exponents():
    rng = np.random.default_rng(5)
    x = {k: weights(rng, shape, dt) for k, shape, _, dt in TENSORS}
    for step in (x, {k: adversarial(rng, v.shape, v.dtype) for k, v in x.items()},
                 {k: churn(rng, v, 1.0, flip_signs=0.5) for k, v in x.items()}):
        fulls, refs = _fn()(step, _exp_caches(step))
        for k, v in step.items():
            got = np.asarray(fulls[k])
            np.testing.assert_array_equal(got, np.asarray(refs[k]))
            np.testing.assert_array_equal(got[0], bits_of(v))
            assert (got == got[:1]).all()  # every rank the same


def test_it_reads_the_cached_exponents():
    """One wrong cached exponent per tensor shows up in exactly that element's word."""
    rng = np.random.default_rng(6)
    x = {k: weights(rng, shape, dt) for k, shape, _, dt in TENSORS}
    caches = _exp_caches(x)
    wrong = {k: dataclasses.replace(c, exp=c.exp.reshape(-1).at[3].add(1).reshape(c.shape))
             for k, c in caches.items()}
    fulls, _ = _fn()(x, wrong)
    for k, v in x.items():
        diff = np.flatnonzero(np.asarray(fulls[k])[0].reshape(-1) != bits_of(v).reshape(-1))
        assert diff.tolist() == [3], (k, diff)



class _TPLayer(nnx.Module):
    """Weights split over ``fsdp`` and kept split over ``tp`` (the layer psums over ``tp``),
    and one split over ``fsdp`` alone."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (16, 32)), out_sharding=("fsdp", "tp"))
        self.w_out = nnx.Param(init(rngs.params(), (32, 16)), out_sharding=("tp", "fsdp"))
        self.v = nnx.Param(init(rngs.params(), (8, 16)), out_sharding=("fsdp", None))

    @ciera_jax.gathered(axis_name="fsdp")
    def __call__(self, x):
        h = jax.nn.gelu(x @ self.w_in[...].astype(jnp.float32))
        y = lax.psum(h @ self.w_out[...].astype(jnp.float32), "tp")
        return x + y + self.v[...].astype(jnp.float32).sum(0), jnp.float32(0)


class _TPStack(nnx.Module):
    def __init__(self, rngs):
        self.layers = fsdp.stack(_TPLayer, 2, rngs)

    def __call__(self, x):
        return fsdp.scan_layers(self.layers, x)[0]


@pytest.mark.parametrize("cache", ["exponent", "word"])
def test_prepared_steps_beside_tp_are_bitwise_plain(cache):
    """The prepared path on an (fsdp, tp) mesh, a stack under its one custom VJP: the
    backward's payload gather (exponent caches) or cache read (word caches) of weights that
    stay split over ``tp`` trains the same parameters as plain gathers, bit for bit, through
    steps whose gathers all compress."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(_TPStack(nnx.Rngs(0)), mode=cache, stats=False)
    tensors = fsdp.gathered_tensors(model)
    assert tensors["layers/w_in"].spec == ("fsdp", "tp")
    graphdef, params, caches = nnx.split(model, nnx.Param, fsdp.GatherCacheVar)
    specs, cache_specs = fsdp.state_specs(model, params, n=4), fsdp.state_specs(model, caches)
    compress = {k: True for k in tensors}

    def make(mode):
        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, cache_specs, P()),
                           out_specs=(specs, cache_specs, P(("fsdp", "tp"))))
        def step(params, caches, x):
            x = lax.pcast(x, ("fsdp", "tp"), to="varying")
            encoded = fsdp.encode_tensors(tensors, fsdp.param_dict(params),
                                          fsdp.cache_dict(caches), compress)
            agreed = fsdp.agree_tensors(tensors, encoded)

            def loss(params):
                m = fsdp.prepare(fsdp.merge(graphdef, params, caches), encoded, agreed, mode)
                return jnp.sum(jnp.square(m(x))), (nnx.state(m, fsdp.GatherCacheVar),
                                                   fsdp.gather_stats(m))

            grads, (new_caches, stats) = jax.grad(loss, has_aux=True)(params)
            # a step small against this loss's gradients: exponents hold, words move a little
            return (jax.tree.map(lambda p, g: p - 1e-5 * g, params, grads), new_caches,
                    jax.tree.map(lambda v: v[None], stats))  # every rank's stats
        return step

    x = jax.random.normal(jax.random.key(1), (4, 16), jnp.float32)
    trained, history = {}, []
    for mode in ("ciera", "plain"):
        p, c = fsdp.put(params, specs, mesh), fsdp.put(caches, cache_specs, mesh)
        step = make(mode)
        for _ in range(3):  # priming, then steps through primed caches
            p, c, stats = step(p, c, x)
            history.append(jax.device_get(stats))
        trained[mode] = [bits_of(a) for a in jax.tree.leaves(p)]
    for a, b in zip(trained["ciera"], trained["plain"]):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, bits_of(b)) for a, b in zip(trained["ciera"],
                                                                  jax.tree.leaves(params)))
    assert all(np.all(np.asarray(s["fallback"]) == 1) for s in history[0].values())  # priming
    assert all(all_compressed(st) for st in history[1:3]), history[1:3]

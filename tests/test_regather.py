"""The backward's payload-only gather (:mod:`ciera_jax.fsdp.regather`): bit for bit
``lax.all_gather`` when the exponent caches are the full tensors' exponents, alone and as a
bucket, on adversarial words; and it really reads them (a wrong cache shows)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import codec, fsdp
from ciera_jax.fsdp.regather import regather
from bitdata import BF16, F32, adversarial, bits_of, churn, weights
from harness import mesh_of

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
        refs = {k: lax.all_gather(codec.to_bits(s), "fsdp", axis=ts[k].axis, tiled=True)
                for k, s in shards.items()}
        per_rank = lambda tree: jax.tree.map(lambda v: v[None], tree)  # noqa: E731
        return per_rank({k: codec.to_bits(f) for k, f in fulls.items()}), per_rank(refs)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()),
                               out_specs=(P("fsdp"), P("fsdp"))))

    def run(x, caches):
        shards = {k: jax.device_put(jnp.asarray(v), jax.sharding.NamedSharding(mesh, specs[k]))
                  for k, v in x.items()}
        return fn(shards, caches)

    return run


def _exp_caches(x: dict) -> dict:
    return {k: ciera_jax.ExponentCache(codec.exponent(jnp.asarray(v)), jnp.bool_(True),
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


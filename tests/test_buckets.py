"""Buckets: a gathering module's small compressed tensors gathered as one 1-D tensor.

The layout is checked against numpy; the gather bit for bit against ``lax.all_gather`` of each
member over steps of churn and adversarial words, in both cache modes; and the compiled program
is checked to hold one codec per bucket, not one per tensor.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp
from ciera_jax.codec import bitfields
from ciera_jax.runtime import hlo
from ciera_jax.fsdp import buckets
from bitdata import BF16, adversarial, bits_of, churn, weights
from harness import mesh_of

N = 8
F32 = np.dtype(np.float32)
# (key, full shape, gather axis, dtype): three bf16 tensors split on different axes form one
# bucket; the float32 one is alone in its dtype, so it is gathered alone.
TENSORS = (("q", (N * 4, 16), 0, BF16), ("k", (6, N * 2), 1, BF16), ("b", (N * 3,), 0, BF16),
           ("w32", (N * 2, 4), 0, F32))


def _tensors():
    return {k: fsdp.GatheredTensor(k, ax, shape, dt) for k, shape, ax, dt in TENSORS}


def _rank_shards(full: np.ndarray, axis: int) -> list:
    return np.split(full, N, axis=axis)


def test_layout_matches_numpy():
    """A bucket's full tensor is rank-major: rank r's members' flat shards in member order;
    split_full undoes join_full, with and without a leading layer axis."""
    rng = np.random.default_rng(0)
    ts = [t for t in _tensors().values() if t.dtype == BF16]
    fulls = [rng.integers(0, 2**16, t.shape, dtype=np.uint16) for t in ts]
    want = np.concatenate([np.concatenate([s.ravel() for s in (
        _rank_shards(f, t.axis)[r] for f, t in zip(fulls, ts))]) for r in range(N)])
    joined = buckets.join_full([jnp.asarray(f) for f in fulls], ts, N)
    np.testing.assert_array_equal(np.asarray(joined), want)
    for a, b in zip(buckets.split_full(joined, ts, N), fulls):
        np.testing.assert_array_equal(np.asarray(a), b)
    stacked = [jnp.stack([f, f[::-1] if f.ndim == 1 else f ^ 1]) for f in map(jnp.asarray,
                                                                                  fulls)]
    joined2 = buckets.join_full(stacked, ts, N, lead=1)
    assert joined2.shape == (2, want.size)
    np.testing.assert_array_equal(np.asarray(joined2[0]), want)
    for a, b in zip(buckets.split_full(joined2, ts, N, lead=1), stacked):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_groups_by_module_dtype_and_size(monkeypatch):
    ts = _tensors()
    caches = {k: ciera_jax.init_cache(t.shape, t.dtype, "exponent") for k, t in ts.items()}
    assert buckets.groups(ts, caches, "fsdp") == {"[bucket]0": ("q", "k", "b")}
    # only the compressed keys; one member left: no bucket
    assert buckets.groups(ts, caches, "fsdp", ["q", "w32"]) == {}
    # another gathering module, another bucket; another cache mode, another bucket
    ts2 = {**ts, "k": fsdp.GatheredTensor("k", 1, (6, N * 2), BF16, gatherer="attn")}
    assert buckets.groups(ts2, caches, "fsdp") == {"[bucket]0": ("q", "b")}
    ts3 = {k: fsdp.GatheredTensor(k, t.axis, t.shape, t.dtype, gatherer="attn")
           for k, t in ts.items()}
    assert buckets.groups(ts3, caches, "fsdp") == {"attn/[bucket]0": ("q", "k", "b")}
    word = {**caches, "b": ciera_jax.init_cache((N * 3,), BF16, "word")}
    assert buckets.groups(ts, word, "fsdp") == {"[bucket]0": ("q", "k")}
    monkeypatch.setattr(buckets, "MAX_BUCKET_ELEMENTS", 620)  # q + k, then b alone
    assert buckets.groups(ts, caches, "fsdp") == {"[bucket]0": ("q", "k")}
    monkeypatch.setattr(buckets, "MAX_ELEMENTS", 100)  # q (512 elements) is gathered alone
    assert buckets.groups(ts, caches, "fsdp") == {"[bucket]0": ("k", "b")}


def test_split_stats_shares_add_up():
    ts = [t for t in _tensors().values() if t.dtype == BF16]
    stats = dict(sent_bytes=jnp.int32(1001), plain_bytes=jnp.int32(2 * 632),
                 changed=jnp.int32(7), elements=jnp.int32(632), rung=jnp.int32(3),
                 fallback=jnp.int32(0), verify_failed=jnp.int32(1))
    parts = buckets.split_stats(stats, ts)
    for k in ("sent_bytes", "plain_bytes", "changed", "elements"):
        assert sum(int(p[k]) for p in parts) == int(stats[k])
    assert [int(p["elements"]) for p in parts] == [512, 96, 24]
    assert [int(p["plain_bytes"]) for p in parts] == [1024, 192, 48]
    assert all(int(p["rung"]) == 3 and int(p["verify_failed"]) == 1 for p in parts)


@functools.lru_cache(maxsize=None)
def _gather_fn(mode_key: str):
    """jit(shard_map(fsdp.gather)) over TENSORS: (shards, caches) -> (fulls, refs, new caches,
    stats), fulls and refs as uint bits per rank."""
    mesh = mesh_of((N,), ("fsdp",))
    ts = _tensors()
    specs = {k: fsdp.spec_for(t.axis, len(t.shape), "fsdp") for k, t in ts.items()}

    def body(shards, caches):
        fulls, new, stats = fsdp.gather(ts, shards, caches, fsdp.GatherSetup(), "fsdp")
        refs = {k: lax.all_gather(bitfields.to_bits(s), "fsdp", axis=ts[k].axis, tiled=True)
                for k, s in shards.items()}
        per_rank = lambda tree: jax.tree.map(lambda v: v[None], tree)  # noqa: E731
        return (per_rank({k: bitfields.to_bits(f) for k, f in fulls.items()}), per_rank(refs), new,
                per_rank(stats))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()),
                                 out_specs=(P("fsdp"), P("fsdp"), P(), P("fsdp"))))


def _steps(rng):
    """Full tensors per step: priming, churn, every exponent moving plus NaN payloads,
    infinities, signed zeros and subnormals, then sign flips."""
    x = {k: weights(rng, shape, dt) for k, shape, _, dt in TENSORS}
    yield x
    x = {k: churn(rng, v, 0.02) for k, v in x.items()}
    yield x
    yield {k: adversarial(rng, v.shape, v.dtype) for k, v in x.items()}
    yield {k: churn(rng, v, 0.0, flip_signs=0.3) for k, v in x.items()}
    yield {k: churn(rng, v, 1.0) for k, v in x.items()}


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_bucketed_gather_is_bitwise(mode):
    mesh = mesh_of((N,), ("fsdp",))
    ts = _tensors()
    fn = _gather_fn(mode)
    caches = {k: ciera_jax.init_cache(t.shape, t.dtype, mode) for k, t in ts.items()}
    rng = np.random.default_rng(3)
    rungs = []
    for x in _steps(rng):
        shards = {k: jax.device_put(jnp.asarray(v), jax.sharding.NamedSharding(
            mesh, fsdp.spec_for(ts[k].axis, v.ndim, "fsdp"))) for k, v in x.items()}
        fulls, refs, caches, stats = fn(shards, caches)
        for k, v in x.items():
            np.testing.assert_array_equal(np.asarray(fulls[k]), np.asarray(refs[k]))
            np.testing.assert_array_equal(np.asarray(fulls[k])[0], bits_of(v))
            got = np.asarray(caches[k].words if mode == "word" else caches[k].exp)
            want = (bits_of(v) if mode == "word" else
                    np.asarray(bitfields.exponent(jnp.asarray(v))))
            np.testing.assert_array_equal(got, want)
            assert bool(np.asarray(caches[k].primed))
        # the bucket's members took one option together
        rung = {k: int(np.asarray(stats[k]["rung"])[0]) for k in ("q", "k", "b")}
        assert len(set(rung.values())) == 1
        rungs.append(rung["q"])
    assert len(set(rungs)) > 1  # the steps took different options (priming, patches, ...)


def _all_gathers(ts: dict) -> int:
    """All-gathers in the compiled ``fsdp.gather`` of ``ts`` (exponent caches)."""
    mesh = mesh_of((N,), ("fsdp",))
    specs = {k: fsdp.spec_for(t.axis, len(t.shape), "fsdp") for k, t in ts.items()}

    def body(shards, caches):
        return fsdp.gather(ts, shards, caches, fsdp.GatherSetup(), "fsdp")[0]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=specs))
    shards = {k: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=jax.sharding.NamedSharding(
        mesh, specs[k])) for k, t in ts.items()}
    caches = {k: ciera_jax.init_cache(t.shape, t.dtype, "exponent") for k, t in ts.items()}
    return len(hlo.all_gathers(fn.lower(shards, caches).as_text(dialect="hlo")))


def test_one_codec_per_bucket(monkeypatch):
    """The bucketed gather's transfers are those of ONE tensor of the bucket's size plus the
    float32 tensor's own; gathered alone, each member brings its own."""
    ts = _tensors()
    size = sum(int(np.prod(ts[k].shape)) for k in ("q", "k", "b"))
    one = {"bucket": fsdp.GatheredTensor("bucket", 0, (size,), BF16), "w32": ts["w32"]}
    assert _all_gathers(ts) == _all_gathers(one)
    monkeypatch.setattr(buckets, "MAX_ELEMENTS", 0)
    alone = {k: {k: t} for k, t in ts.items()}
    assert _all_gathers(ts) == sum(_all_gathers(a) for a in alone.values()) > _all_gathers(one)

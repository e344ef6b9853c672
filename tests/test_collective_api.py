"""Gradients, plain dtypes, pytrees, compiled HLO and error messages of the compressed gather."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.planning.costmodel import CHECKSUM_BYTES
from bitdata import BF16, F32, adversarial, bits_of, churn, weights
from harness import encode_vmap_matches_layerwise, mesh_of, run_steps

MESH = ((8,), ("fsdp",))


def _put(mesh, x, spec):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_gradients_equal_those_through_lax_all_gather(dtype):
    mesh = mesh_of(*MESH)
    rng = np.random.default_rng(0)
    shape = (64, 24)
    w_ct = jnp.asarray(rng.standard_normal(shape), dtype)

    def body(x, cache, w):
        def loss_ciera(x):
            full, new_cache, _ = ciera_jax.all_gather(x, cache, "fsdp", axis=1)
            return jnp.sum((full * w).astype(jnp.float32) ** 2), new_cache

        def loss_plain(x):
            return jnp.sum((lax.all_gather(x, "fsdp", axis=1, tiled=True) * w)
                           .astype(jnp.float32) ** 2)

        (_, new_cache), g_ciera = jax.value_and_grad(loss_ciera, has_aux=True)(x)
        g_plain = jax.grad(loss_plain)(x)
        g_bits = jax.grad(lambda x: jnp.sum(
            (ciera_jax.plain_all_gather(x, "fsdp", axis=1) * w).astype(jnp.float32) ** 2))(x)
        return g_ciera, g_plain, g_bits, new_cache

    spec = P(None, "fsdp")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), P()),
                                 out_specs=(spec, spec, spec, P())))
    cache = ciera_jax.init_cache(shape, dtype)
    x = weights(rng, shape, dtype, scale=1.0)
    for _ in range(3):  # unprimed (plain) step, then compressed steps
        g_c, g_p, g_b, cache = step(_put(mesh, x, spec), cache, w_ct)
        np.testing.assert_array_equal(bits_of(g_c), bits_of(g_p))
        np.testing.assert_array_equal(bits_of(g_b), bits_of(g_p))
        x = churn(rng, x, 0.01)
    assert bool(cache.primed)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.uint8])
def test_other_dtypes_gather_plainly_and_exactly(dtype):
    rng = np.random.default_rng(1)
    word = np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")
    x = rng.integers(0, np.iinfo(word).max, size=(16, 8), dtype=word).view(dtype)
    for full, ref, stats, cache in run_steps([x, x]):
        assert full.dtype == np.dtype(dtype)
        for rank in range(8):
            np.testing.assert_array_equal(bits_of(full[rank]), ref[rank])
            np.testing.assert_array_equal(bits_of(full[rank]), bits_of(x))
        assert (stats["rung"] == -1).all() and not stats["fallback"].any()
        assert (stats["sent_bytes"] == stats["plain_bytes"]).all()


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_bool_gathers_bitwise_like_lax_all_gather_in_both_cache_modes(mode):
    """No compressed format for ``bool``: ``compress=None`` gathers it plainly, bit for bit
    what ``lax.all_gather`` gives, whichever cache it is handed."""
    mesh = mesh_of(*MESH)
    x = np.random.default_rng(2).random((16, 8)) < 0.5

    def body(x, cache):
        full, new_cache, stats = ciera_jax.all_gather(x, cache, "fsdp")
        return full[None], lax.all_gather(x, "fsdp", tiled=True)[None], stats["rung"][None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                               out_specs=(P("fsdp"), P("fsdp"), P("fsdp"))))
    full, ref, rung = fn(_put(mesh, x, P("fsdp")), ciera_jax.init_cache(x.shape, np.bool_,
                                                                         mode=mode))
    full, ref = np.asarray(full), np.asarray(ref)
    assert full.dtype == ref.dtype == np.bool_
    np.testing.assert_array_equal(full.view(np.uint8), ref.view(np.uint8))
    np.testing.assert_array_equal(full[0], x)
    assert (np.asarray(rung) == -1).all()  # gathered plainly


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_forcing_compression_of_bool_is_refused_in_one_line(mode):
    mesh, spec, fn = _gather_fn(np.bool_, (16, 8), compress=True)
    x = _put(mesh, np.zeros((16, 8), np.bool_), spec)
    with pytest.raises(TypeError, match="compression forced for dtype bool") as e:
        fn(x, ciera_jax.init_cache((16, 8), np.bool_, mode=mode))
    assert "\n" not in str(e.value)


def _gather_fn(dtype, shape, axis=0, **kw):
    mesh = mesh_of(*MESH)
    spec = [None] * len(shape)
    spec[axis] = "fsdp"
    spec = P(*spec)

    def body(x, cache):
        full, c, s = ciera_jax.all_gather(x, cache, "fsdp", axis=axis, **kw)
        return full[None], c

    return mesh, spec, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()),
                                             out_specs=(P("fsdp"), P())))


def test_errors_name_the_tensor_and_the_fix():
    mesh, spec, fn = _gather_fn(BF16, (16, 8))
    x = _put(mesh, np.zeros((16, 8), BF16), spec)
    with pytest.raises(ValueError, match=r"cache shape \(16, 4\).*gathered shape \(16, 8\)"):
        fn(x, ciera_jax.init_cache((16, 4), BF16))
    with pytest.raises(ValueError, match="made for float32.*bfloat16"):
        fn(x, ciera_jax.init_cache((16, 8), np.float32))
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        ciera_jax.all_gather(jnp.zeros((4,), BF16), ciera_jax.init_cache((32,), BF16), "fsdp")
    with pytest.raises(ValueError, match="gather axis 2 is out of range"):
        jax.jit(jax.shard_map(
            lambda x, c: ciera_jax.all_gather(x, c, "fsdp", axis=2)[1], mesh=mesh,
            in_specs=(spec, P()), out_specs=P()))(x, ciera_jax.init_cache((16, 8), BF16))
    with pytest.raises(ValueError, match="impl must be one of"):
        _gather_fn(BF16, (16, 8), impl="cuda")[2](x, ciera_jax.init_cache((16, 8), BF16))
    xi = _put(mesh, np.zeros((16, 8), np.int32), spec)
    with pytest.raises(TypeError, match="compression forced for dtype int32"):
        _gather_fn(np.int32, (16, 8), compress=True)[2](xi, ciera_jax.init_cache((16, 8),
                                                                                 np.int32))


def test_tree_gather_agrees_once_for_all_tensors():
    mesh = mesh_of(*MESH)
    rng = np.random.default_rng(2)
    tree = {"w_ExDxF": weights(rng, (8, 8, 16), BF16), "norm": weights(rng, (8,), F32),
            "ids": np.arange(16, dtype=np.int32)}
    specs = {"w_ExDxF": P("fsdp"), "norm": P("fsdp"), "ids": P("fsdp")}
    caches = ciera_jax.init_cache_tree(tree)

    def body(t, c):
        full, new_c, stats = ciera_jax.all_gather_tree(t, c, "fsdp")
        return jax.tree.map(lambda v: v[None], full), new_c

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P()),
                       out_specs=(jax.tree.map(lambda _: P("fsdp"), specs), P()))
    placed = {k: _put(mesh, v, specs[k]) for k, v in tree.items()}
    jaxpr = str(jax.make_jaxpr(fn)(placed, caches))
    assert len(re.findall(r"\bpmax\b", jaxpr)) == 1, "one agreement collective per call"
    for _ in range(2):
        full, caches = jax.jit(fn)(placed, caches)
        for k, v in tree.items():
            for rank in range(8):
                np.testing.assert_array_equal(bits_of(np.asarray(full[k])[rank]), bits_of(v))
    assert bool(caches["w_ExDxF"].primed) and caches["ids"].exp.shape == (1,)


def test_compiled_hlo_gathers_uint8_payload():
    shape = (64, 128)
    mesh, spec, fn = _gather_fn(BF16, shape)
    x = _put(mesh, adversarial(np.random.default_rng(3), shape, BF16), spec)
    cache = ciera_jax.init_cache(shape, BF16)
    hlo = fn.lower(x, cache).compile().as_text()
    gathers = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)
    n_local = shape[0] * shape[1] // 8
    # The main transfer is exactly the 1-byte payload and the checksum: (8, n_local + 4); the
    # priming/fallback path gathers the rest of the shard's bits as bytes.
    assert f"u8[8,{n_local + CHECKSUM_BYTES}]" in gathers, gathers
    assert f"u8[8,{2 * n_local - n_local}]" in gathers, "the fallback gathers the rest of the bits"
    assert not any(g.startswith("bf16[") for g in gathers), "no bf16 gather may survive"


def test_phases_encoded_ahead_match_the_one_call_gather():
    """encode at the end of one step, agree + exchange in the next: same bits, same stats."""
    mesh = mesh_of(*MESH)
    rng = np.random.default_rng(4)
    shape = (8, 16, 24)
    spec = P(None, "fsdp")

    def ahead(x, cache):
        e = ciera_jax.encode(x, cache, "fsdp", axis=1)
        full, new_cache, st = ciera_jax.exchange(x, e, cache, ciera_jax.agree(e, "fsdp"), "fsdp")
        one, _, st_one = ciera_jax.all_gather(x, cache, "fsdp", axis=1)
        same = jnp.all(lax.bitcast_convert_type(full, jnp.uint16) ==
                       lax.bitcast_convert_type(one, jnp.uint16))
        return full[None], new_cache, (same & (st["sent_bytes"] == st_one["sent_bytes"]))[None]

    fn = jax.jit(jax.shard_map(ahead, mesh=mesh, in_specs=(spec, P()),
                               out_specs=(P("fsdp"), P(), P("fsdp"))))
    cache = ciera_jax.init_cache(shape, BF16)
    x = weights(rng, shape, BF16)
    for _ in range(3):
        full, cache, same = fn(_put(mesh, x, spec), cache)
        assert np.asarray(same).all()
        for rank in range(8):
            np.testing.assert_array_equal(bits_of(np.asarray(full)[rank]), bits_of(x))
        x = churn(rng, x, 0.01)


def test_encode_vmaps_over_stacked_layers():
    """Stacked layers can be encoded in one vmap; it equals encoding layer by layer."""
    assert encode_vmap_matches_layerwise("exponent", seed=6)

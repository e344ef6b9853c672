"""The @ciera_jax.gathered decorator on a user's own NNX module with ``fsdp_axis`` metadata,
rule tables, sharded clipping, and the int8 baseline gather."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp
from ciera_jax.collective import quantized
from flax_nets import all_compressed

N = 8


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("fsdp",))


# --- the README example: a user's MLP, not ours --------------------------------------------

class MLP(nnx.Module):
    def __init__(self, d, f, rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (d, f)), fsdp_axis=0)
        self.w_out = nnx.Param(init(rngs.params(), (f, d)), fsdp_axis=1)
        self.scale = nnx.Param(jnp.ones((d,)))  # no fsdp_axis: replicated

    @ciera_jax.gathered(axis_name="fsdp")
    def __call__(self, x):
        h = jax.nn.gelu(x @ self.w_in[...])
        return (h @ self.w_out[...]).astype(jnp.float32) * self.scale[...]


def make_step(mesh, graphdef, specs, mode):
    def loss_fn(params, caches, x):
        model = fsdp.merge(graphdef, params, caches)
        with fsdp.gather_mode(model, mode):
            y = model(x)
        loss = jnp.mean(jnp.square(y)) / lax.axis_size("fsdp")  # global mean over ranks
        return loss, (y, nnx.state(model, fsdp.ExponentCacheVar), fsdp.gather_stats(model))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(), P("fsdp")),
                       out_specs=(P("fsdp"), specs, P(), P()))
    def step(params, caches, x):
        grads, (y, caches, stats) = jax.grad(loss_fn, has_aux=True)(params, caches, x)
        return y, grads, caches, stats

    return step


def _bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def test_decorator_on_user_module_matches_plain_bitwise(mesh):
    model = fsdp.attach_caches(MLP(64, 128, nnx.Rngs(0)))
    graphdef, params, caches = nnx.split(model, nnx.Param, fsdp.ExponentCacheVar)
    specs = fsdp.state_specs(model, params, n=N)
    assert specs["w_in"] == P("fsdp", None) and specs["w_out"] == P(None, "fsdp")
    assert specs["scale"] == P()
    params = fsdp.put(params, specs, mesh)
    caches = fsdp.put(caches, P(), mesh)
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.bfloat16)

    results = {}
    for mode in ("ciera", "plain"):
        step = make_step(mesh, graphdef, specs, mode)
        c = caches
        outs = []
        for i in range(3):  # prime, then compressed gathers from the cache
            p = jax.tree.map(lambda a: a * (1 + 1e-3 * i), params)
            y, g, c, stats = step(p, c, x)
            outs.append((y, g, stats))
        results[mode] = outs
    for (yc, gc, sc), (yp, gp, sp) in zip(results["ciera"], results["plain"]):
        for a, b in zip(_bits((yc, gc)), _bits((yp, gp))):
            np.testing.assert_array_equal(a, b)
    # ciera: the first gather primes (fallback); later ones send less than plain
    first, last = results["ciera"][0][2], results["ciera"][-1][2]
    assert sorted(first) == sorted(last) == ["w_in", "w_out"]
    assert all(int(s["fallback"]) == 1 for s in first.values())
    assert all_compressed(last), last

    # and it is the same math as the unsharded module (up to summation order)
    ref_model = MLP(64, 128, nnx.Rngs(0))
    y_ref = ref_model(x)
    np.testing.assert_allclose(np.asarray(results["plain"][0][0]), np.asarray(y_ref),
                               rtol=2e-2, atol=2e-2)
    g_ref = nnx.grad(lambda m: jnp.mean(jnp.square(m(x))))(ref_model)
    for k in ("w_in", "w_out", "scale"):
        np.testing.assert_allclose(np.asarray(results["plain"][0][1][k][...]),
                                   np.asarray(g_ref[k][...]), rtol=5e-2, atol=1e-4)


def test_missing_caches_is_a_clear_error(mesh):
    model = MLP(64, 128, nnx.Rngs(0))  # no attach_caches
    graphdef, params = nnx.split(model, nnx.Param)
    specs = fsdp.state_specs(model, params, n=N)

    def f(params, x):
        return fsdp.set_gather_mode(nnx.merge(graphdef, params), "ciera")(x)

    with pytest.raises(ValueError, match="attach_caches") as e:
        jax.shard_map(f, mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=P("fsdp"))(
            fsdp.put(params, specs, mesh), jnp.ones((16, 64), jnp.bfloat16))
    # the fix names every cache mode, word mode first (the one with the smaller wire)
    assert "mode='word'" in str(e.value) and "mode='exponent'" in str(e.value)
    assert "exponent cache" not in str(e.value)


def test_rule_table_and_divisibility():
    from ciera_models.model.sharding import RULES

    assert fsdp.rule_axis("w_gate_ExDxF", RULES) == 1
    assert fsdp.rule_axis("w_down_ExFxD", RULES) == 2
    assert fsdp.rule_axis("embed_VxD", RULES) == 1
    assert fsdp.rule_axis("wo_DxD", RULES) == 1
    assert fsdp.rule_axis("attn_norm", RULES) is None and fsdp.rule_axis("bq_D", RULES) is None
    # the library's own convention names no weight: the first D of the shape letters
    assert fsdp.rule_axis("w_down_ExFxD") == 2 and fsdp.rule_axis("wo_DxD") == 0
    assert fsdp.rule_axis("attn_norm") is None and fsdp.rule_axis("bq_D") is None
    with pytest.raises(ValueError, match="does not divide"):
        fsdp.check_divisible("w", (12, 5), 0, 8)
    with pytest.raises(ValueError, match="unknown gather"):
        with fsdp.gather_mode(MLP(8, 8, nnx.Rngs(0)), "zip"):
            pass
    with pytest.raises(TypeError, match="gather_mode.model, 'plain'"):
        with fsdp.gather_mode("plain"):  # the mode lives on the model's modules
            pass


def test_global_norm_clipping_under_sharding(mesh):
    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal((16, 4)).astype(np.float32),
            "b": rng.standard_normal((3,)).astype(np.float32)}
    specs = {"a": P("fsdp", None), "b": P()}
    ref = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in tree.values()))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs,), out_specs=(specs, P()))
    def clip(t):
        return fsdp.clip_by_global_norm(t, specs, 1.0)

    clipped, norm = clip(fsdp.put(tree, specs, mesh))
    np.testing.assert_allclose(float(norm), ref, rtol=1e-5)
    got = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in jax.tree.leaves(clipped)))
    np.testing.assert_allclose(got, 1.0, rtol=1e-5)


def test_int8_gather_close_lossy_and_grad(mesh):
    x2 = jax.random.normal(jax.random.key(0), (N * 4, 300), jnp.float32)

    def f(xs):
        full = quantized.int8_all_gather(xs, "fsdp", axis=0)
        return full, jax.grad(lambda v: jnp.sum(quantized.int8_all_gather(v, "fsdp", axis=0)
                                                * jnp.arange(full.size).reshape(full.shape)))(xs)

    full, g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("fsdp"),
                                    out_specs=(P("fsdp"), P("fsdp"))))(x2)
    full = np.asarray(full).reshape(N, N * 4, 300)[0]  # every rank holds the whole tensor
    err = np.abs(full - np.asarray(x2))
    assert err.max() > 0  # lossy
    assert err.max() <= np.abs(np.asarray(x2)).max() / 127 / 2 + 1e-6
    # backward = psum_scatter of the cotangent: each rank adds the same ramp
    ramp = np.arange(full.size, dtype=np.float32).reshape(full.shape)
    np.testing.assert_array_equal(np.asarray(g), N * ramp)


def test_quantize_roundtrip_blocks():
    x = jnp.concatenate([jnp.zeros(256), jnp.linspace(-3, 3, 300)])
    q, s = quantized.quantize(x)
    assert q.dtype == jnp.int8 and q.shape == (3, 256) and s.shape == (3,)
    y = quantized.dequantize(q, s, x.shape, jnp.float32)
    assert np.all(np.asarray(y[:256]) == 0)
    assert float(jnp.max(jnp.abs(y - x))) <= 3 / 127 / 2 + 1e-6
    assert quantized.wire_bytes(600) == 3 * 260


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.mlp = MLP(16, 32, rngs)

    def __call__(self, x):
        return x + self.mlp(x), jnp.float32(0)


class Stacked(nnx.Module):
    def __init__(self, rngs, layers=2):
        self.first = MLP(16, 32, rngs)
        self.layers = fsdp.stack(Layer, layers, rngs)

    def __call__(self, x):
        return fsdp.scan_layers(self.layers, self.first(x))[0]


@pytest.mark.parametrize("layers", [2, 4])  # 4: the prepared loop rolled (3 trips)
def test_prepared_step_leaves_caches_and_stats_in_module_state(mesh, layers):
    # The trainer's way (prefetching scan, step-level agreement): what the gathers made is
    # the model's state after the forward, the same a per-call gather leaves.
    model = fsdp.attach_caches(Stacked(nnx.Rngs(0), layers))
    tensors = fsdp.gathered_tensors(model)
    assert sorted(tensors) == ["first/w_in", "first/w_out", "layers/mlp/w_in", "layers/mlp/w_out"]
    graphdef, params, caches = nnx.split(model, nnx.Param, fsdp.ExponentCacheVar)
    specs = fsdp.state_specs(model, params, n=N)
    compress = {k: True for k in tensors}

    def forward(params, caches, x, mode):
        """Prepared (one encode and agreement for the step) and per call (each call encodes
        and agrees itself): ``(caches, stats, y)`` of each."""
        encoded = fsdp.encode_tensors(tensors, fsdp.param_dict(params), fsdp.cache_dict(caches),
                                      compress)
        m = fsdp.prepare(fsdp.merge(graphdef, params, caches), encoded,
                         fsdp.agree_tensors(tensors, encoded), mode)
        y = m(x)
        with fsdp.gather_mode(fsdp.merge(graphdef, params, caches), mode) as per_call:
            y_call = per_call(x)
        return ((nnx.state(m, fsdp.GatherCacheVar), fsdp.gather_stats(m), y),
                (nnx.state(per_call, fsdp.GatherCacheVar), fsdp.gather_stats(per_call), y_call))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(), P("fsdp")),
                       out_specs=((P(), P(), P("fsdp")),) * 2 + ((P("fsdp"),) * 2,))
    def step(params, caches, x):
        prepared, per_call = forward(params, caches, x, "ciera")
        plain = forward(params, caches, x, "plain")
        return prepared, per_call, (plain[0][2], plain[1][2])

    x = jax.random.normal(jax.random.key(1), (16, 16), jnp.bfloat16)
    params, caches = fsdp.put(params, specs, mesh), fsdp.put(caches, P(), mesh)
    stats = []
    for i in range(2):  # prime, then the gathers through the caches the first step left
        p = jax.tree.map(lambda a: a * (1 + 1e-2 * i), params)
        prepared, per_call, plain = step(p, caches, x)
        # the one gather, prepared or per call: the same caches and stats, bit for bit, and
        # each path's output is bitwise that path's with plain gathers
        for a, b in zip(_bits(prepared[:2]), _bits(per_call[:2])):
            np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
        for a, b in zip(_bits((prepared[2], per_call[2])), _bits(plain)):
            np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
        if i == 0:  # (the two paths' float ops differ in order: equal outputs at init only)
            np.testing.assert_array_equal(*_bits((prepared[2], per_call[2])))
        caches = prepared[0]
        stats.append(prepared[1])
    first, second = stats
    state = fsdp.cache_dict(caches)
    assert sorted(state) == sorted(tensors) and sorted(first) == sorted(tensors)
    assert all(bool(np.all(np.asarray(c.primed))) for c in state.values())  # the gathers primed
    assert all(bool(np.all(np.asarray(s["fallback"]) == 1)) for s in first.values())
    assert all_compressed(second), second
    assert np.asarray(first["layers/mlp/w_in"]["rung"]).shape == (layers,)


def test_the_one_gather_is_values_in_values_out(mesh):
    """``fsdp.gather`` (what every path calls): shards, caches and the plan in; full weights,
    new caches and stats out, with no module anywhere."""
    w = jax.random.normal(jax.random.key(2), (N * 4, 16), jnp.bfloat16)
    t = fsdp.GatheredTensor("w", 0, (N * 4, 16), jnp.bfloat16)
    cache = ciera_jax.init_cache((N * 4, 16), jnp.bfloat16, "exponent")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("fsdp"), P()),
                       out_specs=(P("fsdp"), P("fsdp"), P(), P(), P()))
    def f(shard, cache):
        fulls, new, stats = fsdp.gather({"w": t}, {"w": shard}, {"w": cache}, fsdp.GatherSetup(),
                                        "fsdp")
        plain, none, p_stats = fsdp.gather({"w": t}, {"w": shard}, {}, fsdp.GatherSetup("plain"),
                                           "fsdp")
        assert not none  # a plain gather makes no cache
        return fulls["w"][None], plain["w"][None], new["w"], stats["w"], p_stats["w"]

    cache = fsdp.put(cache, P(), mesh)
    for step in range(2):  # a fresh cache primes; the next gather reads the one it left
        full, plain, cache, stats, p_stats = f(fsdp.put(w, P("fsdp"), mesh), cache)
        for a, b in zip(_bits((full, plain)), _bits((np.broadcast_to(w, (N, *w.shape)),) * 2)):
            np.testing.assert_array_equal(a, b)
        assert bool(np.asarray(cache.primed)) and int(stats["fallback"]) == (step == 0)
        w = (w.astype(jnp.float32) * 1.01).astype(jnp.bfloat16)
    assert int(stats["sent_bytes"]) < int(stats["plain_bytes"])
    assert int(p_stats["rung"]) == -1 and int(p_stats["sent_bytes"]) == int(
        p_stats["plain_bytes"])


def test_attach_caches_on_an_abstract_model_makes_no_arrays():
    """A model from ``nnx.eval_shape`` gets abstract caches: the inventory and specs of a
    47B-parameter model without allocating its exponent caches (more memory than a host
    has)."""
    from ciera_models.model.configs import get_config
    from ciera_models.model.transformer import abstract_model

    model = fsdp.attach_caches(abstract_model(get_config("mixtral-8x7b")))
    leaves = jax.tree.leaves(nnx.state(model, fsdp.GatherCacheVar))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(int(np.prod(x.shape)) for x in leaves) > 40e9  # an exponent byte per weight


def test_renamed_names_fail_naming_the_new_ones():
    """A module's static gather mode is ``GatherSetup`` (``setup_of``); the trainer's choice of
    compressed tensors is ``choose_compressed``: each old name fails in one line naming it."""
    import ciera_models.train

    with pytest.raises(ImportError, match=r"fsdp\.Plan is renamed: use .*fsdp\.GatherSetup$"):
        fsdp.Plan
    with pytest.raises(ImportError, match=r"use ciera_jax\.fsdp\.setup_of"):
        from ciera_jax.fsdp import plan_of  # noqa: F401
    with pytest.raises(ImportError, match=r"use ciera_models\.train\.choose_compressed"):
        ciera_models.train.make_plan
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        fsdp.no_such_name

"""The MoE transformer: parameter counts vs published totals, names/shapes vs the inventory,
dropless routing vs a per-token reference, and the data pipeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ciera_models.model import configs
from ciera_models.train import data
from ciera_models.model.transformer import (MoE, Transformer, abstract_model, attention, param_count,
                                rms_norm, swiglu)

BIG = [n for n, c in configs.CONFIGS.items() if c.published_total_params]


@pytest.mark.parametrize("name", BIG)
def test_param_counts_match_published(name):
    cfg = configs.get_config(name)
    n = param_count(abstract_model(cfg))
    assert n == configs.total_params(cfg)
    assert abs(n / cfg.published_total_params - 1) < 0.02, (n, cfg.published_total_params)


@pytest.mark.parametrize("name", ["tiny", "deepseek-moe-16b", "qwen1.5-moe-a2.7b"])
def test_param_names_and_shapes_are_the_inventory(name):
    # Layers are stacked: a (L, *shape) parameter under `layers` (MoE layers) or
    # `dense_layers` (DeepSeek's leading dense layers) is L per-layer tensors of the inventory.
    cfg = configs.get_config(name)
    state = nnx.state(abstract_model(cfg), nnx.Param)
    first = {"dense_layers": 0, "layers": cfg.n_dense_layers}
    got = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [getattr(k, "key", k) for k in path]
        name_ = [k for k in keys if isinstance(k, str) and k != "value"][-1]
        if keys[0] in first:
            for i in range(x.shape[0]):
                got[(first[keys[0]] + i, name_)] = tuple(x.shape[1:])
        else:
            got[(None, name_)] = tuple(x.shape)
    want = {(t.layer, t.name): t.shape for t in configs.tensor_inventory(cfg)}
    assert got == want


def test_stacked_forward_is_the_layer_by_layer_forward():
    # The scanned stack computes what applying its layers one by one computes.
    cfg = configs.get_config("tiny")
    toks = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)

    def by_hand(t):
        model = Transformer(cfg, nnx.Rngs(0))
        graphdef, state = nnx.split(model.layers)
        x, pos = model.embed(t), jnp.arange(t.shape[1])
        for i in range(cfg.n_layers):
            x, _ = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))(x, pos)
        return model.head(x)

    scanned = jax.jit(lambda t: Transformer(cfg, nnx.Rngs(0))(t)[0])
    np.testing.assert_allclose(np.asarray(scanned(toks)),
                               np.asarray(jax.jit(by_hand)(toks)), rtol=1e-5, atol=1e-5)


def _einsum_attention(q, k, v):
    """The attention before ``jax.nn.dot_product_attention``: bf16 einsums accumulating in
    float32, scores scaled after the product, GQA by repeating the kv heads."""
    bf, f32 = jnp.bfloat16, jnp.float32
    H, Q, L = q.shape[2], q.shape[3], q.shape[1]
    k, v = (jnp.repeat(t, H // t.shape[2], axis=2) for t in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(bf), k.astype(bf),
                   preferred_element_type=f32) / jnp.sqrt(f32(Q))
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(bf), v.astype(bf), preferred_element_type=f32)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_attention_is_the_einsum_attention(heads, kv_heads):
    # XLA's implementation, causal and grouped-query: the einsum attention's output rounded to
    # bf16 (where the output projection rounded it before), gradients within bf16 rounding.
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (2, 64, heads, 16))
    k, v = (jax.random.normal(r, (2, 64, kv_heads, 16)) for r in ks[1:])
    new = jax.jit(lambda *a: attention(*a, "xla").astype(jnp.float32))
    np.testing.assert_allclose(new(q, k, v), _einsum_attention(q, k, v).astype(jnp.bfloat16)
                               .astype(jnp.float32), rtol=1e-2, atol=1e-2)
    loss = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))  # noqa: E731
    for a, b in zip(jax.jit(loss(new))(q, k, v), jax.jit(loss(_einsum_attention))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=2e-2 * float(jnp.max(jnp.abs(b))))
    with pytest.raises(ValueError, match="unknown attention"):
        attention(q, k, v, "flash")


def test_moe_dropless_matches_per_token_reference():
    cfg = configs.get_config("tiny")
    moe = MoE(cfg, nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(0), (2, 3, cfg.d_model), jnp.float32)
    y, aux = moe(x)
    h = rms_norm(x, moe.mlp_norm[...]).reshape(-1, cfg.d_model)
    probs = jax.nn.softmax(h.astype(jnp.bfloat16).astype(jnp.float32)
                           @ moe.router_DxE[...].astype(jnp.bfloat16).astype(jnp.float32), -1)
    bf = lambda w: w.astype(jnp.bfloat16)
    w_gate, w_up, w_down = (bf(moe.w_gate_ExDxF[...]), bf(moe.w_up_ExDxF[...]),
                            bf(moe.w_down_ExFxD[...]))

    def one_token(h_t, probs_t):  # its top_k experts, one by one
        p, e = jax.lax.top_k(probs_t, cfg.top_k)
        return sum(p[j] * swiglu(h_t[None], w_gate[e[j]], w_up[e[j]], w_down[e[j]])[0]
                   for j in range(cfg.top_k))

    ref = jax.jit(jax.vmap(one_token))(h, probs)  # one compile, not one per op and token
    np.testing.assert_allclose(np.asarray(y).reshape(-1, cfg.d_model), np.asarray(ref),
                               rtol=2e-2, atol=2e-4)
    assert float(aux["lb_loss"]) > 0.5 and float(aux["z_loss"]) > 0


def test_builtin_corpus_deterministic_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("CIERA_CACHE_DIR", str(tmp_path))
    ds = data.load_dataset(None, 256, 64)
    assert ds.train.dtype == np.uint8 and len(ds.train) > 100_000 and len(ds.val) > 1000
    assert list(tmp_path.glob("stdlib-bytes-*.bin"))
    ds2 = data.load_dataset(None, 256, 64)  # from the disk cache
    np.testing.assert_array_equal(ds.train, ds2.train)
    b = ds.batch(0, 5, 4, 64)
    assert b.shape == (4, 65) and b.dtype == np.int32
    np.testing.assert_array_equal(b, ds2.batch(0, 5, 4, 64))
    assert not np.array_equal(b, ds.batch(0, 6, 4, 64))
    assert not np.array_equal(b, ds.batch(1, 5, 4, 64))


def test_token_file_loader(tmp_path):
    p = tmp_path / "toks.bin"
    np.arange(5000, dtype=np.uint16).tofile(p)
    ds = data.load_dataset(str(p), 8000, 16)
    assert ds.train.dtype == np.uint16 and len(ds.train) + len(ds.val) == 5000
    q = tmp_path / "toks.u32"
    np.arange(5000, dtype=np.uint32).tofile(q)
    assert data.load_dataset(str(q), 8000, 16).train.dtype == np.uint32
    with pytest.raises(FileNotFoundError, match="not found"):
        data.load_dataset(str(tmp_path / "nope.bin"), 256, 16)
    with pytest.raises(ValueError, match="vocab_size"):
        data.load_dataset(str(p), 256, 16)

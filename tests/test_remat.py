"""Remat policies of the prepared layer scan (``fsdp.prepare(..., remat=)``, ``ciera train
--remat``): the saved VJP is the VJP, keeps no weight, saves what the policy names; and a train
step under each policy stays bitwise plain FSDP's, in both cache modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from ciera_jax import fsdp
from ciera_jax.fsdp import remat
from ciera_models.train import TrainConfig, make_mesh, train

STEPS = 3


def _layer(w, inputs):
    """A toy layer: two weights, tagged projections, an untagged nonlinearity."""
    x, = inputs
    q = checkpoint_name(x @ w["q"], "query_proj")
    h = jnp.tanh(q) * x
    return checkpoint_name(h @ w["o"], "out_proj"), jnp.sum(h)


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    w = {"q": jax.random.normal(k[0], (8, 8)), "o": jax.random.normal(k[1], (8, 8))}
    return w, (jax.random.normal(k[2], (4, 8)),)


@pytest.mark.parametrize("policy", ["none", "save_dot_except_mlp"])
def test_saved_vjp_is_the_vjp_and_keeps_no_weight(policy):
    w, inputs = _args()
    cts = (jnp.ones((4, 8)), jnp.float32(1.0))
    _, want = jax.vjp(_layer, w, inputs)

    @jax.jit
    def grads(w, inputs):
        layout = remat.Layout()
        out, saved = remat.vjp_saving(layout, remat.under_policy(_layer, policy), w, inputs)
        assert all(s.shape != (8, 8) for s in saved)  # neither weight, nor a copy
        if policy == "save_dot_except_mlp":  # q alone: out_proj's backward needs no output
            assert [s.shape for s in saved] == [(4, 8)]
        w2 = jax.tree.map(lambda a: a + 0, w)  # the weights got again: other values, same bits
        return out, remat.vjp_rebuilt(layout, w2, inputs, saved)(cts)

    out, got = grads(w, inputs)
    np.testing.assert_allclose(out[0], _layer(w, inputs)[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want(cts))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_copy_of_a_weight_is_refused():
    # sin(w)'s VJP keeps cos(w): a weight-shaped residual the backward could not get again.
    w, inputs = _args()
    layer = lambda w, inputs: inputs[0] @ jnp.sin(w["q"]) @ w["o"]  # noqa: E731
    with pytest.raises(ValueError, match="shaped like gathered weights"):
        jax.jit(lambda w, i: remat.vjp_saving(remat.Layout(), layer, w, i)[0])(w, inputs)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown remat policy"):
        fsdp.Plan(remat="some")
    assert set(fsdp.REMAT_POLICIES) == {"none", "save_dot_except_mlp", "full"}


@pytest.mark.parametrize("policy", [p for p in fsdp.REMAT_POLICIES
                                    if p != TrainConfig().remat])
def test_each_policy_trains_bitwise_plain_in_both_cache_modes(policy):
    """The default policy is the session's ``tiny_run`` (tests/test_train.py)."""
    def sha(**kw):
        tc = TrainConfig(config="tiny", schedule_steps=STEPS, remat=policy, **kw)
        return train(tc, steps=STEPS, seed=0, mesh=make_mesh(8), log=None).sha256

    plain = sha(gather="plain")
    assert sha(gather="ciera") == plain  # --cache auto: word caches on every tensor on CPU
    assert sha(gather="ciera", cache="exponent") == plain

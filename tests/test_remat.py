"""Remat policies of the prepared layer scan (``fsdp.prepare(..., remat=)``, ``ciera train
--remat``): the saved VJP is the VJP, keeps no weight, saves what the policy names; and a train
step under each policy stays bitwise plain FSDP's, in both cache modes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from ciera_jax import fsdp
from ciera_jax.fsdp import remat
from ciera_models.train import TrainConfig, build_trainer, make_mesh, train

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
        fsdp.GatherSetup(remat="some")
    assert set(fsdp.REMAT_POLICIES) == {"none", "save_dot_except_mlp", "full"}


def _tc(policy, cache="auto", gather="ciera"):
    return TrainConfig(config="tiny", schedule_steps=STEPS, remat=policy, plan="all",
                       cache=cache, gather=gather)


def _train(tc):
    return train(tc, steps=STEPS, seed=0, mesh=make_mesh(8), log=None)


@functools.cache
def _plain(policy):
    return _train(_tc(policy, gather="plain")).sha256


# Each non-default policy with one cache mode in the fast lane, the other mode in the slow one:
# the policy (which residuals the layer's forward keeps) and the cache (how the backward gets
# the weights again: a word cache's words, or an exponent cache's exponents plus a regather)
# meet only at the weights handed to the rebuilt VJP, so each fast case covers its policy and
# its cache's backward, and the default policy is run with both (tests/test_train.py).
CASES = [pytest.param("none", "auto", id="none-word"),
         pytest.param("save_dot_except_mlp", "exponent", id="save_dot_except_mlp-exponent"),
         pytest.param("none", "exponent", id="none-exponent", marks=pytest.mark.slow),
         pytest.param("save_dot_except_mlp", "auto", id="save_dot_except_mlp-word",
                      marks=pytest.mark.slow)]


def test_cases_cover_every_policy_and_cache_mode():
    fast = [c.values for c in CASES if not c.marks]
    assert {p for p, _ in fast} == set(fsdp.REMAT_POLICIES) - {TrainConfig().remat}
    assert {c for _, c in fast} == {"auto", "exponent"}
    assert {tuple(c.values) for c in CASES} == {(p, c) for p, _ in fast for _, c in fast}


@pytest.mark.parametrize("policy, cache", CASES)
def test_each_policy_and_cache_mode_trains_bitwise_plain(policy, cache):
    """The default policy is the session's ``tiny_run`` (word caches: tests/test_train.py) and
    test_train's injected-fault run (exponent caches). Three steps on the run's first
    program: the first primes the caches through its fallback, a later one sends coded
    gathers (the demand fits its rungs), and the backward reads the weights back from the
    caches under the policy."""
    tc = _tc(policy, cache)
    want = "word" if cache == "auto" else cache  # --cache auto: word caches everywhere on CPU
    assert set(build_trainer(tc, make_mesh(8)).cache_modes.values()) == {want}
    res = _train(tc)
    assert res.sha256 == _plain(policy)
    assert any(r["fallbacks"] < sum(r["rungs"].values()) for r in res.history[1:])

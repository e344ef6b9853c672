"""The experts' blocked grouped matmul (``ciera_models.model.grouped_matmul``, ``ciera train
--experts-matmul blocked``): ``lax.ragged_dot``'s numbers and gradients, any block size, empty
and partial groups; every remat policy trains bitwise plain FSDP with it; and compiled for
H100s it needs no ``groups x rows`` buffer, where ``ragged_dot`` does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from ciera_jax import fsdp
from ciera_models.model.grouped_matmul import grouped_matmul
from ciera_models.train import TrainConfig, make_mesh, train

SIZES = (0, 37, 100, 0, 1, 129, 30, 3)  # empty groups, one row, a group over a block of 128


def _operands(rows=sum(SIZES), K=64, N=48):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (rows, K)).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (len(SIZES), K, N)).astype(jnp.bfloat16)
    return x, w, jax.random.normal(k[2], (rows, N))


def _value_and_grads(fn, x, w, ct):
    y, vjp = jax.vjp(fn, x, w)
    return (y, *vjp(ct))


def _ragged(x, w, sizes):
    return lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("block", [16, 128, 512])
def test_matches_ragged_dot_and_its_gradients(block):
    x, w, ct = _operands()
    sizes = jnp.array(SIZES, jnp.int32)
    want = jax.jit(lambda x, w: _value_and_grads(lambda a, b: _ragged(a, b, sizes), x, w, ct))(x, w)
    got = jax.jit(lambda x, w: _value_and_grads(
        lambda a, b: grouped_matmul(a, b, sizes, block), x, w, ct))(x, w)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == b.dtype, name
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=1e-5 * float(jnp.abs(b).max()), err_msg=name)


def test_rows_past_the_groups_are_zero_and_get_no_gradient():
    x, w, ct = _operands(rows=sum(SIZES) + 20)
    sizes = jnp.array(SIZES, jnp.int32)
    fn = lambda a, b: grouped_matmul(a, b, sizes, 16)  # noqa: E731
    y, dx, dw = jax.jit(lambda x, w: _value_and_grads(fn, x, w, ct))(x, w)
    _, _, dw_used = jax.jit(lambda x, w: _value_and_grads(fn, x[:-20], w, ct[:-20]))(x, w)
    assert not np.any(np.asarray(y[-20:])) and not np.any(np.asarray(dx[-20:], np.float32))
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(dw_used, np.float32))


def test_mixed_dtypes_are_refused():
    x, w, _ = _operands()
    with pytest.raises(ValueError, match="grouped_matmul"):
        grouped_matmul(x.astype(jnp.float32), w, jnp.array(SIZES))


# save_dot_except_mlp keeps the attention's projections only: the experts' matmul runs as under
# full (forward again in the backward, then its VJP) and its saving goes through the VJP that
# none's does, so it is slow; tests/test_remat.py trains the policy itself in the fast lane.
@pytest.mark.parametrize("policy", [
    pytest.param(p, marks=pytest.mark.slow) if p == "save_dot_except_mlp" else p
    for p in fsdp.REMAT_POLICIES])
def test_each_policy_trains_bitwise_plain_with_blocked_experts(policy):
    def sha(**kw):
        tc = TrainConfig(config="tiny", schedule_steps=3, remat=policy,
                         experts_matmul="blocked", **kw)
        return train(tc, steps=3, seed=0, mesh=make_mesh(8), log=None).sha256

    assert sha(gather="ciera") == sha(gather="plain")  # word caches on every tensor on CPU


def test_auto_is_blocked_on_gpus_only():
    assert TrainConfig().experts_on("gpu") == "blocked"
    assert TrainConfig().experts_on("cpu") == "ragged"
    assert TrainConfig(experts_matmul="ragged").experts_on("gpu") == "ragged"

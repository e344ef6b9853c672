"""The compressed all-gather is bitwise a plain all-gather: every step, every rank, every path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitdata import BF16, F32, adversarial, bits_of, churn, weights
from harness import run_steps

from ciera_jax.codec.wire import ExponentWire

SHAPE = (8 * 32, 96)  # 3072 elements per rank: 0.1% churn is ~3 changed exponents per rank


def assert_exact(xs, **kw):
    """Run the steps and check every rank's result against the uint gather and the input."""
    all_stats = []
    for step, (x, (full, ref, stats, _)) in enumerate(zip(xs, run_steps(xs, **kw))):
        want = bits_of(x)
        for rank in range(full.shape[0]):
            np.testing.assert_array_equal(bits_of(full[rank]), ref[rank],
                                          err_msg=f"step {step} rank {rank}: differs from gather")
            np.testing.assert_array_equal(bits_of(full[rank]), want,
                                          err_msg=f"step {step} rank {rank}: differs from input")
        all_stats.append(stats)
    return all_stats


def trajectory(rng, x0, churns, flip_signs=0.0):
    xs = [x0]
    for c in churns:
        xs.append(churn(rng, xs[-1], c, flip_signs))
    return xs


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rate", [0.0, 0.001, 0.01, 0.1, 1.0])
def test_bitwise_over_steps_at_churn(dtype, rate):
    rng = np.random.default_rng(int(rate * 1000))
    xs = trajectory(rng, weights(rng, SHAPE, dtype), [rate] * 4)
    stats = assert_exact(xs)
    assert stats[0]["fallback"].all(), "the first gather of a fresh cache primes it plainly"
    later = np.array([s["fallback"].any() for s in stats[1:]])
    bitmap = np.array([s["bitmap"].any() for s in stats[1:]])
    if rate <= 0.1:
        assert not later.any(), "churn up to warm-up levels must travel compressed"
    if rate <= 0.1:
        assert bitmap.all() == (rate > 0), "changed exponents travel with their flags, only then"
    if rate == 1.0:
        assert later.all(), "churn above the top rung falls back to a plain gather"


@pytest.mark.parametrize("loop", [False, True], ids=["dense", "either"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_steps_around_a_fallback_and_adversarial_values(dtype, loop):
    rng = np.random.default_rng(7)
    x0 = adversarial(rng, SHAPE, dtype)
    # low churn, every exponent + signs change at once (fallback), then low churn again: the
    # step right after a fallback reads the re-primed cache.
    xs = trajectory(rng, x0, [0.001, 1.0, 0.003, 0.0, 0.01], flip_signs=0.0)
    xs.append(churn(rng, xs[-1], 0.002, flip_signs=0.5))
    stats = assert_exact(xs, loop=loop)
    fallbacks = [bool(s["fallback"].any()) for s in stats]
    assert fallbacks == [True, False, True, False, False, False, False]


@pytest.mark.parametrize("mesh_shape,names,axis_name", [
    ((2, 4), ("data", "fsdp"), "fsdp"),
    ((2, 4), ("data", "fsdp"), "data"),
])
def test_two_dimensional_mesh(mesh_shape, names, axis_name):
    rng = np.random.default_rng(3)
    xs = trajectory(rng, adversarial(rng, (16, 40), BF16), [0.01, 0.0])
    assert_exact(xs, mesh_shape=mesh_shape, mesh_names=names, axis_name=axis_name)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_expert_weights_on_each_axis(axis):
    rng = np.random.default_rng(axis)
    w_ExDxF = weights(rng, (8, 16, 24), BF16)
    xs = trajectory(rng, w_ExDxF, [0.01, 0.05])
    stats = assert_exact(xs, axis=axis)
    assert not stats[1]["fallback"].any()


CASES = [((64,), 0), ((16, 24), 1), ((2, 3, 16), 2), ((32, 8), 0)]


@settings(max_examples=12, deadline=None)
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2**16),
       rates=st.lists(st.sampled_from([0.0, 0.001, 0.02, 0.2, 1.0]), min_size=1, max_size=3),
       dtype=st.sampled_from([BF16, F32]))
def test_property_bitwise(case, seed, rates, dtype):
    shape, axis = case
    rng = np.random.default_rng(seed)
    assert_exact(trajectory(rng, adversarial(rng, shape, dtype), rates), axis=axis)


def test_wire_ratio_at_low_churn_is_about_half():
    """1M-element bf16 tensor at 0.1% churn: steady state sends <= 0.52 of a plain gather."""
    rng = np.random.default_rng(11)
    xs = trajectory(rng, weights(rng, (1024, 1024), BF16), [0.001] * 3)
    stats = list(run_steps(xs))
    for s in [s for *_, s, _ in stats][1:]:
        ratio = s["sent_bytes"].sum() / s["plain_bytes"].sum()
        assert not s["fallback"].any()
        assert ratio <= 0.52, ratio


def test_stats_report_changed_counts_and_plain_bytes():
    rng = np.random.default_rng(5)
    x0 = weights(rng, SHAPE, BF16)
    x1 = churn(rng, x0, 0.004)
    (_, _, s0, _), (_, _, s1, _) = list(run_steps([x0, x1]))
    n_local = x0.size // 8
    assert (s1["plain_bytes"] == 2 * n_local).all()
    per_rank_changed = [
        int((np.asarray(np.split(bits_of(x0) >> 7 & 0xFF, 8)[r]) !=
             np.asarray(np.split(bits_of(x1) >> 7 & 0xFF, 8)[r])).sum()) for r in range(8)]
    assert s1["changed"].tolist() == per_rank_changed
    assert (s1["agreed_changed"] == max(per_rank_changed)).all()
    assert (s1["capacity"] >= max(per_rank_changed)).all()
    wire = ExponentWire(n_local, 2)
    agreement = 4  # the changed-exponent count in the pmax
    assert (s1["sent_bytes"] == wire.sent_bytes(max(per_rank_changed)) + agreement).all()
    assert (s1["verify_failed"] == 0).all()
    # Priming: the main transfer carries the head of the bits, the fallback the rest.
    assert (s0["sent_bytes"] == 2 * n_local + 4 + agreement).all()

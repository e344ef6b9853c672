"""The cost model's measured codec pricing (the term the socket sweep found missing: a CPU codec
runs far below its counted bytes, and every escaped exponent costs a walk), priced by the
planner too; and the crossover arithmetic of ``planning/crossover.py``."""

import dataclasses
import math

import pytest

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import crossover as xo
from ciera_jax.planning.planner import mode_options

N, n = 2, 8 * 2**20  # a 16 MB bf16 tensor on two ranks
COUNTED = links.Profile("counted", alpha_s=1e-4, beta_Bps=1e8, codec_Bps=2e8, agreement_s=1e-3,
                        hbm_Bps=5e9, codec_launch_s=1e-3)
MEASURED = dataclasses.replace(COUNTED, name="measured", codec_pricing="measured",
                               word_codec_Bps=5e7, escape_s=2e-7)


def test_counted_pricing_ignores_the_measured_rates():
    t = cm.codec_time("ciera", n, N, 2, COUNTED, escapes=10**6)
    enc, dec = cm.CODEC_PASS_BYTES["ciera"]
    want = (enc * n / N + dec * n) / (COUNTED.hbm_Bps * cm.CODEC_HBM_FRACTION) + 1e-3
    assert t == pytest.approx(want)


def test_measured_pricing_takes_the_slower_rate_and_prices_each_escape():
    dense = 2 * n / MEASURED.codec_Bps  # slower than the counted bytes at 4 GB/s
    assert cm.codec_time("ciera", n, N, 2, MEASURED) == pytest.approx(dense + 1e-3)
    assert cm.codec_time("ciera", n, N, 2, MEASURED, escapes=10**6) == pytest.approx(
        dense + 1e-3 + 10**6 * 2e-7)
    assert cm.codec_time("word", n, N, 2, MEASURED) == pytest.approx(2 * n / 5e7 + 1e-3)
    # a mode with no measured rate keeps its counted bytes; a measured rate faster than the
    # counted bytes cannot make the codec cheaper than its memory traffic
    assert cm.codec_time("payload", n, N, 2, MEASURED) == cm.codec_time("payload", n, N, 2,
                                                                        COUNTED)
    fast = dataclasses.replace(MEASURED, codec_Bps=1e15)
    assert cm.codec_time("ciera", n, N, 2, fast) == cm.codec_time("ciera", n, N, 2, COUNTED)


def test_exponent_gathers_pay_for_their_escapes_and_the_planner_sees_it():
    low = cm.gather_cost("ciera", n, N, 2, MEASURED, 0.001)
    high = cm.gather_cost("ciera", n, N, 2, MEASURED, 0.05)
    escapes = N * cm.expected_change_count(n // N, 0.05) - N * cm.expected_change_count(
        n // N, 0.001)
    assert high.codec_s - low.codec_s == pytest.approx(escapes * 2e-7)
    # the planner's exponent option costs what the cost model says, escapes included
    share = cm.agreement_time(N, MEASURED)
    for rate in (0.001, 0.05):
        opts = mode_options(n, N, "bfloat16", MEASURED, rate, 0.5, share)
        t_fwd = cm.t_ciera(n, N, 1, rate, MEASURED, share)
        assert opts["exponent"][1] == pytest.approx(
            t_fwd + cm.t_payload(n, N, 2, MEASURED) + cm.reduce_scatter_time(2 * n, N,
                                                                             MEASURED))
    assert (mode_options(n, N, "bfloat16", MEASURED, 0.05, 0.5, share)["exponent"][1] >
            mode_options(n, N, "bfloat16", COUNTED, 0.05, 0.5, share)["exponent"][1])


def test_profiles_round_trip_the_new_fields(tmp_path):
    MEASURED.save(tmp_path / "p.json")
    back = links.Profile.load(tmp_path / "p.json")
    assert (back.codec_pricing, back.word_codec_Bps, back.escape_s) == ("measured", 5e7, 2e-7)
    # the built-in GPU profiles price the codec from its compiled program
    assert links.Profile.load("h100-ib400").codec_pricing == "compiled"
    with pytest.raises(ValueError, match="codec_pricing"):
        cm.codec_time("ciera", n, N, 2, dataclasses.replace(COUNTED, codec_pricing="guess"))


def test_crossover_beta_is_where_the_times_meet():
    for mode, kw in (("exponent", dict(change_rate=0.01)), ("word", dict(word_bpw=0.55))):
        beta = xo.crossover_beta(mode, n, N, MEASURED, **kw)
        assert 0 < beta < math.inf
        at = dataclasses.replace(MEASURED, beta_Bps=beta)
        assert xo.predict(mode, n, N, at, **kw) == pytest.approx(xo.predict("plain", n, N, at))
        slower = dataclasses.replace(MEASURED, beta_Bps=beta / 2)
        assert xo.predict(mode, n, N, slower, **kw) < xo.predict("plain", n, N, slower)
    free = dataclasses.replace(COUNTED, hbm_Bps=1e18, codec_launch_s=0.0, agreement_s=0.0)
    assert xo.crossover_beta("exponent", n, N, free) > 1e15  # a free codec pays on any link


def test_log_crossover_interpolates_in_log_space_and_says_when_outside():
    rates = [1e8, 1e9]
    c = xo.log_crossover(rates, [0.5, 2.0])  # log-midway: sqrt(1e8 * 1e9)
    assert c["where"] == "between" and c["rate"] == pytest.approx(math.sqrt(1e17))
    assert xo.log_crossover(rates, [0.5, 0.9]) == dict(rate=None, where="above the range")
    assert xo.log_crossover(rates, [1.1, 2.0]) == dict(rate=None, where="below the range")
    # a win at the low end after a noisy loss: the highest winning rate counts
    c = xo.log_crossover([1e8, 3e8, 1e9, 3e9], [0.4, 1.05, 0.95, 1.5])
    assert 1e9 < c["rate"] < 3e9
    assert xo.describe(dict(rate=3.5e8, where="between")) == "0.35 Gbit/s"

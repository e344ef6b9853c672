"""The host fault term the socket sweep found missing: a CPU gather above glibc's mmap threshold
faults in fresh memory on every call, so its effective bandwidth falls with its size. Its fits
recover a known answer, the cost model prices it (and so the planner), GPU profiles do not pay
it, and the timing kit counts the fresh bytes it is fitted from."""

import dataclasses
import mmap

import numpy as np
import pytest

from ciera_jax.calibrate.fit import fit_alpha_beta, fit_fresh_bytes, fit_link_and_host
from ciera_jax.calibrate.kit import time_interleaved
from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import crossover as xo
from ciera_jax.planning.planner import mode_options

MB = 2**20
SIZES = [1 * MB, 4 * MB, 8 * MB, 16 * MB, 24 * MB, 32 * MB, 48 * MB]
ALPHA, BETA, FAULT = 2e-3, 4e8, 5e8  # s per hop, link bytes/s, fault bytes/s
FROM, PER = 10 * MB, 2.0  # fresh = 2 x (B - 10 MB) above 10 MB


def fresh(b):
    return PER * max(0, b - FROM)


def gathers(N=2, fault=FAULT):
    return [dict(N=N, n_bytes=b, fresh_bytes=fresh(b),
                 seconds=(N - 1) * ALPHA + (N - 1) / N * b / BETA + fresh(b) / fault)
            for b in SIZES]


def test_hinge_fit_recovers_where_fresh_memory_starts_and_its_slope():
    b0, k = fit_fresh_bytes(SIZES, [fresh(b) for b in SIZES])
    assert b0 == pytest.approx(FROM) and k == pytest.approx(PER)
    # a step as glibc makes it (2x the tensor from 24 MB, as calibration counted it): the
    # hinge starts below the step and prices the big gathers within 20%
    b0, k = fit_fresh_bytes(SIZES, [2 * b if b >= 24 * MB else 0 for b in SIZES])
    assert 8 * MB <= b0 < 24 * MB
    for b in (32 * MB, 48 * MB):
        assert k * (b - b0) == pytest.approx(2 * b, rel=0.2)
    assert fit_fresh_bytes(SIZES, [0] * len(SIZES)) == (0.0, 0.0)


def test_link_and_host_fit_recovers_alpha_beta_and_the_fault_rate():
    a, b, f, s = fit_link_and_host(gathers())
    assert (a, b, f) == pytest.approx((ALPHA, BETA, FAULT), rel=1e-6) and s == 0.0
    # the ring fit alone bends: the faults of the big gathers read as a slower link
    a0, b0 = fit_alpha_beta(gathers())
    assert b0 < 0.8 * BETA
    # holding the fault rate, the ring fit takes each gather's faults off first
    assert fit_alpha_beta(gathers(), FAULT) == pytest.approx((ALPHA, BETA), rel=1e-6)
    # nothing fresh: no fault term, the ring fit as before
    clean = [dict(r, fresh_bytes=0.0, seconds=r["seconds"] - r["fresh_bytes"] / FAULT)
             for r in gathers()]
    a, b, f, s = fit_link_and_host(clean)
    assert f == s == 0.0 and (a, b) == pytest.approx((ALPHA, BETA), rel=1e-6)


HOST = links.Profile("host", alpha_s=ALPHA, beta_Bps=BETA, codec_Bps=2e8, agreement_s=1e-3,
                     codec_pricing="measured", word_codec_Bps=5e7, fault_Bps=FAULT,
                     fresh_from_bytes=FROM, fresh_per_byte=PER)


@pytest.mark.parametrize("mb", [8, 16, 32])
def test_every_mode_pays_the_faults_of_its_full_tensor(mb):
    n, N = mb * MB // 2, 2
    none = dataclasses.replace(HOST, fault_Bps=0.0)
    host = fresh(2 * n) / FAULT
    assert cm.host_fault_time(2 * n, HOST) == pytest.approx(host)
    for mode, kw in (("plain", {}), ("exponent", dict(change_rate=0.01)),
                     ("word", dict(word_bpw=0.5))):
        assert xo.predict(mode, n, N, HOST, **kw) == pytest.approx(
            xo.predict(mode, n, N, none, **kw) + host)
    # the planner prices it too: two plain gathers a step
    share = cm.agreement_time(N, HOST)
    assert mode_options(n, N, "bfloat16", HOST, 0.01, 0.5, share)["plain"][1] == pytest.approx(
        mode_options(n, N, "bfloat16", none, 0.01, 0.5, share)["plain"][1] + 2 * host)


def test_gpu_profiles_pay_no_faults_and_profiles_round_trip_the_fields(tmp_path):
    for name in links.builtin_profiles():
        p = links.Profile.load(name)
        assert p.fault_Bps == 0.0 and cm.host_fault_time(2**30, p) == 0.0, name
    HOST.save(tmp_path / "p.json")
    back = links.Profile.load(tmp_path / "p.json")
    assert (back.fault_Bps, back.fresh_from_bytes, back.fresh_per_byte) == (FAULT, FROM, PER)
    topo = links.Topology(HOST, links.Profile.load("h100-ib400"))
    assert cm.host_fault_time(64 * MB, topo) == cm.host_fault_time(64 * MB, HOST)


def test_timing_kit_counts_the_fresh_memory_each_call_touches():
    n = 64 * MB
    keep = np.ones(n, np.uint8)

    def fresh_call():  # freshly mapped memory, faulted page by page (numpy's own blocks would
        m = mmap.mmap(-1, n)  # ask for huge pages, one fault each)
        a = np.frombuffer(m, np.uint8)
        a.fill(1)
        out = int(a[-1])
        del a
        m.close()
        return out

    got: dict = {}
    time_interleaved({"fresh": fresh_call, "reuse": lambda: keep.fill(2)}, reps=3, warmup=1,
                     fresh=got)
    assert min(got["fresh"]) >= 0.9 * n, got
    assert max(got["reuse"]) < 0.1 * n, got

"""The cache-spill term the socket sweep found missing: once the gathers' working set (the full
tensor once per rank time-sharing a core) exceeds the host's last-level cache, every byte of it
runs from memory. GPU profiles do not pay it, it is charged once above the cache and grows as
designed, the planner prices it, calibration's fit recovers a known rate, the cache is read
from sysfs, and ``--reprice`` refits an older sweep's calibration with it."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ciera_jax.calibrate import host as host_info
from ciera_jax.calibrate.fit import fit_host_rates, fit_link_and_host
from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import crossover as xo
from ciera_jax.planning.planner import mode_options

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20
ALPHA, BETA, FAULT, SPILL = 2e-3, 4e8, 5e8, 3e8
LLC, CORES = 16 * MB, 2
HOST = links.Profile("host", alpha_s=ALPHA, beta_Bps=BETA, codec_Bps=2e8, agreement_s=1e-3,
                     codec_pricing="measured", word_codec_Bps=5e7, llc_bytes=LLC,
                     host_cores=CORES, spill_Bps=SPILL)


def test_gpu_profiles_pay_no_spill_and_profiles_round_trip_the_fields(tmp_path):
    for name in links.builtin_profiles():
        p = links.Profile.load(name)
        assert p.spill_Bps == 0.0 and cm.host_spill_time(2**30, 64, p) == 0.0, name
    HOST.save(tmp_path / "p.json")
    back = links.Profile.load(tmp_path / "p.json")
    assert (back.llc_bytes, back.host_cores, back.spill_Bps) == (LLC, CORES, SPILL)
    topo = links.Topology(HOST, links.Profile.load("h100-ib400"))
    assert cm.host_spill_time(64 * MB, 4, topo) == cm.host_spill_time(64 * MB, 4, HOST)


def test_spill_is_charged_once_above_the_cache_and_grows_with_ranks_per_core_and_bytes():
    # at or below the cache: nothing; one rank per core up to the cores
    assert cm.spill_bytes(16 * MB, 2, HOST) == 0.0
    assert cm.spill_bytes(8 * MB, 4, HOST) == 0.0  # 2 ranks per core x 8 MB = the cache
    # above it: the whole working set, once (not per rank, not per pass)
    assert cm.spill_bytes(16 * MB + 2, 2, HOST) == 16 * MB + 2
    assert cm.spill_bytes(16 * MB, 4, HOST) == 32 * MB
    assert cm.spill_bytes(16 * MB, 8, HOST) == 64 * MB
    assert cm.spill_bytes(32 * MB, 4, HOST) == 64 * MB
    assert cm.host_spill_time(16 * MB, 4, HOST) == pytest.approx(32 * MB / SPILL)
    # no cache or cores named (a built-in or older profile): no term
    for off in (dict(llc_bytes=0), dict(host_cores=0), dict(spill_Bps=0.0)):
        assert cm.host_spill_time(64 * MB, 4, dataclasses.replace(HOST, **off)) == 0.0


@pytest.mark.parametrize("N", [2, 4])
def test_every_mode_and_the_planner_pay_the_spill_of_the_full_tensor(N):
    n = 16 * MB // 2
    none = dataclasses.replace(HOST, spill_Bps=0.0)
    spill = cm.spill_bytes(2 * n, N, HOST) / SPILL
    assert (spill > 0) == (N > CORES)
    for mode, kw in (("plain", {}), ("exponent", dict(change_rate=0.01)),
                     ("word", dict(word_bpw=0.5))):
        assert xo.predict(mode, n, N, HOST, **kw) == pytest.approx(
            xo.predict(mode, n, N, none, **kw) + spill)
    assert cm.gather_cost("plain", n, N, 2, HOST).spill_s == pytest.approx(spill)
    share = cm.agreement_time(N, HOST)  # two plain gathers a step
    assert mode_options(n, N, "bfloat16", HOST, 0.01, 0.5, share)["plain"][1] == pytest.approx(
        mode_options(n, N, "bfloat16", none, 0.01, 0.5, share)["plain"][1] + 2 * spill)


def synthetic(N, sizes, fault=FAULT, spill=SPILL):
    """Plain gathers as the model prices them: fresh memory from 24 MB, spill above the cache."""
    recs = []
    for b in sizes:
        fresh = 2.0 * b if b >= 24 * MB else 0.0
        sb = cm.spill_bytes(b, N, HOST)
        t = cm.ring_allgather_time(b, N, ALPHA, BETA) + fresh / fault + sb / spill
        recs.append(dict(N=N, n_bytes=b, seconds=t, fresh_bytes=fresh, spill_bytes=sb))
    return recs


def test_calibration_fit_recovers_the_spill_rate():
    small = [64 * 2**10, MB, 8 * MB]
    big = [8 * MB, 16 * MB, 24 * MB, 32 * MB, 48 * MB]
    recs = synthetic(2, small) + synthetic(4, small + big)
    a, b, f, s = fit_link_and_host(recs)
    assert (a, b, f, s) == pytest.approx((ALPHA, BETA, FAULT, SPILL), rel=1e-6)
    assert fit_host_rates(recs, ALPHA, BETA) == pytest.approx((FAULT, SPILL), rel=1e-6)
    # spill alone (nothing fresh) and faults alone: the other rate is 0
    no_fresh = [dict(r, fresh_bytes=0.0, seconds=r["seconds"] - r["fresh_bytes"] / FAULT)
                for r in recs]
    assert fit_host_rates(no_fresh, ALPHA, BETA) == pytest.approx((0.0, SPILL), rel=1e-6)
    no_spill = [dict(r, spill_bytes=0.0, seconds=r["seconds"] - r["spill_bytes"] / SPILL)
                for r in recs]
    assert fit_host_rates(no_spill, ALPHA, BETA) == pytest.approx((FAULT, 0.0), rel=1e-6)


def test_last_level_cache_is_read_from_sysfs(tmp_path):
    for name, level, kind, size in (("index0", 1, "Data", "32K"), ("index1", 1, "Instruction",
                                                                       "32K"),
                                    ("index2", 2, "Unified", "512K"),
                                    ("index3", 3, "Unified", "16384K")):
        d = tmp_path / name
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert host_info.llc_bytes(tmp_path) == 16 * MB
    assert host_info.llc_bytes(tmp_path / "none") == 0
    assert host_info.parse_cache_size("32M") == 32 * MB and host_info.host_cores() >= 1


def test_reprice_refits_an_older_calibration_with_this_hosts_cache(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import sweep_report

    monkeypatch.setattr(host_info, "llc_bytes", lambda: LLC)
    monkeypatch.setattr(host_info, "host_cores", lambda: CORES)
    old = {k: v for k, v in dataclasses.asdict(HOST).items()
           if k not in ("llc_bytes", "host_cores", "spill_Bps")}
    calib = dict(procs=4, profile=dict(old, fault_Bps=1e8),
                 details=dict(faults=synthetic(4, [8 * MB, 16 * MB, 24 * MB, 32 * MB, 48 * MB])))
    got = sweep_report.refit_host(json.loads(json.dumps(calib)))
    assert (got.llc_bytes, got.host_cores) == (LLC, CORES)
    assert (got.fault_Bps, got.spill_Bps) == pytest.approx((FAULT, SPILL), rel=1e-6)
    # a profile that names its cache is priced as it is
    assert sweep_report.refit_host(dict(calib, profile=dataclasses.asdict(HOST))) == HOST


def test_reprice_of_the_checked_in_sweep_prices_every_point(tmp_path):
    out = tmp_path / "repriced.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gather_multiprocess.py"),
                           "--reprice", str(ROOT / "benchmarks" / "results" / "crossover.json"),
                           "--out", str(out), "--png", ""], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text())["results"]
    assert got["points"] and all(p["predicted_s"] > 0 and p["spill_s"] >= 0
                                 for p in got["points"])
    assert all("spill_Bps" in c["profile"] for c in got["calibrations"])
    assert set(got["within_25"]) == {"plain", "exponent", "word"}

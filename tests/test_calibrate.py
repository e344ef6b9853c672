"""`ciera calibrate` writes a cost-model profile that loads back with sane values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.calibrate.fit import fit_alpha_beta, fit_rate
from ciera_jax.cli.main import main
from ciera_jax.runtime.units import fmt_bytes, parse_size


@pytest.mark.slow  # ~15 compiled measurements: half a minute on 2 idle cores, minutes if busy
def test_calibrate_cli_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["calibrate", "--out", str(out), "--devices", "4", "--mesh-sizes", "2", "4",
               "--sizes", "4K", "256K", "--codec-sizes", "64K", "256K", "--reps", "3",
               "--name", "test-cpu"])
    assert rc == 0
    prof = links.Profile.load(out)
    assert prof.name == "test-cpu"
    for field in ("alpha_s", "beta_Bps", "codec_Bps", "agreement_s", "hbm_Bps", "entropy_Bps",
                  "codec_launch_s"):
        v = getattr(prof, field)
        assert math.isfinite(v) and v > 0, (field, v)
    for field in ("alpha_s", "beta_Bps", "codec_Bps", "agreement_s"):
        assert prof.sources[field].startswith("measured by ciera calibrate on cpu"), field
    assert "not measured" in prof.sources["entropy_Bps"]
    # the host fault term, fitted from gathers of the default fault sizes (8-48 MB, CPU)
    assert prof.fault_Bps >= 0 and prof.fresh_per_byte >= 0
    assert "getrusage" in prof.sources["fault_Bps"]
    assert json.loads(out.read_text())["alpha_s"] == prof.alpha_s
    printed = capsys.readouterr().out
    assert "alpha_s" in printed and f"wrote {out}" in printed
    # The profile drives the cost model as any built-in one does.
    assert cm.t_plain(2**20, 4, 2, prof) > 0


def test_calibrate_cli_rejects_more_devices_than_started(tmp_path, capsys):
    rc = main(["calibrate", "--out", str(tmp_path / "p.json"), "--devices", "64"])
    assert rc == 2
    assert "--devices 64" in capsys.readouterr().err


def test_size_parsing():
    assert parse_size("4K") == 4096 and parse_size("1.5M") == 3 * 2**19
    assert parse_size("2048") == 2048 and parse_size("1G") == 2**30

    with pytest.raises(ValueError, match="K/M/G suffix"):
        parse_size("4Q")
    assert fmt_bytes(1536) == "1.5 KB" and fmt_bytes(3 * 2**20) == "3 MB" and fmt_bytes(7) == "7 B"


def test_ring_fit_recovers_alpha_and_beta():
    alpha, beta = 20e-6, 5e9
    recs = [dict(N=N, n_bytes=b, seconds=(N - 1) * alpha + (N - 1) / N * b / beta)
            for N in (2, 4, 8) for b in (4096, 2**20, 2**23)]
    a, b = fit_alpha_beta(recs)
    assert np.isclose(a, alpha, rtol=1e-6) and np.isclose(b, beta, rtol=1e-6)


def test_rate_fit_slope_intercept_and_noise_fallback():
    rate, fixed = fit_rate([1e6, 8e6], [1e-3 + 1e6 / 2e9, 1e-3 + 8e6 / 2e9])
    assert np.isclose(rate, 2e9) and np.isclose(fixed, 1e-3)
    # Noise made the larger size faster: fall back to the largest point's plain rate.
    rate, fixed = fit_rate([1e6, 8e6], [3e-3, 2e-3])
    assert np.isclose(rate, 8e6 / 2e-3) and fixed == 0.0


def test_calibrate_cli_rejects_zero_devices(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "p.json"), "--devices", "0"]) == 2
    assert "--devices 0" in capsys.readouterr().err


@pytest.mark.parametrize("where, said", [("dir", "is a directory"),
                                         ("nofolder", "does not exist")])
def test_calibrate_cli_checks_out_before_measuring(tmp_path, capsys, monkeypatch, where, said):
    from ciera_jax import calibrate as cal

    def never(*a, **k):  # the check comes before any measuring
        raise AssertionError("calibrate ran")

    monkeypatch.setattr(cal, "calibrate", never)
    out = tmp_path if where == "dir" else tmp_path / "missing" / "p.json"
    assert main(["calibrate", "--out", str(out), "--devices", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ciera calibrate: error: --out ") and said in err, err
    assert err.strip().count("\n") == 0

"""``gather_multiprocess.py --reprice``: a sweep's JSON priced again by the current model, the
link fitted through the gathers that faulted in no fresh memory (the faults priced apart), the
measurements untouched. On a synthetic sweep with a known link and fault rate."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import crossover as xo

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20
ALPHA, BETA, FAULT = 1e-3, 1.25e8, 4e8
PROFILE = links.Profile("sockets", alpha_s=5e-4, beta_Bps=1e9, codec_Bps=2e8, agreement_s=1e-3,
                        codec_pricing="measured", word_codec_Bps=5e7, escape_s=3e-7,
                        fault_Bps=FAULT, fresh_from_bytes=8 * MB, fresh_per_byte=2.0)


def gather(n_bytes, fresh):
    t = cm.ring_allgather_time(n_bytes, 2, ALPHA, BETA) + fresh / FAULT
    return dict(n_bytes=n_bytes, seconds=t, fresh_bytes=fresh)


def point(mode, measured_s, inputs):
    return dict(series="churn 0.01", link="1gbit", procs=2, mode=mode, mb=16.0,
                shape=[8 * MB], inputs=inputs, measured_s=measured_s, ratio=measured_s / 0.2,
                wire_ratio=1.0 if mode == "plain" else 0.54, fresh_bytes=16 * MB)


def test_reprice_fits_the_link_without_the_faults_and_prices_every_point(tmp_path):
    # the 32 MB gather faulted 64 MB: a line through it would read a slower link
    gathers = [gather(1 * MB, 0), gather(8 * MB, 0), gather(32 * MB, 64 * MB)]
    res = dict(rows=[], word_rows=[], calibrations=[dict(procs=2, profile=dataclasses.asdict(
        PROFILE))], link_fits=[dict(procs=2, link="1gbit", gathers=gathers)],
        points=[point("plain", 0.2, {}), point("exponent", 0.3, dict(change_rate=0.01))])
    src, out = tmp_path / "sweep.json", tmp_path / "repriced.json"
    src.write_text(json.dumps(dict(command="gather_multiprocess.py", date="d", results=res)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gather_multiprocess.py"),
                           "--reprice", str(src), "--out", str(out), "--png", ""],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text())["results"]
    fit = got["link_fits"][0]
    assert fit["fitted_on"] == [1 * MB, 8 * MB]
    assert (fit["alpha_s"], fit["beta_Bps"]) == pytest.approx((ALPHA, BETA), rel=1e-6)
    link = xo.link_profile(PROFILE, ALPHA, BETA)
    n = 8 * MB
    plain, exp = got["points"]
    host = 2.0 * (16 * MB - 8 * MB) / FAULT
    assert plain["host_s"] == pytest.approx(host)
    assert plain["predicted_s"] == pytest.approx(
        cm.ring_allgather_time(2 * n, 2, ALPHA, BETA) + host, rel=1e-6)
    assert exp["predicted_s"] == pytest.approx(xo.predict("exponent", n, 2, link,
                                                          change_rate=0.01), rel=1e-6)
    assert (plain["measured_s"], exp["measured_s"]) == (0.2, 0.3)  # untouched
    assert exp["fresh_priced_s"] == pytest.approx(exp["predicted_s"] - host + 16 * MB / FAULT)
    assert got["repriced_from"]["command"] == "gather_multiprocess.py"
    assert set(got["within_25"]) == {"plain", "exponent"}
    # the model's CPU check, printed and kept: the plain point measured 0.2 s is a miss
    ratio = 0.2 / plain["predicted_s"]
    assert got["plain_within_25"] == dict(tol=0.25, points=1, within=0, misses=[dict(
        series="churn 0.01", link="1gbit", procs=2, measured_over_predicted=pytest.approx(ratio))])
    assert (f"plain within 25% of the model: 0 of 1 points (misses, measured / predicted: "
            f"churn 0.01 1gbit 2 processes {ratio:.2f})") in proc.stdout
    assert "codec: measured by ciera calibrate" in got["model"]


def test_plain_check_counts_the_plain_points_within_25_percent(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import sweep_report

    def pt(mode, measured, predicted, link="1gbit"):
        return dict(series="word", link=link, procs=4, mode=mode, measured_s=measured,
                    predicted_s=predicted)

    points = [pt("plain", 1.0, 0.8), pt("plain", 1.0, 0.79, "3gbit"), pt("plain", 0.75, 1.0),
              pt("plain", 0.74, 1.0, "10gbit"), pt("plain", 1.0, None), pt("word", 3.0, 1.0)]
    got = sweep_report.plain_check(points)
    assert (got["points"], got["within"]) == (4, 2)  # 1.25x and 0.75x in; the word point apart
    assert [(m["link"], round(m["measured_over_predicted"], 2)) for m in got["misses"]] == [
        ("3gbit", 1.27), ("10gbit", 0.74)]
    assert sweep_report.plain_line(got).startswith("plain within 25% of the model: 2 of 4 points")

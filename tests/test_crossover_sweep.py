"""The link-rate sweep's smallest configuration end to end: two shaped rates, 2 processes, one
repetition, both series; its JSON holds every mode at every rate, each with the cost model's
prediction (the host fault term included), the crossovers, the calibration and the picture.
Needs root, ip and tc (CI has them): nothing is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RATES = ("300mbit", "1gbit")


@pytest.mark.slow  # ~3-5 minutes on 2 idle cores (one launch: calibration, two rates)
def test_smallest_sweep_writes_every_mode_rate_and_prediction(tmp_path):
    out, png = tmp_path / "crossover.json", tmp_path / "crossover.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gather_multiprocess.py"), "--procs", "2",
           "--links", *RATES, "--reps", "1", "--warmup", "1", "--passes-mb", "4",
           "--out", str(out), "--png", str(png)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert not res["failures"] and not res["skipped"], (res["failures"], res["skipped"])
    want = {("churn 0.01", m) for m in ("plain", "exponent")} | {
        ("word", m) for m in ("plain", "exponent", "word")}
    for rate in RATES:
        got = {(p["series"], p["mode"]) for p in res["points"] if p["link"] == rate}
        assert got == want, (rate, got)
    for p in res["points"]:
        assert p["procs"] == 2 and p["measured_s"] > 0 and p["predicted_s"] > 0, p
        assert p["predicted_ratio"] > 0 and p["error"] is not None, p
        # the host's fresh-memory faults: counted per call, and priced in the prediction
        assert p["fresh_bytes"] >= 0 and p["fresh_predicted"] >= 0, p
        assert 0 <= p["host_s"] < p["predicted_s"], p
    assert {(c["series"], c["mode"]) for c in res["crossovers"]} == want - {
        ("churn 0.01", "plain"), ("word", "plain")}
    for c in res["crossovers"]:
        assert {"measured", "predicted"} <= set(c), c
    check = res["plain_within_25"]  # the model's CPU check: every plain point counted
    assert check["points"] == 2 * len(RATES) == check["within"] + len(check["misses"])
    assert all(m["link"] in RATES and abs(m["measured_over_predicted"] - 1) > 0.25
               for m in check["misses"]), check
    prof = res["calibrations"][0]["profile"]
    assert prof["codec_pricing"] == "measured" and prof["word_codec_Bps"] > 0
    assert prof["fault_Bps"] >= 0 and "getrusage" in prof["sources"]["fault_Bps"]
    faults = res["calibrations"][0]["details"]["faults"]
    assert [r["n_bytes"] for r in faults] == sorted(r["n_bytes"] for r in faults)
    assert max(r["fresh_bytes"] for r in faults) >= faults[-1]["n_bytes"], faults  # 48 MB: fresh
    assert {r["op"] for r in res["passes"][0]["rows"]} >= {"encode", "decode", "checksum"}
    assert {f["link"] for f in res["link_fits"]} == set(RATES)
    for f in res["link_fits"]:
        assert f["fault_Bps"] == prof["fault_Bps"] and all("fresh_bytes" in g
                                                           for g in f["gathers"]), f
    assert png.stat().st_size > 10_000

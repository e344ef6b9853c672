"""`ciera calibrate` writes a cost-model profile that loads back with sane values."""

from __future__ import annotations

import json
import math

from ciera_jax import costmodel as cm
from ciera_jax.cli import main


def test_calibrate_cli_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["calibrate", "--out", str(out), "--devices", "4", "--mesh-sizes", "2", "4",
               "--sizes", "4K", "256K", "--codec-sizes", "64K", "256K", "--reps", "3",
               "--name", "test-cpu"])
    assert rc == 0
    prof = cm.Profile.load(out)
    assert prof.name == "test-cpu"
    for field in ("alpha_s", "beta_Bps", "codec_Bps", "agreement_s", "hbm_Bps", "entropy_Bps",
                  "codec_launch_s"):
        v = getattr(prof, field)
        assert math.isfinite(v) and v > 0, (field, v)
    for field in ("alpha_s", "beta_Bps", "codec_Bps", "agreement_s"):
        assert prof.sources[field].startswith("measured by ciera calibrate on cpu"), field
    assert "not measured" in prof.sources["entropy_Bps"]
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
    from ciera_jax.calibrate import parse_size

    assert parse_size("4K") == 4096 and parse_size("1.5M") == 3 * 2**19
    assert parse_size("2048") == 2048 and parse_size("1G") == 2**30

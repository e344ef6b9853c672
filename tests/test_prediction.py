"""One step model behind `ciera plan`, `ciera simulate` and `ciera aot`; the codec term from
the compiled program's recorded table, never a hand-written rate."""

from __future__ import annotations

import json
import re

import pytest

from ciera_jax.planning import clusters, codec_costs
from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links

RATIO = re.compile(r"predicted step of \S+ on (\d+)×.*?CIERA word [\d.]+ ms \(([\d.]+)x")


def _ratios(text: str) -> dict[int, float]:
    return {int(n): float(r) for n, r in RATIO.findall(text)}


def test_plan_simulate_aot_predict_the_same_step(capsys):
    from ciera_jax.cli.main import build_parser, commands, main
    from ciera_models.cli import aot

    got = {}
    for n in (16, 128):
        assert main(["plan", "--config", "olmoe-1b-7b", "--cluster", f"{n}xh100-ib400"]) == 0
        got.setdefault("plan", {}).update(_ratios(capsys.readouterr().out))
        args = build_parser(commands()).parse_args(["aot", "--config", "olmoe-1b-7b",
                                                    "--cluster", f"{n}xh100-ib400"])
        _, spec = aot.cluster_of(args)
        got.setdefault("aot", {}).update(_ratios(aot.prediction(args, spec).line()))
    assert main(["simulate", "--config", "olmoe-1b-7b", "--gpus", "16,128",
                 "--cluster", "h100-ib400"]) == 0
    got["simulate"] = _ratios(capsys.readouterr().out)
    for n in (16, 128):
        rs = [got[c][n] for c in ("plan", "simulate", "aot")]
        assert max(rs) / min(rs) <= 1.05, (n, got)


def test_builtin_gpu_profiles_hold_no_codec_rate():
    for name in links.builtin_profiles():
        d = json.loads((links.PROFILE_DIR / f"{name}.json").read_text())
        if name.startswith("cpu"):
            continue  # a calibration's measured rates (`ciera calibrate` on this host)
        assert "codec_Bps" not in d and "word_codec_Bps" not in d, name
        assert d["codec_pricing"] == "compiled" and d["gpu"], name


def test_codec_term_comes_from_the_table(tmp_path, monkeypatch):
    link = clusters.link(clusters.CLUSTERS["h100-ib400"])
    n = 1 << 25
    before = cm.codec_time("word", n, 16, 2, link)
    assert before == pytest.approx(codec_costs.codec_cost("word", 2 * n, "h100-80gb", 16).seconds)
    table = json.loads(codec_costs.TABLE.read_text())
    for e in table["entries"]:
        e["programs"] = {k: [[4 * b, r] for b, r in ks] for k, ks in e["programs"].items()}
    path = tmp_path / "codec_cost.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(codec_costs, "TABLE", path)
    codec_costs.load_table.cache_clear()
    try:
        assert cm.codec_time("word", n, 16, 2, link) > 1.5 * before
    finally:  # the recorded table back, and no copy of the scaled one left in the cache
        monkeypatch.undo()
        codec_costs.load_table.cache_clear()
    for cal in codec_costs.CALIBRATIONS:
        src = cm.codec_source(clusters.link(clusters.CLUSTERS["h100-ib400"], cal))
        assert "compile roofline" in src and ("measured on one H100" in src) == (cal == "measured")


def test_cluster_names():
    spec, n = clusters.parse("16xh100-ib400")
    assert (spec.name, n) == ("h100-ib400", 16)
    assert clusters.describe(spec, 16) == "16×H100 (2 hosts, IB NDR 400)"
    assert clusters.describe(spec, 8) == "8×H100 (1 host, NVLink)"
    assert clusters.parse("h100")[0].name == "h100-ib400"
    with pytest.raises(KeyError, match="unknown cluster 'a100'; choose one of: h100-ib400"):
        clusters.parse("a100")
    with pytest.raises(ValueError, match="has 16 GPUs but --gpus says 8"):
        clusters.parse("16xh100-ib400", 8)
    assert isinstance(clusters.get_link("16xh100-ib400"), links.Topology)


def test_simulate_model_flag_still_works(capsys):
    from ciera_jax.cli import simulate as simulate_cli
    import argparse

    p = argparse.ArgumentParser()
    simulate_cli.add_arguments(p)
    args = p.parse_args(["--model", "tiny"])
    assert args.config == "tiny"
    assert "--model is deprecated; use --config" in capsys.readouterr().err

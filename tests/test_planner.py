"""Cost formulas, the wire table's rungs, per-tensor decisions and `ciera plan`."""

import json

import pytest

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning.planner import plan_model, plan_tensor, plan_tree, summarize
from ciera_jax.planning.shapes import get_config, tensor_inventory
from ciera_jax.codec.wire import EXPONENT_CAPACITIES, ExponentWire, capacities


def ideal(**kw):
    d = dict(name="ideal", alpha_s=0.0, beta_Bps=1e9, codec_Bps=1e30, agreement_s=0.0,
             hbm_Bps=1e30, entropy_Bps=1e30, codec_launch_s=0.0)
    d.update(kw)
    return links.Profile(**d)


def test_builtin_profiles_load_with_sources():
    names = links.builtin_profiles()
    for n in ("h100-nvlink", "h200-nvlink", "h100-ib400", "h200-ib400", "cpu-emulated"):
        assert n in names
        p = links.Profile.load(n)
        assert p.alpha_s > 0 and p.beta_Bps > 0 and p.sources
        # a GPU's codec is priced from its compiled program; a calibrated host's as measured
        assert (p.gpu and p.codec_pricing == "compiled") or p.codec_Bps > 0
    assert links.Profile.load("h100-ib400").beta_Bps < links.Profile.load("h100-nvlink").beta_Bps


def test_profile_roundtrip_and_unknown(tmp_path):
    p = links.Profile.load("h100-nvlink")
    p.save(tmp_path / "x.json")
    assert links.Profile.load(tmp_path / "x.json") == p
    with pytest.raises(KeyError):
        links.Profile.load("no-such-profile")
    with pytest.raises(FileNotFoundError):
        links.Profile.load(tmp_path / "missing.json")


def test_ring_formula():
    p = ideal(alpha_s=1e-5)
    n, N = 1_000_000, 8
    assert cm.t_plain(n, N, 2, p) == pytest.approx(7 * 1e-5 + 7 / 8 * 2e6 / 1e9)
    assert cm.t_plain(n, 1, 2, p) == 0.0


def test_zero_latency_ratio_tends_to_byte_ratio():
    p = ideal()
    n, N = 1 << 24, 16
    # (the checksum, 4 bytes a rank, is all that keeps it from the byte ratio)
    assert cm.t_plain(n, N, 2, p) / cm.t_ciera(n, N, 1, 0.0, p) == pytest.approx(2.0, rel=1e-5)
    assert cm.t_plain(n, N, 4, p) / cm.t_ciera(n, N, 3, 0.0, p) == pytest.approx(4 / 3,
                                                                                  rel=1e-5)
    # escape sections make it strictly worse than the byte ratio, never better
    assert cm.t_plain(n, N, 2, p) / cm.t_ciera(n, N, 1, 1e-3, p) < 2.0


def test_rungs_and_fallback():
    wire = ExponentWire(4096, 2)
    assert wire.caps == (0, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    # a rung of K exponents lists up to min(K, 128) flag words: each holds a change
    assert wire.word_caps == (0, 2, 4, 8, 16, 32, 64, 128, 128, 128, 128)
    assert capacities(8, EXPONENT_CAPACITIES) == (0, 1, 2)  # deduplicated
    # nothing changed anywhere: the payload and the checksum only
    assert wire.sent_bytes(0) == 4096 + 4
    # 5 changes: 8 exponents, the 4-word summary + 8 listed flag words
    assert wire.sent_bytes(5) == 4096 + 4 + 8 + 4 * (4 + 8)
    assert wire.sent_bytes(1025) == 2 * 4096 + 4  # above the top: plain (and the checksum)
    p = links.Profile.load("h100-ib400")
    n, N = 1 << 26, 16
    # change rate above 1/4: the main plane, then a plain gather, and the planner says plain
    assert cm.t_ciera(n, N, 1, 0.6, p, agreement_share_s=0.0) > cm.t_plain(n, N, 2, p)
    # warm-up churn (10%) still travels compressed
    assert cm.t_ciera(n, N, 1, 0.1, p, agreement_share_s=0.0) < 0.8 * cm.t_plain(n, N, 2, p)
    d = plan_tensor((n,), "bfloat16", N, p, 0.6)
    assert not d.compress and "rung" in d.reason


def test_baselines_bytes():
    n, N, p = 1 << 24, 8, ideal()
    # int8: one float32 scale per 256-element block, as quantized.py sends
    assert cm.gather_cost("int8", n, N, 2, p).wire_bytes == pytest.approx(n * (1 + 4 / 256))
    assert cm.gather_cost("word", n, N, 2, p, word_bpw=0.55).wire_bytes == pytest.approx(
        0.55 * n + N * cm.CHECKSUM_BYTES)
    with pytest.raises(ValueError, match="word_bpw"):
        cm.gather_cost("word", n, N, 2, p)
    assert cm.gather_cost("entropy", n, N, 2, p).wire_bytes == pytest.approx(n * 2 / 1.5)
    assert cm.gather_cost("ciera", n, N, 2, p, 0.0).wire_bytes == n + N * cm.CHECKSUM_BYTES
    assert cm.gather_cost("word", n, N, 2, p, word_rates=(0.0, 0.0)).wire_bytes == (
        n * 3 // 8 + N * cm.CHECKSUM_BYTES)
    with pytest.raises(ValueError):
        cm.gather_cost("zip", n, N, 2, p)


def test_hierarchical_matches_flat_inside_a_node_and_costs_more_across():
    nv, ib = links.Profile.load("h100-nvlink"), links.Profile.load("h100-ib400")
    topo = links.Topology(nv, ib, 8)
    assert cm.gather_time(1e9, 8, topo) == pytest.approx(cm.gather_time(1e9, 8, nv))
    assert cm.gather_time(1e9, 16, topo) > cm.gather_time(1e9, 8, topo)
    two = cm.ring_allgather_time(1e9, 8, nv.alpha_s, nv.beta_Bps) + \
        cm.ring_allgather_time(1e9 / 8, 2, ib.alpha_s, ib.beta_Bps)
    assert cm.gather_time(1e9, 16, topo) == pytest.approx(two)


@pytest.mark.parametrize("profile", ["h100-nvlink", "h100-ib400", "h200-ib400", "cpu-emulated"])
def test_tiny_tensors_never_compressed(profile):
    for shape in [(2048,), (64,), (1,)]:
        assert not plan_tensor(shape, "bfloat16", 16, profile, 1e-3).compress


@pytest.mark.parametrize("profile", ["h100-ib400", "h200-ib400"])
def test_olmoe_16_experts_compressed_norms_routers_plain(profile):
    ds = plan_model("olmoe-1b-7b", 16, profile)
    assert len(ds) == len(tensor_inventory(get_config("olmoe-1b-7b")))
    for d in ds:
        if d.kind.startswith("expert_"):
            assert d.compress, d
        if d.kind in ("norm", "router"):
            assert not d.compress, d
    s = summarize(ds)
    assert s["saving_per_step_s"] > 0 and s["speedup"] > 1


def test_h100_nvlink_exponent_codec_eats_most_of_the_saving():
    """On one flat H100 NVLink ring the compiled exponent codec costs most of what the halved
    wire saves: each expert gather is priced above half of plain's, and the planner compresses
    exactly the experts whose gather it prices faster."""
    experts = [d for d in plan_model("olmoe-1b-7b", 16, "h100-nvlink")
               if d.kind.startswith("expert_")]
    for d in experts:
        assert d.t_ciera > 0.5 * d.t_plain, d
        assert d.compress == (d.t_ciera < d.t_plain), d


def test_other_dtypes_plain():
    for dt in ("float16", "int32", "uint8"):
        d = plan_tensor((1 << 24,), dt, 16, "h100-ib400", 0.0)
        assert not d.compress and "no codec" in d.reason
    assert plan_tensor((1 << 24,), "float32", 16, "h100-ib400", 0.0).compress


def test_plan_tree():
    import jax
    import jax.numpy as jnp

    tree = {"w": jax.ShapeDtypeStruct((64, 2048, 1024), jnp.bfloat16),
            "norm": jnp.ones((2048,), jnp.bfloat16),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "fp16": jax.ShapeDtypeStruct((4096, 4096), jnp.float16),
            "list": [jax.ShapeDtypeStruct((4096, 4096), jnp.float32)]}
    out = plan_tree(tree, 16, "h100-ib400", 1e-3)
    assert out == {"w": True, "norm": False, "step": False, "fp16": False, "list": [True]}


def test_profiles_state_device_memory():
    assert links.Profile.load("h100-ib400").memory_gb == 80
    assert links.Profile.load("h200-nvlink").memory_gb == 141
    assert links.Profile.load("cpu-emulated").memory_gb is None  # unlimited
    topo = links.Topology(links.Profile.load("h200-nvlink"), links.Profile.load("h200-ib400"))
    assert topo.memory_gb == 141 and links.get_link(topo) is topo


def test_plan_cli(tmp_path, capsys):
    from ciera_jax.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--config", "olmoe-1b-7b", "--gpus", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "w_gate_ExDxF" in text and "saving per step" in text
    assert "cache: word" in text and "unlimited memory" in text and "80 GB per GPU" in text
    assert len(text.splitlines()) < 60  # aggregated, not one row per tensor
    d = json.loads(out.read_text())
    assert len(d["decisions"]) == 130  # the gathered tensors (norms are replicated)
    assert d["memory"]["total"] <= 80e9 and d["summary"]["cache_bytes"] <= d["cache_budget_bytes"]
    assert main(["plan", "--config", "olmoe-1b-7b", "--gpus", "16", "--memory-gb", "12",
                 "--json", str(out)]) == 0
    tight = json.loads(out.read_text())
    assert tight["summary"]["cache_bytes"] <= tight["cache_budget_bytes"] < 12e9
    assert tight["summary"]["gather_speedup"] < tight["summary_unlimited"]["gather_speedup"]
    assert main(["plan", "--config", "olmoe-1b-7b", "--gpus", "16",
                 "--profile", "h200-nvlink", "--change-rate", "0.001"]) == 0
    capsys.readouterr()
    # a budget that holds the training state but nothing more: every tensor plain
    assert main(["plan", "--config", "olmoe-1b-7b", "--gpus", "16", "--memory-gb", "7",
                 "--json", str(out)]) == 0
    assert "every tensor plain" in capsys.readouterr().out
    assert {c["mode"] for c in json.loads(out.read_text())["decisions"]} == {"plain"}


def test_plan_cli_errors(capsys):
    from ciera_jax.cli.main import main

    assert main(["plan", "--config", "no-such-model"]) == 2
    assert main(["plan", "--profile", "no-such-profile"]) == 2
    assert main(["plan", "--memory-gb", "-3"]) == 2
    assert main(["plan", "--memory-gb", "lots"]) == 2
    assert main(["plan", "--memory-gb", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown config" in err and "unknown profile" in err
    assert "positive number of GB" in err and "training state alone" in err
    assert len([l for l in err.splitlines() if l.strip()]) == 5

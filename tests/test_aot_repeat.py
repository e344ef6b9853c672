"""``ciera aot --repeat``: each program compiled N times, alternating, the fastest kept.

A compile's wall time on a shared machine is its own cost plus whatever else the machine ran
meanwhile, so one reading of a compile ratio can be off by a quarter. These check the
bookkeeping with a stand-in for the compile (no XLA): the order, the fastest, the refusal of a
program that changed between compiles, and the report's row.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from ciera_jax.runtime import gpu_targets
from ciera_models.aot import compile as aot
from ciera_models.cli import aot as aot_cli
from ciera_models.train.config import TrainConfig

H100 = gpu_targets.get_target("h100-80gb")


def _fake_compiles(monkeypatch, walls: dict, distinct: dict | None = None):
    """``compile_step`` replaced: each call pops the next wall time of its gather (and the next
    distinct-kernel count, 7 when none is given); returns the calls in order."""
    calls = []

    def compile_step(tc, target, gpus, tokens_per_gpu, hlo_out=None, log=None,
                     program="steady", modules=False, phases=False, temporaries=0):
        calls.append(tc.gather + (" modules" if modules else "") + (" phases" if phases else "")
                     + (" temporaries" if temporaries else ""))
        wall = walls[tc.gather].pop(0)
        kernels = (distinct or {}).get(tc.gather)
        return {"gather": tc.gather, "compile_s": wall, "compile_cpu_s": wall + 0.5,
                "distinct_fusions": kernels.pop(0) if kernels else 7,
                "first_call": len(calls)}

    monkeypatch.setattr(aot, "compile_step", compile_step)
    return calls


def test_repeats_alternate_between_programs_and_keep_the_fastest(monkeypatch):
    calls = _fake_compiles(monkeypatch, {"ciera": [30.0, 24.0, 27.0],
                                         "plain": [15.0, 18.0, 12.0]})
    tcs = [TrainConfig(), dataclasses.replace(TrainConfig(), gather="plain")]
    ciera, plain = aot.compile_repeated(tcs, H100, 8, 128, repeat=3)
    assert calls == ["ciera", "plain"] * 3  # alternating: the load falls on both alike
    assert [c["wall_s"] for c in ciera["compile_runs"]] == [30.0, 24.0, 27.0]
    assert (ciera["compile_s"], ciera["compile_cpu_s"]) == (24.0, 24.5)
    assert (plain["compile_s"], plain["compile_cpu_s"]) == (12.0, 12.5)
    assert (ciera["first_call"], plain["first_call"]) == (1, 2)  # the rest: the first compile's


def test_one_compile_reports_it_as_before(monkeypatch):
    _fake_compiles(monkeypatch, {"ciera": [30.0]})
    (rep,) = aot.compile_repeated([TrainConfig()], H100, 8, 128, repeat=1)
    assert rep["compile_s"] == 30.0 and len(rep["compile_runs"]) == 1
    assert aot_cli._compile_runs(rep) == {}  # no extra row for one compile


def test_a_program_that_compiles_differently_is_refused(monkeypatch):
    _fake_compiles(monkeypatch, {"ciera": [30.0, 24.0]}, distinct={"ciera": [7, 8]})
    with pytest.raises(RuntimeError, match="8 distinct fusion names, 7 the first time"):
        aot.compile_repeated([TrainConfig()], H100, 8, 128, repeat=2)


def test_the_report_row_lists_every_compile():
    walls = [30.0, 24.0, 27.5]
    rep = {"compile_s": min(walls), "compile_cpu_s": min(walls),
           "compile_runs": [{"wall_s": w, "cpu_s": w} for w in walls]}
    assert aot_cli._compile_runs(rep) == {
        "  each of 3 compiles (fastest above)": "30.0, 24.0, 27.5 s"}


@pytest.mark.parametrize("flag,value", [("modules", True), ("phases", True),
                                        ("temporaries", 3)])
def test_modules_and_phases_are_counted_in_the_first_round_only(monkeypatch, flag, value):
    calls = _fake_compiles(monkeypatch, {"ciera": [30.0, 24.0], "plain": [15.0, 12.0]})
    tcs = [TrainConfig(), dataclasses.replace(TrainConfig(), gather="plain")]
    aot.compile_repeated(tcs, H100, 8, 128, repeat=2, **{flag: value})
    assert calls == [f"ciera {flag}", f"plain {flag}", "ciera", "plain"]


def test_ptx_modules_are_the_dumped_ptx_of_a_compile_of_their_own():
    """``count_ptx_modules`` compiles once more with the same options and a dump folder, counts
    its ``*.ptx`` files (not the dump's other files) and leaves no folder behind."""
    seen = {}

    class Lowered:
        def compile(self, compiler_options):
            seen.update(compiler_options)
            for name in ("module_0001.jit_step.1.ptx", "module_0001.jit_step.2.ptx",
                         "module_0001.jit_step.ir-with-opt.ll", "module_0001.jit_step.txt"):
                (pathlib.Path(compiler_options["xla_dump_to"]) / name).write_text("x")

    assert aot.count_ptx_modules(Lowered(), {"xla_gpu_flag": True}) == 2
    assert seen["xla_gpu_flag"] is True
    assert not pathlib.Path(seen["xla_dump_to"]).exists()


def test_phases_add_each_events_seconds_and_leave_out_a_phase_the_trace_lacks():
    trace = {"traceEvents": [
        {"ph": "X", "name": "OptimizeHloModule", "dur": 2_500_000},
        {"ph": "X", "name": "priority-fusion", "dur": 1_000_000},
        {"ph": "X", "name": "priority-fusion", "dur": 500_000},
        {"ph": "X", "name": "CompileSingleModule", "dur": 40_000},
        {"ph": "X", "name": "CompileSingleModule", "dur": 60_000},
        {"ph": "i", "name": "CompileToBackendResult"},  # an instant, not a span
        {"ph": "M", "name": "process_name"}]}
    assert aot.phases_of(trace) == {"hlo_passes_s": 2.5, "priority_fusion_s": 1.5,
                                    "modules": 2}
    rows = aot_cli._phase_rows(aot.phases_of(trace))
    assert rows["  LLVM and PTX, modules"] == "-, 2"
    assert rows["    of which priority fusion"] == "1.5 s"
    assert aot_cli._phase_rows(None) == {}


def test_phases_of_a_real_xla_gpu_compile():
    """XLA:GPU's own events, as JAX's profiler records them around a compile for an H100
    (compile-only): every phase there, the passes inside the compile's time."""
    import jax
    import jax.numpy as jnp

    mesh = gpu_targets.compile_only_mesh(H100, 8)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=replicated)
    lowered = jax.jit(lambda a: jnp.tanh(a @ a) + jnp.exp(a).sum(0)).lower(x)
    options = dict(gpu_targets.FSDP_XLA_FLAGS)
    gpu_targets.compile_with(lowered, options)  # as the report's own compile did before
    p = aot.compile_phases(lowered, options)  # ...so JAX must not hand that one back
    assert set(p) == {"hlo_passes_s", "priority_fusion_s", "backend_s", "modules"}
    assert 0 < p["priority_fusion_s"] < p["hlo_passes_s"] and p["backend_s"] > 0
    assert p["modules"] >= 1


def _report(**extra):
    return {"compile_s": 30.0, "compile_cpu_s": 40.0, "fusions": 300, "distinct_fusions": 150,
            "hlo_bytes": 2e6, "memory": {"total": 4e9}, **extra}


def test_the_ratio_line_gives_modules_only_when_both_reports_counted_them():
    ciera = _report(ptx_modules=171)
    plain = {**_report(ptx_modules=100), "compile_s": 20.0, "compile_cpu_s": 20.0,
             "fusions": 200, "distinct_fusions": 100, "hlo_bytes": 1e6, "memory": {"total": 2e9}}
    assert aot_cli.ratio_line(ciera, plain) == (
        "ratios (ciera / plain): compile 1.50x (2.00x CPU), fusions 1.50x "
        "(1.50x distinct, 1.71x PTX modules), HLO 2.00x, memory 2.00x")
    assert "PTX modules" not in aot_cli.ratio_line(ciera, _report())
    encodes = aot_cli.ratio_line({**ciera, "encode": {"compile_s": 15.0}},
                                 {**plain, "encode": {"compile_s": 0.0}})
    assert "compile 1.50x (2.00x CPU; step + encode program 2.25x)" in encodes


def test_temporary_lines_name_each_slot_and_its_instructions():
    """``--temporaries``: a line per slot (size, offset, shape, the first three instructions
    and how many more); none without the option."""
    slots = [{"size": 2 * 1024**3, "offset": 0, "shape": "u8[4096,32,8,14336]{3,2,1,0}",
              "values": ["transpose_fusion", "a", "b", "c", "d"]},
             {"size": 5 * 10**6, "offset": 3 * 10**9, "shape": "bf16[2560]{0}",
              "values": ["gemm_fusion_dot.3"]}]
    lines = aot_cli._temporary_lines({"gather": "ciera", "temporaries": slots})
    assert len(lines) == 3 and lines[0].startswith("largest temporaries (ciera)")
    assert "u8[4096,32,8,14336]" in lines[1] and lines[1].endswith("transpose_fusion, a, b (+2)")
    assert "@   3.00 GB" in lines[2] and lines[2].endswith("gemm_fusion_dot.3")
    assert aot_cli._temporary_lines({"gather": "plain"}) == []

"""One gather's GPU cost, read off its XLA:GPU compile (``ciera aot --gather-shape``): the
kernels of its steady path with their HBM bytes, pinned for a small shape on 8 H100s so that
any change to the codec's kernels shows here; and the reader on programs whose kernels are
known."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.runtime import gpu_targets
from ciera_models.aot import gather_cost, kernel_list, schedule

H100 = gpu_targets.get_target("h100-80gb")
SHAPE, AXIS, GPUS = (8, 256, 256), 1, 8  # rows of 256: the fused decode + checksum
# Kernels on the steady path of each program: what the codec launches per gather, in the
# program ``ciera train`` runs on GPUs (``--fallback program``: the rung holds the demand) and
# in one with a fallback conditional (``branch``). A change that fuses (or splits) kernels
# changes these; update them with the results it measured.
PINNED = {"plain": {"gather": 3}, "exponent": {"encode": 13, "exchange": 11},
          "word": {"encode": 14, "exchange": 12}}
PINNED_BRANCH = {"exponent": {"encode": 13, "exchange": 13},
                 "word": {"encode": 14, "exchange": 17}}


@pytest.fixture(scope="module")
def reports():
    return {m: gather_cost.gather_cost(m, SHAPE, AXIS, GPUS, H100) for m in gather_cost.MODES}


@pytest.fixture(scope="module")
def branch_reports():
    return {m: gather_cost.gather_cost(m, SHAPE, AXIS, GPUS, H100, fallback="branch")
            for m in PINNED_BRANCH}


@pytest.mark.parametrize("mode", gather_cost.MODES)
def test_kernel_counts_are_pinned(reports, mode):
    r = reports[mode]
    assert {name: p["kernels"] for name, p in r["programs"].items()} == PINNED[mode]
    assert r["kernels"] == sum(PINNED[mode].values())


@pytest.mark.parametrize("mode", list(PINNED_BRANCH))
def test_kernel_counts_with_a_fallback_conditional_are_pinned(branch_reports, reports, mode):
    r = branch_reports[mode]
    assert {name: p["kernels"] for name, p in r["programs"].items()} == PINNED_BRANCH[mode]
    assert r["fallback"] == "branch" and r["conditionals"] == 1
    assert reports[mode]["fallback"] == "program" and reports[mode]["conditionals"] == 0


@pytest.mark.parametrize("mode", gather_cost.MODES)
def test_roofline_is_the_floor_or_the_bytes_per_kernel(reports, mode):
    r = reports[mode]
    kernels = [k for p in r["programs"].values() for k in p["kernel_list"]]
    assert r["bytes"] == sum(k["runs"] * k["bytes"] for k in kernels)
    assert r["launch_floor_s"] == pytest.approx(r["kernels"] * kernel_list.LAUNCH_S)
    assert r["roofline_s"] >= max(r["launch_floor_s"], r["bytes"] / H100.memory_bandwidth_Bps) * (1 - 1e-9)
    json.dumps(r)  # the report is JSON as it is


def test_the_steady_path_holds_the_main_transfer_not_the_fallback(reports):
    """Each compressed exchange gathers once on its steady path (the main plane, its section
    and checksum); with a fallback, its plain rest is in a branch left out. Plain gathers the
    shard's bytes: the gather kernel reads the shard and writes the full tensor."""
    n_bytes = SHAPE[0] * SHAPE[1] * SHAPE[2] * 2
    (plain_gather,) = [k for k in reports["plain"]["programs"]["gather"]["kernel_list"]
                       if k["kind"] == "all-gather"]
    assert plain_gather["bytes"] == n_bytes + n_bytes // GPUS
    for mode in ("exponent", "word"):
        ex = reports[mode]["programs"]["exchange"]
        gathers = [k for k in ex["kernel_list"] if k["kind"] == "all-gather"]
        assert len(gathers) == 1 and gathers[0]["source"].endswith("transfer.py:gather_rows")
        assert gathers[0]["bytes"] < n_bytes  # compressed: fewer bytes than plain's
        assert ex["conditionals"] == 0  # the rung holds the demand: no fallback compiled
        assert not [k for k in reports[mode]["programs"]["encode"]["kernel_list"]
                    if k["kind"] == "all-gather"]


def test_kernels_and_bytes_of_a_known_program():
    """A gather, a loop of 100 fused steps and a conditional whose one branch gathers: the
    kernels are the gather, the loop's body kernels (100 runs each) and, with that branch off
    the path, the other branch's; the gather's bytes are its input and output."""
    mesh = gpu_targets.compile_only_mesh(H100, 8)

    def f(x, flag):
        full = lax.all_gather(x, "fsdp", tiled=True)
        y = lax.fori_loop(0, 100, lambda i, v: jnp.tanh(v) * 2 + i, full)
        z = lax.cond(flag > 0, lambda v: lax.all_gather(v, "fsdp", tiled=True)[:64],
                     lambda v: v * 3, y[:64])
        return y, z

    sm = jax.shard_map(f, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=(P(), P()),
                       check_vma=False)
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    flag = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    text = gpu_targets.compile_with(jax.jit(sm).lower(x, flag),
                                    gpu_targets.FSDP_XLA_FLAGS).as_text()
    prog = schedule.Program(text)
    off = {c.computation for c in prog.collectives() if c.in_branch}
    every, _ = kernel_list.steady_kernels(prog, set())
    steady, conditionals = kernel_list.steady_kernels(prog, off)
    assert conditionals == 1
    gathers = [k for k in steady if k.kind == "all-gather"]
    assert len(gathers) == 1 and gathers[0].bytes == 1024 * 256 * 4 * 9 // 8
    assert len([k for k in every if k.kind == "all-gather"]) == 2
    # the loop body's one kernel over the tensor (XLA may double-buffer the loop: two kernels
    # of half the trips), reading it and the counter, writing it
    body = [k for k in steady if k.runs > 1 and k.bytes > 1024 * 256 * 4]
    assert sum(k.runs for k in body) == 100
    assert {k.bytes for k in body} == {2 * 1024 * 256 * 4 + 4}
    assert len(steady) < len(every)


def test_a_shape_that_does_not_divide_is_a_clear_error():
    with pytest.raises(ValueError, match="must divide among 8 GPUs"):
        gather_cost.check_gather((8, 255, 128), 1, 8, "word")
    with pytest.raises(ValueError, match="has axes 0..2"):
        gather_cost.check_gather((8, 256, 128), 3, 8, "word")
    with pytest.raises(ValueError, match="choose one of plain"):
        gather_cost.check_gather((8, 256, 128), 1, 8, "int8")

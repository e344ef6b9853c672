"""The compressed layer loop rolled (``runtime.loops.rolled_scan``): the same values as
``lax.scan`` bit for bit, one copy of its body in XLA:GPU's program where the scan is
double-buffered, and its trip count still counted per step by the report's reader."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.runtime.loops import rolled_scan
from ciera_jax.runtime import gpu_targets, hlo
from ciera_models.aot import schedule

LAYERS = 6


def _layers(scan):
    """``f(x, ws)``: a layer loop over ``ws``'s leading axis that gathers the next layer's
    weight beside this layer's matmul, as the trainer's does, and stacks per-layer outputs of
    two kinds (one varying over the axis, one not)."""
    def f(x, ws):
        first = lax.all_gather(ws[0], "fsdp", tiled=True)

        def body(carry, i):
            x, full = carry
            nxt = lax.all_gather(lax.dynamic_index_in_dim(ws, i + 1, keepdims=False),
                                 "fsdp", tiled=True)
            y = jnp.tanh(x @ full)
            return (y, nxt), (jnp.sum(y, axis=1), lax.psum(jnp.sum(y), "fsdp"))

        (x, full), (sums, totals) = scan(body, (lax.pcast(x, ("fsdp",), to="varying"), first),
                                         jnp.arange(ws.shape[0] - 1))
        return lax.psum(jnp.sum(jnp.tanh(x @ full)) + jnp.sum(sums), "fsdp") + jnp.sum(totals)
    return f


@pytest.mark.parametrize("layers", [LAYERS, 2])
def test_rolled_scan_gives_the_scans_values_bit_for_bit(layers):
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((layers, 64, 64)) / 8, jnp.float32)
    out = {}
    for name, scan in (("scan", lax.scan), ("rolled", rolled_scan)):
        f = jax.jit(jax.shard_map(_layers(scan), mesh=mesh, in_specs=(P(), P(None, "fsdp")),
                                  out_specs=P()))
        out[name] = np.asarray(f(x, ws))
    assert np.array_equal(out["rolled"].view(np.uint32), out["scan"].view(np.uint32))
    assert np.isfinite(out["scan"])


@pytest.fixture(scope="module")
def gpu_texts():
    """Both loops compiled by XLA:GPU for 8 H100s (compile-only), with the FSDP flags; and
    the rolled one over 2 layers (one trip)."""
    h100 = gpu_targets.get_target("h100-80gb")
    mesh = gpu_targets.compile_only_mesh(h100, 8)
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    ws = jax.ShapeDtypeStruct((LAYERS, 512, 512), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(None, "fsdp")))
    two = jax.ShapeDtypeStruct((2,) + ws.shape[1:], ws.dtype, sharding=ws.sharding)
    texts = {}
    for name, scan, w in (("scan", lax.scan, ws), ("rolled", rolled_scan, ws),
                          ("one trip", rolled_scan, two)):
        sm = jax.shard_map(_layers(scan), mesh=mesh, in_specs=(P(), P(None, "fsdp")),
                           out_specs=P())
        texts[name] = gpu_targets.compile_with(jax.jit(sm).lower(x, w),
                                               gpu_targets.FSDP_XLA_FLAGS).as_text()
    return texts


def test_xla_gpu_compiles_the_rolled_body_once_and_the_scans_twice(gpu_texts):
    def loops(text):
        return [line for line in text.splitlines() if " while(" in line]

    scanned, rolled = loops(gpu_texts["scan"]), loops(gpu_texts["rolled"])
    assert any("double_buffer" in line or "known_trip_count" in line for line in scanned)
    (loop,) = rolled
    assert "known_trip_count" not in loop and hlo.scoped_trip_count(loop) == LAYERS - 1

    def body_gathers(text):  # gathers inside loop bodies
        prog = schedule.Program(text)
        return [c for c in prog.collectives() if c.kind == "all-gather" and c.runs > 1]

    assert len(body_gathers(gpu_texts["rolled"])) < len(body_gathers(gpu_texts["scan"]))
    # one trip: a scan, which XLA inlines (no loop, no sync per trip)
    assert not loops(gpu_texts["one trip"])


def test_the_report_counts_a_rolled_loops_trips(gpu_texts):
    """Every layer's gather counted once a step, in both programs: the rolled loop's trips
    read from its name scope as the scan's are from XLA's known trip count."""
    for name in ("scan", "rolled"):
        gathers = [c for c in schedule.Program(gpu_texts[name]).collectives()
                   if c.kind == "all-gather"]
        assert sum(c.runs for c in gathers) == LAYERS
        assert schedule.overlap_share(gathers) > 0


def test_a_nested_loop_does_not_take_the_rolled_loops_count():
    outer = ('%while.1 = (s32[]) while(%t), condition=%c, body=%b, metadata={op_name='
             '"jit(f)/jvp(ciera_rolled_trips_15)/while" stack_frame_id=3}')
    inner = ('%while.2 = (s32[]) while(%t), condition=%c2, body=%b2, metadata={op_name='
             '"jit(f)/jvp(ciera_rolled_trips_15)/while/body/while" stack_frame_id=4}')
    assert hlo.scoped_trip_count(outer) == 15
    assert hlo.scoped_trip_count(inner) is None

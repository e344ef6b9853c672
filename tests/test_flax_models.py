"""A model made only of Flax layers annotated with ``nnx.with_partitioning`` gets exact CIERA
gathers from one decorator, in both programming models (the user's ``shard_map``; ``nnx.jit``
with the mesh set and no ``shard_map``), on a pure fsdp mesh and on one with a data axis."""

import pytest

from flax_nets import (LM, batches, make_mesh, same_bits, train_jit, train_shard_map,
                             wire_ratio)

STEPS = 20
TRAIN = {"shard_map": train_shard_map, "jit": train_jit}
MESHES = {"fsdp8": ((8,), ("fsdp",)), "data2xfsdp4": ((2, 4), ("data", "fsdp"))}
# The data-axis mesh runs in the slow lane (the fast lane covers it through the nnx.scan test).
MESH_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if "data" in name else [])
               for name in MESHES]


@pytest.mark.parametrize("mesh_name", MESH_PARAMS)
@pytest.mark.parametrize("model", list(TRAIN))
def test_ciera_equals_plain_int8_differs_and_ciera_sends_less(model, mesh_name):
    mesh = make_mesh(*MESHES[mesh_name])
    tokens = batches(mesh, STEPS)
    runs = {mode: TRAIN[model](LM, mesh, mode, tokens) for mode in ("ciera", "plain", "int8")}
    (pc, hc, lc), (pp, hp, lp), (pi, _, _) = runs["ciera"], runs["plain"], runs["int8"]
    assert same_bits(pc, pp)  # lossless: bitwise the same parameters after 20 AdamW steps
    assert lc == lp
    assert not same_bits(pi, pp)  # the lossy baseline is not
    assert lc[-1] < lc[0]  # it trains
    # every gathered kernel is there: the outer module's and the inner block's
    assert sorted(hc[0]) == ["block/down/kernel", "block/up/kernel", "embed/embedding",
                             "head/kernel"]
    assert all(int(s["fallback"]) == 1 for s in hc[0].values())  # the first gather primes
    assert wire_ratio(hc) <= 0.7, wire_ratio(hc)
    assert wire_ratio(hp) == 1.0

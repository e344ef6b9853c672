"""The compressed gather's shape in the compiled program: one main transfer per tensor, outside
every conditional (so XLA can run it asynchronously under compute); conditional branches with
a transfer hold nothing but small transfers (the escape section's prefixes) and the plain
fallback; the fallback's other branch holds no transfer (exponent mode decodes there).

Checked on the jaxpr of one gather (both modes, bf16 and float32) and on the optimized CPU HLO
of the tiny train step with every tensor compressed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.runtime import hlo
from ciera_jax.codec.wire import ExponentWire, WordWire
from harness import escape_walk
from jaxprs import outside, subjaxprs, walk

N = 8
SHAPE = (N * 64, 48)
GATHERS = {"all_gather", "all_gather_invariant"}
# What a branch may do besides gathering: cut, pad and view the section buffers (and lay the
# fallback's bits out as the full tensor).
TRANSFER_ONLY = GATHERS | {"slice", "pad", "concatenate", "bitcast_convert_type", "reshape",
                           "broadcast_in_dim", "pcast", "convert_element_type", "squeeze",
                           "dynamic_slice", "transpose",
                           "jit"}  # jit: jnp.pad's wrapper (walked into)
# The plain fallback's branch (a rare step) also refreshes an exponent cache from its bits.
FALLBACK_ALSO = {"shift_right_logical", "and"}


def _gather_jaxpr(mode, dtype):
    mesh = jax.make_mesh((N,), ("fsdp",))

    def body(x, c):
        full, new_c, _ = ciera_jax.all_gather(x, c, "fsdp")
        return full, new_c

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=(P(), P()),
                       check_vma=False)
    x = jax.device_put(jnp.zeros(SHAPE, dtype), NamedSharding(mesh, P("fsdp")))
    return jax.make_jaxpr(fn)(x, ciera_jax.init_cache(SHAPE, dtype, mode)).jaxpr


@pytest.mark.parametrize("loop", [False, True], ids=["dense", "either"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_one_main_transfer_outside_conditionals_and_branches_only_transfer(mode, dtype, loop):
    with escape_walk(loop):
        jaxpr = _gather_jaxpr(mode, dtype)
    n_local = SHAPE[0] * SHAPE[1] // N
    word_bytes = jnp.dtype(dtype).itemsize
    wire = ExponentWire(n_local, word_bytes) if mode == "exponent" else WordWire(n_local,
                                                                                  word_bytes)
    top = [e for e in outside(jaxpr, "cond") if e.primitive.name in GATHERS]
    assert [e.invars[0].aval.size for e in top] == [wire.main_bytes], \
        "exactly one transfer outside conditionals: the main plane with its checksum"
    all_conds = [e for e in walk(jaxpr) if e.primitive.name == "cond"]
    conds = [c for c in all_conds
             if any(e.primitive.name in GATHERS for b in subjaxprs(c) for e in walk(b))]
    assert len(conds) == 2, "the escape section's rung switch and the plain fallback"
    # Where both walks are compiled (long rows on CPU), the other conds choose how the escapes
    # are walked (one pass over every element where they are dense, a loop over them
    # elsewhere): one per escape pack and per fill, no collective inside. Short rows: none.
    walks = [c for c in outside(jaxpr, "while") if c.primitive.name == "cond" and c not in conds]
    assert len(walks) == ((2 if mode == "exponent" else 3) if loop else 0), len(walks)
    rest = n_local * word_bytes - (wire.main_bytes - 4)  # the fallback: bits past the head
    rest_gathers = decoding_branches = 0
    for c in conds:
        fallback = len(list(subjaxprs(c))) == 2  # the rung switch has a branch per rung
        for branch in subjaxprs(c):
            if fallback and not any(e.primitive.name in GATHERS for e in walk(branch)):
                # Exponent mode decodes here (skipped on a fallback); word mode passes the
                # words it decoded before the conditional through.
                decodes = any(e.primitive.name not in TRANSFER_ONLY for e in walk(branch))
                assert decodes == (mode == "exponent"), mode
                decoding_branches += 1
                continue
            for e in walk(branch):
                assert e.primitive.name in TRANSFER_ONLY | (FALLBACK_ALSO if fallback else
                                                            set()), (mode, e.primitive.name)
                if e.primitive.name in GATHERS:
                    size = e.invars[0].aval.size * e.invars[0].aval.dtype.itemsize
                    if size == rest:
                        rest_gathers += 1
                    else:
                        assert size <= max(wire.section_sizes), size
    assert rest_gathers == 1, "the plain fallback is the one large transfer in a branch"
    assert decoding_branches == 1, "the fallback's other branch: no transfer"


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_compiled_gather_keeps_the_main_plane_out_of_branches(mode):
    """The optimized CPU HLO of one gather: the main plane's all-gather runs in a computation
    outside every conditional; the fallback's rest of the bits inside one."""
    mesh = jax.make_mesh((N,), ("fsdp",))

    def body(x, c):
        return ciera_jax.all_gather(x, c, "fsdp")[:2]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                               out_specs=(P(), P()), check_vma=False))
    x = jax.device_put(jnp.zeros(SHAPE, jnp.bfloat16), NamedSharding(mesh, P("fsdp")))
    comps = hlo.computations(fn.lower(x, ciera_jax.init_cache(SHAPE, jnp.bfloat16, mode))
                             .compile().as_text())
    in_branch = hlo.inside_branches(comps)
    n_local = SHAPE[0] * SHAPE[1] // N
    wire = ExponentWire(n_local, 2) if mode == "exponent" else WordWire(n_local, 2)
    rest = 2 * n_local - (wire.main_bytes - 4)
    where = {}
    for name, body_text in comps.items():
        for dtype, dims in hlo.all_gathers(body_text):
            where.setdefault(dims[-1] if dims else 0, set()).add(name in in_branch)
    assert where[wire.main_bytes] == {False}, where
    assert where[rest] == {True}, where


@pytest.mark.slow  # compiles the tiny train step twice (about a minute each on 2 cores)
@pytest.mark.parametrize("cache", ["exponent", "word"])
def test_train_step_hlo_keeps_main_transfers_out_of_branches(cache):
    from ciera_models.train import data
    from ciera_models.train import TrainConfig, build_trainer, make_mesh

    tc = TrainConfig(config="tiny", schedule_steps=4, plan="all", cache=cache)
    tr = build_trainer(tc, make_mesh(N))
    state = tr.prepare(tr.init_state(0))
    batch = tr.batch(data.load_dataset(None, 256, tc.length), 0, 0)
    text = jax.jit(tr.step_fn).lower(*tr.at_rungs(
        (state.params, state.caches, state.opt_state, state.ahead, batch), "steady")
    ).compile().as_text()
    comps = hlo.computations(text)
    in_branch = hlo.inside_branches(comps)
    u8_outside, big_inside = 0, 0  # (escape prefixes in the tiny model are < 2000 bytes)
    for name, body in comps.items():
        for dtype, dims in hlo.all_gathers(body):
            if name in in_branch:
                big_inside += dtype == "u8" and max(dims, default=0) > 2000
            else:
                u8_outside += dtype == "u8"
    assert u8_outside > 0, "the compressed tensors' main planes travel outside conditionals"
    assert big_inside > 0, "the plain fallbacks (rest of the bits) sit in branches"


def test_fusion_sources_name_the_library_function_of_every_fusion():
    """``hlo.fusion_sources`` (what ``benchmarks/compile_time.py`` reports): every fusion of
    a compiled program is counted once, a codec fusion at the codec's function."""
    from ciera_jax.codec import bitfields

    x = jnp.arange(4096, dtype=jnp.float32).astype(jnp.bfloat16)
    text = jax.jit(lambda x: (bitfields.split(x), jnp.sin(x.astype(jnp.float32)))).lower(
        x).compile().as_text()
    sources = hlo.fusion_sources(text)
    fusions = [line for line in text.splitlines() if " fusion(" in line and "calls=" in line]
    assert fusions and sum(sources.values()) == len(fusions)
    assert any(k.startswith("codec/bitfields.py:") for k in sources), sources
    assert set(sources) - {"(outside ciera_jax)", "(no source)"} <= {
        k for k in sources if k.split(":")[0].endswith(".py")}


def test_ir_sources_attribute_each_kernel_s_llvm_ir_to_its_fusion_s_function(tmp_path):
    """``hlo.cpu_kernel_ir`` + ``hlo.ir_sources`` (``compile_time.py --ir-sources``): an
    XLA:CPU dump's kernels are the compiled module's fusions, each kernel's IR counted once
    at its innermost library frame, and at every frame of its stack when inclusive."""
    from ciera_jax.codec import bitfields

    x = jnp.arange(4096, dtype=jnp.float32).astype(jnp.bfloat16)
    jax.jit(lambda x: (bitfields.split(x), jnp.sin(x.astype(jnp.float32)))).lower(x).compile(
        compiler_options={"xla_dump_to": str(tmp_path)})
    text, kernels = hlo.cpu_kernel_ir(str(tmp_path))
    assert kernels and all(size > 0 for size in kernels.values())
    fused = set(hlo.fusion_chains(text))
    assert set(kernels) & fused, (sorted(kernels), sorted(fused))
    sources = hlo.ir_sources(text, kernels)
    assert sum(sources.values()) == sum(kernels.values())
    assert any(k.startswith("codec/bitfields.py:") for k in sources), sources
    inclusive = hlo.ir_sources(text, kernels, inclusive=True)
    for frame, size in sources.items():
        if not frame.startswith("("):  # a library frame: its kernels and its callees'
            assert inclusive[frame] >= size
    assert hlo.ir_sources(text, {"no_such_kernel": 7}) == {"(not a fusion)": 7}
    with pytest.raises(ValueError, match="one XLA:CPU module"):
        hlo.cpu_kernel_ir(str(tmp_path / "empty"))

"""Every kernel on every Pallas backend, the compressed gather and the whole train step lower
for CUDA on this CPU-only host.

``jax.export.export(jax.jit(f), platforms=["cuda"])`` runs JAX's real CUDA lowering: Pallas
builds each kernel (the Mosaic GPU module, or the Triton IR) and embeds it in a custom call
(``mosaic_gpu_v2``, ``__gpu$xla.gpu.triton``); the export then stops only at its safety check
for custom calls, which ``DisabledSafetyCheck.custom_call(name)`` lifts. So lowering gaps
(unsupported ops, layouts, casts, block shapes) fail here without a GPU. What this cannot
catch: PTX generation and runtime behaviour (``benchmarks/gpu_check.sh`` on a GPU).

Sharded programs export from the emulated 8-device CPU mesh as they are: ``jax.export`` keeps
the device count and the shardings, not the devices. ``kernels.lowering_for("cuda", ...)`` makes
``impl`` resolve as on that GPU (no interpreter), so ``"auto"`` and ``"pallas"`` pick the
kernels they would pick there.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.codec import bitfields
from ciera_jax import kernels as K
from test_kernels import BACKENDS, BLOCK, WORDS
from conftest import TINY_PROGRAMS

SHAPE = (3, BLOCK + 7)  # ragged: padding and unpadding are part of what lowers
# JAX 0.11 lowers a Pallas Triton kernel for CUDA only where a GPU is ("No supported GPU devices
# found"); there gpu_check.sh compiles them on one. Mosaic GPU lowers without one on both.
JAX_VERSION = tuple(int(v) for v in jax.__version__.split(".")[:2])
TRITON_LOWERS_HERE = "triton" in K.available_backends() and JAX_VERSION < (0, 11)
NO_TRITON_LOWERING = "no Pallas Triton, or a JAX (>= 0.11) that lowers it only with a GPU"


def lowerable(backends):
    """``backends`` (names, or parameters of one) as parameters, Triton's skipped where it
    cannot lower here."""
    def one(b):
        name, marks = (b.values[0], list(b.marks)) if hasattr(b, "values") else (b, [])
        skip = pytest.mark.skipif(name == "triton" and not TRITON_LOWERS_HERE,
                                  reason=NO_TRITON_LOWERING)
        return pytest.param(name, marks=[*marks, skip], id=name)
    return [one(b) for b in backends]
ALL_CHECKS = [export.DisabledSafetyCheck.custom_call(name) for name in K.CUSTOM_CALL.values()]


def lower_for_cuda(fn, *args, capability="9.0") -> str:
    """The exported module's text for CUDA, with the kernels' custom calls allowed."""
    with K.lowering_for("cuda", capability=capability):
        return export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=ALL_CHECKS)(*args).mlir_module()


def kernel_calls(dtype, backend):
    """(name, fn, abstract args) for every kernel on ``backend``."""
    P_ = bitfields.word_format(dtype).payload_bytes
    x = jax.ShapeDtypeStruct(SHAPE, dtype)
    u8 = jax.ShapeDtypeStruct(SHAPE, jnp.uint8)
    planes = jax.ShapeDtypeStruct((P_, *SHAPE), jnp.uint8)
    words = jax.ShapeDtypeStruct(SHAPE, WORDS[dtype])
    full = (8 * 4, 1024)  # 8 ranks' shards, fusable for the checksum kernel
    kw = dict(backend=backend)
    return escape_calls(dtype, backend) + [
        ("encode", lambda x, c: K.encode_pallas(x, c, **kw), (x, u8)),
        ("decode", lambda e, p: K.decode_pallas(e, p, dtype, **kw), (u8, planes)),
        ("word_encode", lambda x, w: K.word_encode_pallas(x, w, **kw), (x, words)),
        ("word_decode", lambda w, c: K.word_decode_pallas(w, c, 3, **kw), (words, u8)),
        ("decode_checksum", lambda e, p: K.decode_checksum_pallas(e, p, dtype, 8, **kw),
         (jax.ShapeDtypeStruct(full, jnp.uint8), jax.ShapeDtypeStruct((P_, *full), jnp.uint8))),
        ("decode_checksum off axis 0",
         lambda e, p: K.decode_checksum_pallas(e, p, dtype, 8, axis=1, **kw),
         (jax.ShapeDtypeStruct((2, 8, 256), jnp.uint8),
          jax.ShapeDtypeStruct((P_, 2, 8, 256), jnp.uint8))),
        ("decode_checksum of payload rows",  # (2, 8, 256) on axis 1, rows (8, P, 2 x 256)
         lambda e, p: K.decode_checksum_pallas(e, p, dtype, 8, axis=1, payload_rows=True, **kw),
         (jax.ShapeDtypeStruct((2, 8, 256), jnp.uint8),
          jax.ShapeDtypeStruct((8, P_, 2 * 256), jnp.uint8))),
        ("word_decode_rows",  # the cache (2, 8 x 2, 4096) read in place, rows of (2, 2, 4096)
         lambda w, c: K.word_decode_rows_pallas(w, c, 3, (2, 2, 4096), 1, **kw),
         (jax.ShapeDtypeStruct((2, 16, 4096), WORDS[dtype]),
          jax.ShapeDtypeStruct((8, 2 * 2 * 4096), jnp.uint8))),
    ]


def escape_calls(dtype, backend):
    """The escape kernels (Triton only: Mosaic GPU has no per-element gather/scatter): the
    sender's pack of this dtype's words, the exponent and word receivers' fills, 8 ranks."""
    if backend != "triton":
        return []
    n = 2 * K.ESCAPE_BLOCK + 7
    S = jax.ShapeDtypeStruct
    flags = S((8, -(-n // 32)), jnp.uint32)
    limit = S((8,), jnp.int32)
    w = WORDS[dtype]
    return [
        ("escape_pack", lambda v, f: K.pack_pallas(v, f, 301, backend=backend),
         (S((n,), w), S(flags.shape[1:], jnp.uint32))),
        ("escape_fill_exponents",
         lambda c, f, s, lim: K.fill_exponents_pallas(c, f, s, lim, backend=backend),
         (S((8, n), jnp.uint8), flags, S((8, 301), jnp.uint8), limit)),
        ("escape_fill_words",
         lambda d, f, a, b, lim: K.fill_words_pallas(d, f, a, b, lim, escape_offset=4,
                                                     level2_code=-128, backend=backend),
         (S((8, n), w), flags, S((8, 999), jnp.int8), S((8, 125), w), limit)),
    ]


@pytest.mark.parametrize("backend", lowerable(BACKENDS))
@pytest.mark.parametrize("dtype", list(WORDS), ids=["bf16", "f32"])
def test_every_kernel_lowers_for_cuda(dtype, backend):
    for name, fn, args in kernel_calls(dtype, backend):
        module = lower_for_cuda(fn, *args)
        assert module.count(K.CUSTOM_CALL[backend]) == 1, name
        other = [c for b, c in K.CUSTOM_CALL.items() if b != backend]
        assert not any(c in module for c in other), name


def test_mosaic_kernels_are_named():
    """The Mosaic GPU modules carry our kernel names (for profiles and HLO dumps)."""
    module = lower_for_cuda(lambda x, c: K.encode_pallas(x, c, backend="mosaic"),
                            jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16),
                            jax.ShapeDtypeStruct(SHAPE, jnp.uint8))
    assert "ciera_encode_bfloat16" in module


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("fsdp",))


def gather_fn(mesh, impl):
    def body(x, cache):
        return ciera_jax.all_gather(x, cache, "fsdp", impl=impl)

    return jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=(P(), P(), P()),
                         check_vma=False)


def gather_module(mesh, mode, dtype, impl, capability="9.0") -> str:
    shape = (8 * 64, 256)
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("fsdp")))
    cache = ciera_jax.init_cache(shape, dtype, mode=mode)
    return lower_for_cuda(gather_fn(mesh, impl), x, cache, capability=capability)


@pytest.mark.parametrize("mode", ["exponent", "word"])
@pytest.mark.parametrize("dtype", list(WORDS), ids=["bf16", "f32"])
def test_gather_with_pallas_lowers_for_cuda(mesh, mode, dtype):
    module = gather_module(mesh, mode, dtype, "pallas")
    assert module.count(K.CUSTOM_CALL["mosaic"]) >= 2  # the encode and the decode, at least
    kernels = set(re.findall(r"ciera_(?:word_)?(?:en|de)code", module))
    want = {"ciera_word_encode", "ciera_word_decode"} if mode == "word" else {
        "ciera_encode", "ciera_decode"}
    assert want <= kernels, kernels
    assert "all_gather" in module


@pytest.mark.parametrize("mode", ["exponent", "word"])
@pytest.mark.parametrize("impl,capability", [
    ("auto", "9.0"),
    pytest.param("triton", "8.0", marks=pytest.mark.skipif(
        not TRITON_LOWERS_HERE, reason=NO_TRITON_LOWERING))])
def test_gather_with_kernels_lowers_in_a_checked_shard_map(mesh, mode, impl, capability):
    """A user's ``shard_map`` with JAX's default ``check_vma=True``: every kernel declares its
    outputs' manual-axis type (without it Pallas refuses the output and the gather fails on a
    GPU only). The gathered weights are used inside, the new cache leaves replicated."""
    shape = (8 * 64, 256)

    def body(x, cache, h):
        full, cache, _ = ciera_jax.all_gather(x, cache, "fsdp", impl=impl)
        return h @ full, cache

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P(), P("fsdp")),
                       out_specs=(P("fsdp"), P()))
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    h = jax.ShapeDtypeStruct((8 * 4, shape[0]), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("fsdp")))
    cache = ciera_jax.init_cache(shape, jnp.bfloat16, mode=mode)
    module = lower_for_cuda(fn, x, cache, h, capability=capability)
    backend = "mosaic" if impl == "auto" else impl
    assert module.count(K.CUSTOM_CALL[backend]) >= 2


@pytest.mark.parametrize("capability,backend", [("9.0", "mosaic"), ("10.0", "mosaic"),
                                                ("8.0", None)])
def test_gather_auto_per_gpu(mesh, capability, backend):
    """``impl="auto"``: Mosaic GPU kernels on Hopper and Blackwell, fused jnp on Ampere."""
    module = gather_module(mesh, "exponent", jnp.bfloat16, "auto", capability=capability)
    for b, call in K.CUSTOM_CALL.items():
        assert (call in module) == (b == backend), (capability, b)


@pytest.mark.skipif(not TRITON_LOWERS_HERE, reason=NO_TRITON_LOWERING)
@pytest.mark.parametrize("mode,escape_kernels", [
    ("word", {"ciera_escape_pack_int8", "ciera_escape_pack_uint16",
              "ciera_escape_fill_words_uint16"}),
    ("exponent", {"ciera_escape_pack_uint8", "ciera_escape_fill_exponents"})])
def test_gather_with_triton_lowers_for_cuda(mesh, mode, escape_kernels):
    """On Triton the escapes are kernels too (Mosaic GPU has none: docs/kernels.md)."""
    module = gather_module(mesh, mode, jnp.bfloat16, "triton", capability="8.0")
    assert module.count(K.CUSTOM_CALL["triton"]) >= 2 + len(escape_kernels)
    assert escape_kernels <= set(re.findall(r"ciera_escape_[a-z0-9_]+", module))


def test_train_step_lowers_for_cuda():
    """The compiled ``ciera train`` programs (tiny config, 8 ranks), their codec with
    ``impl="auto"`` resolved as on an H100/H200: Mosaic GPU decode kernels in the step's
    gathers, encode kernels in the encode program that runs after it (exponent or word mode,
    whichever the plan gives the tensors)."""
    from ciera_models.train import data
    from ciera_models.train import TrainConfig, build_trainer, make_mesh

    tc = TrainConfig(config="tiny", schedule_steps=20, **TINY_PROGRAMS)  # test_train's
    tr = build_trainer(tc, make_mesh(8))
    assert any(tr.compress.values())
    state = tr.prepare(tr.init_state(0))
    batch = tr.batch(data.load_dataset(None, 256, tc.length), 0, 0)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tr.at_rungs((state.params, state.caches, state.opt_state,
                                     state.ahead, batch), "steady"))
    counts = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state.ahead["word_changed"])
    with K.lowering_for("cuda", capability="9.0"):
        exported = export.export(tr.step_fn, platforms=["cuda"],
                                 disabled_checks=ALL_CHECKS)(*args)
        encode = export.export(tr.prepare_fn, platforms=["cuda"],
                               disabled_checks=ALL_CHECKS)(args[0], args[1], counts)
    module, encode_module = exported.mlir_module(), encode.mlir_module()
    assert exported.platforms == encode.platforms == ("cuda",) and exported.nr_devices == 8
    assert module.count(K.CUSTOM_CALL["mosaic"]) >= 1
    assert encode_module.count(K.CUSTOM_CALL["mosaic"]) >= 1
    kernel = r"ciera_(?:word_)?(?:en|de)code"  # the plan's cache modes
    step_kernels, encode_kernels = (set(re.findall(kernel, m)) for m in (module, encode_module))
    assert step_kernels in ({"ciera_decode"}, {"ciera_word_decode"}), step_kernels
    assert encode_kernels == {step_kernels.pop().replace("decode", "encode")}, encode_kernels

"""Our code raises no DeprecationWarning on the installed JAX: every warning of that kind (and
JAX's own deprecation category) is an error while the kernels trace, run interpreted and lower
for CUDA, and while a small compressed all_gather compiles and runs.

The one expected exception is JAX's own deprecation of the Pallas *Triton backend* (JAX >= 0.11
warns when a Triton kernel lowers for CUDA): ``impl="triton"`` is opt-in and documented as
such (docs/kernels.md); nothing reaches Triton unless asked (``auto`` never does).
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import kernels as K
from test_cuda_lowering import ALL_CHECKS, JAX_VERSION, kernel_calls, lowerable
from test_kernels import WORDS

TRITON_DEPRECATED = JAX_VERSION >= (0, 11)


@contextlib.contextmanager
def deprecations_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", PendingDeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        yield


@pytest.mark.parametrize("backend", lowerable(K.available_backends()))
@pytest.mark.parametrize("dtype", list(WORDS), ids=["bf16", "f32"])
def test_kernels_trace_and_lower_without_deprecations(dtype, backend):
    jax.clear_caches()  # trace afresh, inside the filter
    for name, fn, args in kernel_calls(dtype, backend):
        with deprecations_are_errors():
            jax.jit(fn).trace(*args)  # tracing (the interpreter's path on CPU)
        lowering = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=ALL_CHECKS)
        with K.lowering_for("cuda"):
            if backend == "triton" and TRITON_DEPRECATED:
                with pytest.warns(DeprecationWarning, match="Triton backend is deprecated"):
                    lowering(*args)
                continue
            with deprecations_are_errors():
                lowering(*args)


def test_kernels_run_interpreted_without_deprecations():
    x = jnp.linspace(-3, 3, 1000, dtype=jnp.float32)
    cache = jnp.zeros(x.shape, jnp.uint8)
    jax.clear_caches()
    with deprecations_are_errors():
        for impl in ("auto", "xla", "pallas", *K.available_backends()):
            exp, payload, _ = K.encode(x, cache, impl=impl)
            np.testing.assert_array_equal(np.asarray(K.decode(exp, payload, x.dtype, impl=impl)),
                                          np.asarray(x))


@pytest.mark.parametrize("mode,impl", [("exponent", "pallas"), ("word", "auto")])
def test_all_gather_without_deprecations(mode, impl):
    """A small gather compiles and runs on the 8-device CPU mesh (pallas: interpreted by
    Triton's HLO interpreter) and lowers for CUDA with the Mosaic GPU kernels, all with
    deprecations as errors."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    shape = (8 * 16, 128)
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape).astype(jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    jax.clear_caches()
    cache = ciera_jax.init_cache(shape, jnp.bfloat16, mode=mode)
    fn = jax.jit(jax.shard_map(
        lambda x, c: ciera_jax.all_gather(x, c, "fsdp", impl=impl),
        mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=(P(), P(), P()), check_vma=False))
    with deprecations_are_errors():
        for _ in range(2):  # priming, then a compressed step
            full, cache, _ = fn(x, cache)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(x))
    abstract = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=x.sharding)
    with K.lowering_for("cuda"), deprecations_are_errors():
        module = export.export(fn, platforms=["cuda"], disabled_checks=ALL_CHECKS)(
            abstract, ciera_jax.init_cache(shape, jnp.bfloat16, mode=mode)).mlir_module()
    assert K.CUSTOM_CALL["mosaic"] in module

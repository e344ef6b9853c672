"""The platform code is traced for: this host's, or a GPU named for a compile without one.

Some choices are made at trace time by platform (which Pallas backend, whether the escapes
compile a loop over escapes for XLA:CPU or one dense pass for a GPU). A compile for a GPU that
is not here (``ciera aot``, ``jax.export`` to CUDA) must make them as on that GPU, not as on
this host's CPU: :func:`tracing_for_gpu` says so for a block, thread-locally.
"""

from __future__ import annotations

import contextlib
import threading

import jax

_target = threading.local()


def forced_gpu_capability() -> tuple[int, int] | None:
    """The compute capability a :func:`tracing_for_gpu` block traces for, else None."""
    return getattr(_target, "capability", None)


def traced_backend() -> str:
    """``"gpu"`` inside :func:`tracing_for_gpu`, else JAX's default backend."""
    return "gpu" if forced_gpu_capability() is not None else jax.default_backend()


@contextlib.contextmanager
def tracing_for_gpu(capability: tuple[int, int]):
    """Trace as for a CUDA GPU of ``capability`` inside this block. The choice is not part of
    ``jax.jit``'s cache key, so entering and leaving clear JAX's caches: a function traced
    before is traced again inside, and nothing traced inside leaks out."""
    prev = forced_gpu_capability()
    _target.capability = tuple(capability)
    jax.clear_caches()
    try:
        yield
    finally:
        _target.capability = prev
        jax.clear_caches()

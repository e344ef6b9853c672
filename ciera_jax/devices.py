"""Emulated CPU devices for laptops and CI; real accelerators are used as they are."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"


def emulate_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` host devices. Must run before JAX creates its backends."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_FLAG}={n}"])


def setup_devices(n: int | None) -> None:
    """Use accelerators when present, else ``n`` emulated CPU devices (default 8)."""
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and not _has_accelerator():
        emulate_cpu_devices(n or 8)


def _has_accelerator() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin", "libtpu"))

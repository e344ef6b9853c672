"""Emulated CPU devices for laptops and CI; real accelerators are used as they are, with the
XLA flags that let collectives overlap compute on GPU."""

from __future__ import annotations

import os

import jax
import numpy as np

from ciera_jax.runtime.gpu_targets import FSDP_XLA_FLAGS

_FLAG = "--xla_force_host_platform_device_count"

# Applied on GPU to every compile in the process, unless the user's XLA_FLAGS already set them
# (checked by flag name): two of the ``fsdp`` set (:data:`gpu_targets.FSDP_XLA_FLAGS`, the
# step's own compile options), so a run with ``--xla-flags default`` keeps them too.
#   latency-hiding scheduler: moves collectives' start/done apart so the gather of layer l+1
#     runs under the compute of layer l (JAX "GPU performance tips"; NVIDIA JAX-Toolbox sets it
#     by default in its images)
#   highest-priority async stream: collectives' stream gets priority over compute kernels so a
#     prefetch is not starved by the matmuls it should hide behind (JAX "GPU performance tips")
PROCESS_WIDE_FLAGS = ("xla_gpu_enable_latency_hiding_scheduler",
                      "xla_gpu_enable_highest_priority_async_stream")
GPU_XLA_FLAGS: tuple[str, ...] = tuple(
    f"--{name}={str(FSDP_XLA_FLAGS[name]).lower()}" for name in PROCESS_WIDE_FLAGS)


def emulate_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` host devices. Must run before JAX creates its backends."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_FLAG}={n}"])


def apply_gpu_flags(flags=GPU_XLA_FLAGS) -> list[str]:
    """Append ``flags`` to XLA_FLAGS, skipping any whose name the user already set; returns
    the ones added. Must run before JAX creates its backends."""
    current = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added


def setup_devices(n: int | None) -> None:
    """Use accelerators when present (GPU: with :data:`GPU_XLA_FLAGS`), else ``n`` emulated
    CPU devices (default 8)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if cpu_unless_accelerator():
        emulate_cpu_devices(n or 8)
    elif platforms != "cpu" and has_gpu():
        apply_gpu_flags()


def cpu_unless_accelerator() -> bool:
    """With no accelerator and no platform but the CPU named, name the CPU (returns whether it
    did): an installed CUDA plugin (``ciera aot``'s) would otherwise try to start a GPU and
    print a cuPTI traceback before JAX falls back to the CPU. Must run before JAX creates its
    backends."""
    if os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu") or has_accelerator():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"  # for child processes
    jax.config.update("jax_platforms", "cpu")  # this one read the variable at import
    return True


def make_mesh(n_devices: int | None = None, axis_names: tuple[str, ...] = ("fsdp",)
              ) -> jax.sharding.Mesh:
    """A mesh over the first ``n_devices`` devices (all when None), all of them on the first of
    ``axis_names`` (any further names get size 1). Importing JAX does not start its backends, so
    :func:`setup_devices` may still run after this module is imported, not after this call."""
    devs = jax.devices()
    n = len(devs) if n_devices is None else n_devices
    if n < 1:
        raise ValueError(f"asked for a mesh of {n} devices; use a positive device count, or "
                         "none for all")
    if n > len(devs):
        raise ValueError(f"asked for {n} devices but JAX sees {len(devs)} "
                         f"({devs[0].platform}); on CPU pass --devices before anything starts "
                         "JAX, or use fewer")
    shape = (n,) + (1,) * (len(axis_names) - 1)
    return jax.sharding.Mesh(np.array(devs[:n]).reshape(shape), tuple(axis_names))


# A GPU plugin may be installed on a machine without a GPU (``ciera aot`` compiles for one
# through it), so an installed plugin alone says nothing: the driver's device nodes must exist.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def has_accelerator() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None or has_gpu()


def has_gpu() -> bool:
    """A GPU plugin is installed, the driver shows a device, and CUDA is not told to hide it."""
    import importlib.util

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    plugin = any(importlib.util.find_spec(m) is not None
                 for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin"))
    return plugin and any(os.path.exists(node) for node in GPU_DEVICE_NODES)

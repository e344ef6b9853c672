"""devices.py: the one mesh helper and the XLA flag handling."""

from __future__ import annotations

import os

import pytest

from ciera_jax.runtime import devices


def test_make_mesh_puts_devices_on_the_first_axis():
    mesh = devices.make_mesh(4)
    assert mesh.axis_names == ("fsdp",) and mesh.devices.shape == (4,)
    mesh = devices.make_mesh(None, ("fsdp", "tp"))
    assert dict(mesh.shape) == {"fsdp": 8, "tp": 1}


@pytest.mark.parametrize("n, says", [(0, "positive device count"), (-2, "positive"),
                                     (64, "asked for 64 devices but JAX sees 8")])
def test_make_mesh_rejects_bad_counts(n, says):
    with pytest.raises(ValueError, match=says):
        devices.make_mesh(n)


def test_emulated_device_flag_replaces_an_earlier_one(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--foo=1 --xla_force_host_platform_device_count=2")
    devices.emulate_cpu_devices(4)
    assert os.environ["XLA_FLAGS"].split() == [
        "--foo=1", "--xla_force_host_platform_device_count=4"]


def test_gpu_flags_keep_what_the_user_set(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    added = devices.apply_gpu_flags()
    assert added == ["--xla_gpu_enable_highest_priority_async_stream=true"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in os.environ["XLA_FLAGS"]
    assert "latency_hiding_scheduler=true" not in os.environ["XLA_FLAGS"]


@pytest.mark.parametrize("plugin,node,visible,expect", [
    (True, False, None, False),   # ``ciera aot``'s plugin on a CPU machine: emulate devices
    (True, True, None, True),     # a GPU machine
    (True, True, "-1", False),    # CUDA told to hide every device
    (False, True, None, False),   # a driver but no JAX plugin: JAX would run on CPU
])
def test_an_installed_gpu_plugin_alone_is_no_gpu(monkeypatch, plugin, node, visible, expect):
    import importlib.util

    from ciera_jax.runtime import devices

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: (
        object() if plugin and m.startswith("jax_cuda") else
        None if m.startswith(("jax_cuda", "jax_rocm", "libtpu")) else real_find_spec(m, *a)))
    monkeypatch.setattr(devices.os.path, "exists",
                        lambda p: node if p in devices.GPU_DEVICE_NODES else False)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.has_gpu() is expect
    assert devices.has_accelerator() is expect

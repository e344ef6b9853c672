"""Device setup: XLA's GPU flags are added on a GPU unless the user set them."""

import os

from ciera_jax import devices


def test_gpu_xla_flags_respect_the_user(monkeypatch):
    monkeypatch.setattr(devices, "_has_accelerator", lambda: True)
    monkeypatch.setattr(devices, "_has_gpu", lambda: True)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    devices.setup_devices(None)
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags  # the user's, kept
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert "--xla_gpu_enable_highest_priority_async_stream=true" in flags
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(devices, "_has_gpu", lambda: False)  # e.g. TPU: no GPU flags
    devices.setup_devices(None)
    assert os.environ["XLA_FLAGS"] == ""

"""Eight emulated CPU devices for every test; must run before JAX is imported."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

# Start the backend now, with 8 devices, so that no test (e.g. a CLI run with --devices 4)
# can re-flag XLA for the rest of the session.
assert len(jax.devices()) >= 8, jax.devices()

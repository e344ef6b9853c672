"""The train step and JAX's persistent compilation cache.

- Every process traces the same step: nothing in it may depend on Python's string hashing,
  which differs per process (a multi-host run would compile a different program per host).
- ``ciera train`` turns the cache off and says so: a step loaded from it trained wrongly (see
  docs/training.md), so every run compiles its own, and trains as it would without a cache.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

LOWERED_HASH = """
from ciera_jax.runtime.devices import setup_devices
setup_devices(8)
import hashlib, jax
from ciera_jax.runtime.devices import make_mesh
from ciera_models.train.data import load_dataset
from ciera_models.train import TrainConfig, build_trainer
tr = build_trainer(TrainConfig(schedule_steps=4), make_mesh(8))
state = tr.prepare(tr.init_state(0))
batch = tr.batch(load_dataset(None, tr.tc.model.vocab_size, tr.tc.length), 0, 0)
text = jax.jit(tr.step_fn).lower(*tr.at_rungs(
    (state.params, state.caches, state.opt_state, state.ahead, batch), "steady")
).as_text(debug_info=False)
print(hashlib.sha256(text.encode()).hexdigest())
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, **extra}


def _python(args, env):
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_every_process_traces_the_same_step():
    hashes = {_python(["-c", LOWERED_HASH], _env(PYTHONHASHSEED=seed)).stdout.split()[-1]
              for seed in ("1", "2", "3")}
    assert len(hashes) == 1, "the step's program depends on the process's string hashing"


@pytest.mark.slow
def test_ciera_train_turns_the_persistent_cache_off(tmp_path):
    args = ["-m", "ciera_jax.cli.main", "train", "--steps", "2", "--schedule-steps", "20"]
    plain = _python(args, _env())
    cache_dir = tmp_path / "jax_cache"
    cached = _python(args, _env(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))
    assert "persistent compilation cache is turned off" in cached.stderr
    assert not cache_dir.exists() or not any("local_step" in f.name for f in cache_dir.iterdir())
    sha = [re.search(r"params_sha256=(\w+)", p.stdout).group(1) for p in (plain, cached)]
    assert sha[0] == sha[1]

"""The train step and JAX's persistent compilation cache.

- Every process traces the same step: nothing in it may depend on Python's string hashing,
  which differs per process (a multi-host run would compile a different program per host).
- ``ciera train`` honours the user's cache settings: with ``JAX_COMPILATION_CACHE_DIR`` set,
  fresh processes load the step from the cache and train bitwise as a run without a cache
  does, in both cache modes; so does the README's decorated Flax model. Each case loads the
  step in ``LOADED`` fresh processes (two at a time), the two-process case in
  ``LOADED_TWO_PROCESS`` runs. A loader that fails one run in three fails some of the file's
  7 loaded runs (the default) with probability 1 - (2/3)**7 = 94%; to hunt a rarer failure,
  or one in one case alone, set ``CIERA_CACHE_LOADS`` (10: 98% per case).
- Over two processes, fresh runs after the writing one end bitwise at the uncached run's
  params. On CPUs only process 0 loads the step: each process's step runs
  on its own devices, which are in the program's key there, and only process 0 writes the
  cache; so process 1 compiles while process 0 waits for it before their first collective.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ciera_harness.launch import free_port
from processes import child_env, finish  # tests/processes.py

CACHE_SETTINGS = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
LOADED = int(os.environ.get("CIERA_CACHE_LOADS", "2"))  # fresh loading processes, per case
LOADED_TWO_PROCESS = max(1, LOADED // 2)  # fresh two-process runs that load the step

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

# appended to the README's decorated model: 30 steps, then the params' digest
DECORATED_TAIL = """
    for i in range(26):
        train_step(model, opt, x)
    import numpy as np
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    print("params_sha256=" + hashlib.sha256(
        b"".join(np.asarray(leaf).tobytes() for leaf in leaves)).hexdigest())
"""


def _env(**extra) -> dict:
    """A child's environment without the test session's compilation cache: these tests say
    which runs use one, and where."""
    env = {k: v for k, v in child_env().items() if not k.startswith(CACHE_SETTINGS)}
    return {**env, **extra}


def _python(args, env):
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def _cached_env(cache_dir: Path) -> dict:
    # JAX_LOG_COMPILES: a cache hit is logged (on stderr), naming the program
    return _env(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_LOG_COMPILES="1",
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _sha(p) -> str:
    return re.search(r"params_sha256=(\w+)", p.stdout).group(1)


def _loads_bitwise(args, cache_dir: Path, program: str) -> None:
    """An uncached run, one that writes ``program`` to the cache, then LOADED fresh processes
    (two at a time) that load it: every one ends at the uncached run's params."""
    want = _sha(_python(args, _env()))
    writer = _python(args, _cached_env(cache_dir))
    assert any(program in f.name for f in cache_dir.iterdir()), "the step was not cached"
    assert _sha(writer) == want
    hit = f"Persistent compilation cache hit for '{program}'"
    for _ in range(max(1, LOADED // 2)):
        procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=_cached_env(cache_dir))
                 for _ in range(2)]
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, out[-2000:] + err[-3000:]
            assert hit in err, f"{program} was not loaded from the cache"
            assert re.search(r"params_sha256=(\w+)", out).group(1) == want, \
                "a step loaded from the cache trained differently from one compiled here"


@pytest.mark.slow
def test_every_process_traces_the_same_step():
    hashes = {_python(["-c", LOWERED_HASH], _env(PYTHONHASHSEED=seed)).stdout.split()[-1]
              for seed in ("1", "2", "3")}
    assert len(hashes) == 1, "the step's program depends on the process's string hashing"


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["word", "exponent"])
def test_ciera_train_loads_its_step_from_the_cache_bitwise(cache, tmp_path):
    args = ["-m", "ciera_jax.cli.main", "train", "--config", "tiny", "--cache", cache,
            "--steps", "4", "--schedule-steps", "20"]
    _loads_bitwise(args, tmp_path / "jax_cache", "jit_local_step")


@pytest.mark.slow
def test_the_readme_decorated_model_loads_its_step_from_the_cache_bitwise(tmp_path):
    from test_readme import README, programs

    code = next(c for c in programs(README.read_text()) if "@ciera_jax.gathered" in c)
    script = tmp_path / "decorated.py"
    script.write_text("import hashlib\n" + code + DECORATED_TAIL)
    _loads_bitwise([str(script)], tmp_path / "jax_cache", "jit_train_step")


def _two_processes(env: dict) -> list[str]:
    """A 2-process ``ciera train`` (4 CPU devices each): each process's stderr."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "ciera_jax.cli.main", "train", "--config", "tiny", "--steps", "3",
         "--devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i)], env={**env, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    ended = finish(procs, 900)
    for i, (rc, out, err) in enumerate(ended):
        assert rc == 0, f"process {i} exit {rc}: " + out[-2000:] + err[-3000:]
    return [_sha_of(ended[0][1])] + [err for _, _, err in ended]


def _sha_of(out: str) -> str:
    return re.search(r"params_sha256=(\w+)", out).group(1)


@pytest.mark.slow
def test_two_processes_load_the_step_from_the_cache_bitwise(tmp_path):
    cache_dir = tmp_path / "jax_cache"
    want = _two_processes(_env())[0]
    sha, *_ = _two_processes(_cached_env(cache_dir))
    assert any("jit_local_step" in f.name for f in cache_dir.iterdir()), "the step was not cached"
    assert sha == want
    hit = "Persistent compilation cache hit for 'jit_local_step'"
    for _ in range(LOADED_TWO_PROCESS):
        sha, err0, _ = _two_processes(_cached_env(cache_dir))
        assert hit in err0, "process 0 did not load its step from the cache"
        assert sha == want, "a step loaded from the cache trained differently"

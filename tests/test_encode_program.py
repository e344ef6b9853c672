"""The encode program: compiled once per run, in a thread of its own (``ciera train`` starts
it before it makes the state; else beside the run's first step program), and run after every
step; its compile is reported apart from the step's.

On test_train's trainer (memoized in-process): a copy of it with nothing compiled recompiles
both programs (JAX's in-process cache makes that quick) through the trainer's own path.
"""

import dataclasses
import json
import threading

import jax
import jax.stages

from ciera_models.train import data
from ciera_models.train import loop
from ciera_models.train import state as state_lib
from ciera_models.train import TrainConfig, build_trainer, make_mesh
from conftest import TINY_PROGRAMS

TC = TrainConfig(config="tiny", schedule_steps=20, **TINY_PROGRAMS)


def test_the_encode_program_compiles_in_its_own_thread_beside_the_first_step(monkeypatch):
    # one step program a run: this process's quick recompiles would otherwise price a second
    # one low enough to buy at step 2 or 3 (the rung vector is not what this test is about)
    tr = dataclasses.replace(build_trainer(TC, make_mesh(8)), programs={},
                             encode_program=None, policy=None,
                             tc=dataclasses.replace(TC, max_programs=1))
    threads = []
    compile_ = jax.stages.Lowered.compile

    def spy(self, *a, **kw):
        threads.append(threading.current_thread().name)
        return compile_(self, *a, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    ds = data.load_dataset(None, 256, TC.length)
    state = tr.init_state(0)
    rows = []
    for i in range(3):
        state, m = tr.step(state, tr.batch(ds, 0, i))
        rows.append(m)
    # two compiles, the encode's on its own thread; none after the first step
    assert len(threads) == 2 and sum(t.startswith("ciera-encode") for t in threads) == 1
    first = rows[0]
    assert first["step_compile_s"] > 0 and first["encode_compile_s"] > 0
    assert first["compile_s"] >= first["step_compile_s"]  # and whatever the encode added
    assert all(m["compile_s"] == m["step_compile_s"] == m["encode_compile_s"] == 0
               for m in rows[1:])
    assert isinstance(tr.encode_program, jax.stages.Compiled)
    assert all(int(m["verify_failed"]) == 0 for m in rows)  # each step's Encoded was current


def test_an_encode_at_the_start_from_primed_caches_runs_the_same_program():
    """An ahead made at the start from primed caches (``Trainer.prepare``: the start's word
    counts) and one made after a step run the one compiled encode program, and the step after
    such a start gathers what it encoded (every self-check passes)."""
    tr = dataclasses.replace(build_trainer(TC, make_mesh(8)), programs={},
                             encode_program=None, policy=None)
    ds = data.load_dataset(None, 256, TC.length)
    state, _ = tr.step(tr.init_state(0), tr.batch(ds, 0, 0))  # primes the caches
    program = tr.encode_program
    state = tr.prepare(dataclasses.replace(state, ahead=None))  # encoded from primed caches
    state, m = tr.step(state, tr.batch(ds, 0, 1))
    assert tr.encode_program is program and int(m["verify_failed"]) == 0


def test_ciera_train_starts_the_encode_compile_before_it_makes_the_state(tmp_path, monkeypatch):
    """``ciera train`` starts the encode program's compile before the state is made (so it
    compiles beside that), from the trainer's abstract arguments, whose program then runs on
    the real state; the JSONL header says how long the start-up took."""
    started = []
    init_state = state_lib.Trainer.init_state

    def spy(self, seed):
        started.append(self.encode_program is not None)
        return init_state(self, seed)

    monkeypatch.setattr(state_lib.Trainer, "init_state", spy)
    tc = dataclasses.replace(TC, lr=TC.lr * 0.5)  # a trainer of its own (build_trainer memoizes)
    out = tmp_path / "m.jsonl"
    loop.train(tc, steps=2, mesh=make_mesh(8), metrics_out=str(out))
    assert started == [True]
    header, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert header["header"]["startup_s"] > 0 and header["header"]["startup_cpu_s"] > 0
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["encode_compile_s"] > 0 and all(r["verify_failed"] == 0 for r in rows)

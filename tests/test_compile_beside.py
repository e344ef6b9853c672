"""``--compile-beside``: the first steps run the priming program while the policy's program
compiles in a thread; the run stays bitwise plain, and every process takes a new program at
the same step."""

import threading

import pytest

from ciera_models.train import beside
from ciera_models.train.beside import CompilesBeside
from ciera_models.train.data import load_dataset
from ciera_models.checkpoint.params_hash import params_sha256
from ciera_models.train import TrainConfig, build_trainer, make_mesh
from ciera_jax.codec.wire import PLAIN_RUNG
from ciera_jax.loop.rungs import program_key


def _done(compiles: CompilesBeside) -> None:
    for f in compiles.pending.values():
        f.result()


def test_a_program_is_taken_only_once_every_process_has_compiled_it(monkeypatch):
    compiles = CompilesBeside()
    compiles.start("a", lambda: "program a")
    compiles.start("b", lambda: "program b")
    _done(compiles)
    # another process is still compiling "a" (the first flag agreed on: "still waiting")
    monkeypatch.setattr(beside, "agree", lambda *waiting: (True, *waiting[1:]))
    taken = compiles.take_ready()
    assert list(taken) == ["b"] and taken["b"][0] == "program b" and taken["b"][1] >= 0
    assert "a" in compiles and "b" not in compiles
    monkeypatch.undo()
    assert compiles.take_ready()["a"][0] == "program a"
    assert not compiles.pending and compiles.take_ready() == {}


def test_the_compiles_still_running_are_counted_for_the_run_s_last_line():
    release = threading.Event()
    compiles = CompilesBeside()
    compiles.start("slow", lambda: release.wait(30))
    compiles.start("quick", lambda: "program")
    compiles.pending["quick"].result()
    assert compiles.still_compiling() == 1
    release.set()
    _done(compiles)
    assert compiles.still_compiling() == 0


def test_a_failed_compile_raises_where_it_is_taken():
    compiles = CompilesBeside()

    def broken():
        raise RuntimeError("XLA said no")

    compiles.start("a", broken)
    assert isinstance(compiles.pending["a"].exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="XLA said no"):
        compiles.take_ready()


def test_programs_compile_beside_only_where_asked_or_off_a_cpu():
    mesh = make_mesh(8)
    assert not build_trainer(TrainConfig(config="tiny"), mesh).beside  # auto, on CPUs: off
    assert build_trainer(TrainConfig(config="tiny", compile_beside="on"), mesh).beside


@pytest.mark.slow  # three tiny programs compile: plain's, the priming one, the steady one
def test_the_priming_program_stands_in_until_the_policys_has_compiled_and_all_is_plain(
        monkeypatch):
    steps, mesh = 5, make_mesh(8)
    plain = build_trainer(TrainConfig(config="tiny", gather="plain", schedule_steps=steps), mesh)
    tr = build_trainer(TrainConfig(config="tiny", plan="all", schedule_steps=steps,
                                   compile_beside="on"), mesh)
    data = load_dataset(None, tr.tc.model.vocab_size, tr.tc.length)
    state, reference = tr.init_state(0), plain.init_state(0)
    take_ready = tr.beside_compiles.take_ready
    metrics = []
    for i in range(steps):
        reference, _ = plain.step(reference, plain.batch(data, 0, i))
        if i == 1:  # both compiled here, but not yet on another process (as it agrees)
            _done(tr.beside_compiles)
            monkeypatch.setattr(tr.beside_compiles, "take_ready", dict)
        state, m = tr.step(state, tr.batch(data, 0, i))
        monkeypatch.setattr(tr.beside_compiles, "take_ready", take_ready)
        metrics.append(m)
        # the priming ahead is placed once for the steps that prime beside the encode's
        # compile, and let go of once the encode program is there
        assert (tr.priming_ahead is not None) == (i <= 1), i
    first, second, third = metrics[:3]
    wanted = program_key(tr.policy.first)
    # step 1: the priming program (every gather plain), compiled then; the policy's program
    # and the encode program compile beside
    assert first["stand_in"] and first["step_compile_s"] > 0 and first["program"] == 0
    assert list(tr.programs)[0] == program_key({k: PLAIN_RUNG for k in tr.policy.wires})
    assert all(int(s["fallback"]) for s in first["gather"].values())
    assert first["encode_compile_s"] == 0  # no step waited for the encode program either
    # step 2: nothing taken (another process still compiles), so no encode ran after step 1:
    # the priming program again, waiting for nothing
    assert second["stand_in"] and second["program"] == 0 and second["compile_s"] == 0
    assert all(int(s["fallback"]) for s in second["gather"].values())
    # step 3 takes both (waited for by no step), encodes, and runs the policy's program; its
    # compile prices the policy's next one (the stand-in's does not)
    assert third["beside_compile_s"] > 0 and third["encode_compile_s"] > 0
    assert not third["stand_in"] and third["program"] == 1
    assert third["step_compile_s"] == third["compile_s"] == 0
    assert list(tr.programs)[1] == wanted and not tr.beside_compiles.pending
    assert tr.policy.compile_s == [pytest.approx(third["beside_compile_s"])]
    assert all(int(m["verify_failed"]) == 0 for m in metrics)
    assert sum(int(s["sent_bytes"]) for s in metrics[-1]["gather"].values()) < sum(
        int(s["plain_bytes"]) for s in metrics[-1]["gather"].values())  # compressed by the last step
    assert params_sha256(state.params) == params_sha256(reference.params)


def test_the_summary_counts_the_stand_in_steps_and_the_programs_compiled_beside():
    from ciera_models.train import metrics

    def row(step, **kw):
        return {"step": step, "loss": 1.0, "sent_bytes": 10, "plain_bytes": 10,
                "step_time_s": 0.1, "exp_changed_frac": 0.0, "fallbacks": 0, "priming": False,
                "compile_s": 0.0, "step_compile_s": 0.0, "beside_compile_s": 0.0,
                "stand_in": False, **kw}

    history = [row(1, compile_s=2.0, step_compile_s=2.0, stand_in=True, priming=True),
               row(2, stand_in=True), row(3, beside_compile_s=5.0)]
    history = [{**r, "rungs": {"3": 2}, "fallbacks": 2 if r["stand_in"] else 0}
               for r in history]
    text = metrics.summarize(history, TrainConfig(config="tiny"), "ciera")
    assert ("compiles: 2.0 s waited; the train step compiled 2 times (7.0 s)" in text
            and "; 2 steps ran an already compiled step while theirs compiled" in text)
    assert ("sent plainly: 4 of 6 gathers of a compressed tensor-layer: 2 filling the caches "
            "(the first step); 2 on steps that ran an already compiled step while their own "
            "compiled") in text
    text = metrics.summarize(history, TrainConfig(config="tiny"), "ciera", verbose=True)
    assert "programs: 2 compiled in this run (7.0 s; recompiles 1)" in text
    assert ": 2.0 s waited for compiles (2 steps ran a compiled stand-in" in text


def test_a_cache_fault_drill_asks_for_steps_that_wait_for_their_program():
    """A fault drilled at a step that gathers plainly (a stand-in) would be overwritten unseen."""
    from ciera_models.train import train

    with pytest.raises(ValueError, match="pass --compile-beside off"):
        train(TrainConfig(config="tiny", compile_beside="on"), steps=3, seed=0,
              mesh=make_mesh(8), log=None, inject_cache_fault="2")

"""``--inject-crash STEP[:PROCESS]``: the drill of a crash on one process (the 2-process run is
in test_lost_peer.py): its format, its checks, and the step it raises before."""

import pytest

from ciera_models.resilience import crash_drill
from ciera_models.resilience.crash_drill import CrashDrill, InjectedCrash
from ciera_models.resilience.failures import raised_by_all, raised_everywhere
from ciera_models.train import TrainConfig, make_mesh, train
from conftest import TINY_PROGRAMS


@pytest.mark.parametrize("text, drill", [("5", CrashDrill(5, 0)), ("5:1", CrashDrill(5, 1)),
                                         ("", None), (None, None)])
def test_the_format(text, drill):
    assert crash_drill.parse_crash(text) == drill


@pytest.mark.parametrize("text", ["x", "5:", "5:1:2", "1.5", "0", "3:-1"])
def test_a_bad_format_is_refused(text):
    with pytest.raises(ValueError, match=r"--inject-crash"):
        crash_drill.parse_crash(text)


def test_the_step_must_be_trained_and_the_process_must_exist():
    crash_drill.check_crash(CrashDrill(11, 1), steps=20, start=10, processes=2)
    with pytest.raises(ValueError, match=r"step 10 is not trained by this run; pick a step from "
                                         r"11 to 20"):
        crash_drill.check_crash(CrashDrill(10), steps=20, start=10, processes=2)
    with pytest.raises(ValueError, match=r"process 2 is not among the 2 process"):
        crash_drill.check_crash(CrashDrill(12, 2), steps=20, start=10, processes=2)


def test_only_the_drill_process_raises_and_only_before_its_step():
    drill = CrashDrill(3, 1)
    for step, process in [(2, 1), (4, 1), (3, 0)]:
        crash_drill.crash_if_due(drill, step, process)
    with pytest.raises(InjectedCrash, match=r"before step 3 on process 1$"):
        crash_drill.crash_if_due(drill, 3, 1)


def test_a_run_raises_before_the_step_and_not_as_everywhere():
    """Steps 1 and 2 run, step 3 does not; the error is not marked as raised everywhere (so a
    multi-process run ends this process alone, at once)."""
    lines = []
    tc = TrainConfig(config="tiny", schedule_steps=20, gather="plain", **TINY_PROGRAMS)
    with pytest.raises(InjectedCrash, match=r"before step 3 on process 0") as e:
        train(tc, steps=5, seed=0, mesh=make_mesh(8), log=lines.append, log_every=1,
              inject_crash="3")
    assert not raised_everywhere(e.value)
    steps = [line for line in lines if "] step " in line]
    assert len(steps) == 2 and "step    2/5" in steps[-1], lines


def test_what_every_process_raises_alike_is_marked():
    """Checks of what every process holds alike (``raised_by_all``) end a multi-process run
    through JAX's shutdown on every process; anything else ends one process at once."""
    with pytest.raises(ValueError) as e:
        with raised_by_all():
            raise ValueError("the arguments")
    assert raised_everywhere(e.value)
    assert not raised_everywhere(ValueError("a file on one host"))

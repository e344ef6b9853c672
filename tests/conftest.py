"""Eight emulated CPU devices for every test; must run before JAX is imported.

Also what the suite shares to stay fast on 2 cores: one 20-step ``tiny`` training per gather
mode for the whole session (``tiny_run``), and the tests that drop JAX's compiled functions
(``jax.clear_caches()``) run last, so that the steps compiled before them are not compiled again;
under ``-n``, the files that use ``tiny_run`` run on one worker (``xdist_group``), each other
file runs whole on one worker, and the groups likely to take longest start first.
"""

import functools
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are small: XLA spends its time compiling them, not running them, so LLVM
# compiles them without its costly optimisations (same arithmetic: no fast-math either way).
# The flags reach the tests' child processes too (tests/processes.child_env).
COMPILE_FAST = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "").split()
# the count last, whatever count a test's run set before (the last flag of a name wins)
_flags += [f for f in COMPILE_FAST if f.split("=")[0] not in " ".join(_flags)]
if "--xla_force_host_platform_device_count=8" not in _flags[-1:]:
    _flags.append("--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] = " ".join(_flags)

# JAX's persistent compilation cache serves the child processes alone, one folder for the whole
# run (every xdist worker's children), every program however short its compile: the drills'
# ``ciera train`` processes run few distinct programs, so each compiles once and later children
# load it (a loaded step trains bitwise: tests/test_compilation_cache.py). Of a two-process
# run only process 0 gains (only it writes, and the other's key names its own devices). The
# pytest processes compile fresh: one that loaded many programs aborted now and then
# (docs/training.md). JAX reads the variables at import, so they are set for the children
# only after.
CHILD_CACHE = "CIERA_TESTS_JAX_CACHE"
_owns_child_cache = CHILD_CACHE not in os.environ  # the controller, or a run without -n
if _owns_child_cache:
    os.environ[CHILD_CACHE] = tempfile.mkdtemp(prefix="ciera-tests-jax-cache-")
for _setting in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
    os.environ.pop(_setting, None)

import jax  # noqa: E402

from ciera_models.resilience import watchdog  # noqa: E402

os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[CHILD_CACHE]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# Start the backend now, with 8 devices, so that no test (e.g. a CLI run with --devices 4)
# can re-flag XLA for the rest of the session.
assert len(jax.devices()) >= 8, jax.devices()

TINY_STEPS = 20  # ``ciera train --config tiny --schedule-steps 20``: test_train's runs
# ... with ``--program-patience 2e-5``: a compile priced like about one plain step's bytes (as
# on a slow link), so the 20-step run buys programs as the warm-up's demand rises (3 of them)
# and trains through program switches, fallbacks and compressed steps. With the defaults the
# emulated CPU link never pays for a second program, and the run's first one (rungs for the
# steady state) overflows to plain gathers through most of a 20-step warm-up.
TINY_PROGRAMS = {"program_patience": 2e-5}

# Files whose tests call jax.clear_caches(): everything compiled earlier in the session (the
# shared trainers, the gather harness) would compile again after them.
CLEARS_CACHES = ("test_no_deprecations.py",)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns -n's "no" into "load"
def pytest_cmdline_main(config):
    """With ``-n`` and no ``--dist``: tests marked ``xdist_group`` run on one worker (the files
    grouped below), handed out in the order they are put in (heaviest first), not re-sorted by
    their number of tests. Set here, not in the addopts, so that ``-p no:xdist`` runs too. A
    worker reads its own command line (no ``--dist``), so the controller tells it
    (:func:`pytest_configure_node`).

    A worker that dies (a native crash, an exit inside a test) is not replaced unless
    ``--max-worker-restart`` says so: xdist's group scheduling puts the crashed test back in
    its group and hands it on, so it crashes each replacement in turn, and a replacement can
    be left waiting for work that never comes (the run hangs). Not replaced, the crash is one
    failed test and the run ends once the other worker's tests in hand are done
    (tests/test_suite_runner.py)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(config, "workerinput", {}).get(GROUPED):
        config.option.loadgroup = True  # what xdist's worker makes of --dist loadgroup
    elif config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False
        if config.option.maxworkerrestart is None:
            config.option.maxworkerrestart = "0"


GROUPED = "ciera_grouped"  # in a worker's input: the controller chose loadgroup


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Controller(), "ciera-controller")
    else:  # the groups' mark, which xdist declares
        config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker")


class _Controller:
    @staticmethod
    def pytest_configure_node(node):
        node.workerinput[GROUPED] = node.config.option.dist == "loadgroup"


def pytest_unconfigure(config):
    if _owns_child_cache:
        shutil.rmtree(os.environ[CHILD_CACHE], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    last = {i.path for i in items if i.path.name in CLEARS_CACHES}
    # Under ``-n`` (``--dist loadgroup``: pytest_cmdline_main) every file that trains
    # ``tiny_run``'s config runs on one worker: its step compiles and its 20-step runs train
    # once, not once per worker (each worker is a process of its own; the files also train
    # TC beside it).
    shared = {i.path for i in items if "tiny_run" in getattr(i, "fixturenames", ())}
    for i in items:
        if i.path in shared:
            i.add_marker(pytest.mark.xdist_group("tiny_run"))
        elif not any(True for _ in i.iter_markers("xdist_group")):
            # every other file on one worker too: the programs its tests share (module-level
            # caches, its parametrized cases' common runs) compile once, not once per worker
            i.add_marker(pytest.mark.xdist_group(i.path.stem))
    items[:] = _heaviest_groups_first(items, last)


def _heaviest_groups_first(items, last):
    """``items`` with the groups most likely to take longest first (a slow test weighs thirty
    others): xdist hands the groups out in this order as workers free up, so the long ones
    start at once and the short ones even the workers out at the end. ``last``'s files stay
    last."""
    group = {i: next(i.iter_markers("xdist_group")).args[0] for i in items}
    weight: dict = {}
    for i in items:
        weight[group[i]] = weight.get(group[i], 0) + (30 if i.get_closest_marker("slow") else 1)
    return sorted(items, key=lambda i: (i.path in last, -weight[group[i]], group[i]))


@pytest.fixture(autouse=True)
def _no_watch_left_behind():
    """A ``ciera train`` run inside the test process stops its watchdog however it ends: one
    left running would end this worker ``--hang-timeout`` seconds later, in another test."""
    yield
    assert not watchdog.watching(), "a run left its watchdog running"


@pytest.fixture(scope="session")
def tiny_run():
    """``tiny_run(gather)``: the RunResult of 20 steps of ``TrainConfig(config="tiny",
    schedule_steps=20, gather=gather, **TINY_PROGRAMS)`` from seed 0 on 8 devices, trained
    once per session (the ``ciera`` one is the straight run every resume test ends bitwise on)."""
    from ciera_models.train import TrainConfig, make_mesh, train

    @functools.cache
    def run(gather: str = "ciera"):
        tc = TrainConfig(config="tiny", schedule_steps=TINY_STEPS, gather=gather,
                         **TINY_PROGRAMS)
        return train(tc, steps=TINY_STEPS, seed=0, mesh=make_mesh(8), log=None)

    return run

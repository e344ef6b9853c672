"""Every way out of ``ciera train`` leaves none of orbax's background work running: the
checkpoint manager's clean-up of earlier temporary folders is waited for, and a manager whose
save failed is still shut whole. A process that exited beside such a thread printed a
traceback after its last line (``cannot schedule new futures after shutdown``) or, under
load, died of a bus error.

The slow test repeats the refusals and a signal, each with another training run beside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ciera_models.checkpoint import close as checkpoint_close

REPEATS = 2  # 20 and more: benchmarks/reliability_drill.py --repeats 20 --load
NOISE = ("Traceback", "never retrieved", "cannot schedule new futures", "Error in atexit")


class _Part:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def close(self):
        self.log.append(self.name)


class _FailedManager:
    """A CheckpointManager after a failed save: close() raises that failure again first."""

    def __init__(self):
        self.log: list[str] = []
        self._checkpointer = _Part(self.log, "checkpointer")
        self._non_blocking_metadata_store = _Part(self.log, "non-blocking store")
        self._blocking_metadata_store = _Part(self.log, "blocking store")
        self._checkpoint_deleter = _Part(self.log, "deleter")

    def _maybe_await_cleanup_tmp_directory(self):
        self.log.append("cleanup waited")

    def close(self):
        raise OSError(28, "No space left on device")


def test_a_manager_whose_save_failed_is_shut_whole():
    mgr = _FailedManager()
    checkpoint_close.close(mgr)  # raises nothing: the failure was reported already
    assert mgr.log == ["cleanup waited", "checkpointer", "non-blocking store",
                       "blocking store", "deleter"]


def _train(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "ciera_jax.cli.main", "train", "--config",
                             "tiny", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _clean(p, out, err, rc):
    assert p.returncode == rc, f"exit {p.returncode} (want {rc}): " + err[-3000:]
    assert not any(n in out + err for n in NOISE), err[-3000:]


@pytest.mark.slow
def test_refusals_and_a_signal_end_with_orbax_idle_under_load(tmp_path):
    saved = tmp_path / "saved"
    made = _train("--steps", "5", "--checkpoint-dir", str(saved), "--checkpoint-every", "5")
    _clean(made, *made.communicate(timeout=600), 0)
    beside = _train("--steps", "100000")  # the load: another training run
    try:
        for i in range(REPEATS):
            for flag in (["--seed", "1"], ["--config", "small"], ["--gather", "plain"]):
                ck = tmp_path / f"ck{i}{flag[0]}"
                subprocess.run(["cp", "-r", str(saved), str(ck)], check=True)
                p = _train("--steps", "8", "--checkpoint-dir", str(ck), "--resume", *flag)
                out, err = p.communicate(timeout=600)
                _clean(p, out, err, 2)
                assert len(err.strip().splitlines()) == 1, err
            ck = tmp_path / f"sig{i}"
            p = _train("--steps", "100000", "--checkpoint-dir", str(ck),
                       "--checkpoint-every", "3")
            deadline = time.monotonic() + 600
            while not (ck / "3").is_dir() and time.monotonic() < deadline:
                time.sleep(0.2)
            p.send_signal(signal.SIGTERM)
            _clean(p, *p.communicate(timeout=600), 75)
    finally:
        beside.kill()
        beside.communicate()


def test_abandoned_write_fragments_of_a_failed_save_say_nothing(caplog):
    import asyncio
    import gc
    import logging

    checkpoint_close.hush_abandoned_futures()
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    fut.set_exception(OSError(28, "No space left on device"))
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        del fut
        gc.collect()
    loop.close()
    assert "never retrieved" not in caplog.text

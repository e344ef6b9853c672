"""Stopping a run cleanly: SIGTERM (what a cluster scheduler sends before it preempts a job)
and SIGINT (Ctrl-C) ask the loop to finish the current step, save, and exit with
:data:`EXIT_PREEMPTED`; a second signal exits at once.

With several processes every one must stop (and save: a save is collective) after the same
step, even when only one was signalled, so :func:`agree` takes the max of the per-process
flags each step.
"""

from __future__ import annotations

import signal
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from ciera_models.resilience import peers

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later" -- rerun (with --resume if it saved)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """While active, the first SIGTERM/SIGINT sets :attr:`signal_name`; the second one ends the
    process at once with ``128 + signum`` (the last finished checkpoint stays the latest)."""

    def __init__(self, log=print, saves: bool = True):
        self.signal_name: str | None = None
        self._log = log
        self._saves = saves  # False: no --checkpoint-dir, so a stop saves nothing
        self._previous: dict = {}

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():  # signals need it
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            peers.last_words(128 + signum, lambda: print(
                f"ciera train: second signal ({name}): exiting now without saving",
                file=sys.stderr))
        self.signal_name = name
        self._log(f"{name} received: finishing this step, then "
                  + ("saving and exiting" if self._saves else
                     "exiting (nothing will be saved: no --checkpoint-dir)")
                  + " (send it again to exit at once)")


def agree(*flags: bool) -> tuple[bool, ...]:
    """Each flag true on any process, the same answer on every process (a tiny host-side
    all-gather when there are several, nothing otherwise)."""
    if jax.process_count() == 1:
        return tuple(bool(f) for f in flags)
    got = multihost_utils.process_allgather(np.asarray(flags, np.int32))
    return tuple(bool(v) for v in np.asarray(got).reshape(-1, len(flags)).max(axis=0))


def agree_steps(steps: list[int]) -> list[int]:
    """Every step any process lists, sorted, the same on every process (one process: as is)."""
    if jax.process_count() == 1:
        return sorted(steps)
    longest = int(np.asarray(multihost_utils.process_allgather(
        np.asarray(len(steps), np.int64))).max())
    if not longest:
        return []
    padded = np.full(longest, -1, np.int64)
    padded[: len(steps)] = steps
    got = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1)
    return sorted({int(s) for s in got if s >= 0})

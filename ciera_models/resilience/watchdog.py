"""A run that stops moving ends in one line (``--hang-timeout``), not in a hang until killed.

A process can get stuck while alive: a collective whose peer never arrives, a checkpoint read
that never returns, a deadlock inside a library. Its heartbeat keeps flowing, so the peer
watcher (:mod:`ciera_models.resilience.peers`) sees nothing wrong, and every other process waits for it in
its next collective. So the loop marks its progress (:func:`mark`: each step, the agreement
after it, each phase of a checkpoint's check, a save it waits for), and a thread watches the
marks. When no process has marked anything for ``--hang-timeout`` seconds and none is
compiling (a compile marks nothing for minutes at scale: :func:`compiling`; for at most
:attr:`Watch.compile_limit_s`), every process writes each thread's stack to its log, prints
one line that says where each process was and what to restart from, and ends with
:data:`~ciera_models.resilience.failures.EXIT_HUNG` (70).

In a multi-process run each process's mark travels with its heartbeat in the coordination
service's key-value store (the peer watcher's one thread sends and reads both:
:func:`ciera_models.resilience.peers.publish_with_beats`), and each reads the others': a process waiting in a
collective for a peer that is still compiling does not give up, and the line names the process
that stopped (say ``process 1 before step 3``) next to the ones waiting for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
import traceback
from typing import NoReturn

from ciera_models.resilience import peers
from ciera_models.resilience.failures import EXIT_HUNG

DEFAULT_TIMEOUT_S = 1800  # torch.distributed's default_pg_timeout: far longer than a step
# A compile holds every process off for this many timeouts, and at least an hour (a GPU
# compile at scale takes minutes, whatever a step takes): longer, it is stuck too.
COMPILE_TIMEOUTS, COMPILE_FLOOR_S = 4, 3600.0
EXIT_GRACE_S = 3.0  # process 0 hosts the coordination service: the others print first

_lock = threading.Lock()
_mark = {"count": 0, "where": "starting", "compiling": 0}
_stopped = threading.Event()  # the running watch's own: a later start never revives an old one
_stopped.set()  # none runs yet


def mark(where: str) -> None:
    """This process moved on, and is now ``where`` (``"in step 3"``): what the line says if it
    stops there."""
    with _lock:
        _mark["count"] += 1
        _mark["where"] = where


@contextlib.contextmanager
def compiling():
    """A compile runs (in any thread): no process gives up while one compiles anywhere (up
    to :attr:`Watch.compile_limit_s`)."""
    with _lock:
        _mark["compiling"] += 1
        _mark["count"] += 1
    try:
        yield
    finally:
        with _lock:
            _mark["compiling"] -= 1
            _mark["count"] += 1


def own() -> str:
    """This process's mark as published: ``count|compiling|where``."""
    with _lock:
        return f"{_mark['count']}|{int(_mark['compiling'] > 0)}|{_mark['where']}"


@dataclasses.dataclass
class Seen:
    value: str | None  # the mark as published (None: not yet)
    since: float  # when it last changed, on this process's clock

    @property
    def compiling(self) -> bool:
        return self.value is not None and self.value.split("|")[1] == "1"

    @property
    def where(self) -> str:
        return self.value.split("|", 2)[2] if self.value else "not started"


class Watch:
    """Every process's mark as this process last saw it, and whether the run is stuck."""

    def __init__(self, num_processes: int, timeout_s: float, now: float):
        self.timeout_s = timeout_s
        self.seen = [Seen(None, now) for _ in range(num_processes)]

    def update(self, process: int, value: str | None, now: float) -> None:
        if value is not None and value != self.seen[process].value:
            self.seen[process] = Seen(value, now)

    @property
    def compile_limit_s(self) -> float:
        return max(COMPILE_TIMEOUTS * self.timeout_s, COMPILE_FLOOR_S)

    def stuck(self, now: float) -> bool:
        """No process marked anything for the timeout, and none is compiling (for less than
        :attr:`compile_limit_s`: a compile that long is a hang too)."""
        return all(now - s.since >= (self.compile_limit_s if s.compiling else self.timeout_s)
                   for s in self.seen)

    def where(self) -> str:
        """Where each process last said it was (``process 1 before step 3, ...``)."""
        wheres = [s.where + (", compiling" if s.compiling else "") for s in self.seen]
        if len(wheres) == 1:
            return wheres[0]
        return ", ".join(f"process {i} {w}" for i, w in enumerate(wheres))


def stuck_line(process_id: int, watch: Watch, advice: str, stacks: str) -> str:
    """The one line each process prints (``advice``: :func:`ciera_models.resilience.peers.restart_advice`)."""
    who = f" (process {process_id})" if len(watch.seen) > 1 else ""
    if any(s.compiling for s in watch.seen):  # held off until the compile's limit
        waited = (f"{watch.compile_limit_s:g} s (a compile's limit: {COMPILE_TIMEOUTS} x "
                  f"--hang-timeout, at least {COMPILE_FLOOR_S:g} s)")
    else:
        waited = f"{watch.timeout_s:g} s (--hang-timeout)"
    return (f"ciera train{who}: no progress for {waited}: {watch.where()}; stopped; {advice}; "
            f"the stacks of every thread: {stacks}")


def start(timeout_s: float, process_id: int = 0, num_processes: int = 1,
          log: str | None = None) -> None:
    """Watch from a daemon thread (``timeout_s`` 0: not at all). Several processes: the marks
    travel with the peer watcher's beats (:func:`ciera_models.resilience.peers.publish_with_beats`);
    ``log``: where the stacks go (the supervisor's log of this process), else stderr, above
    the line."""
    global _stopped
    if not timeout_s:
        return
    stop()
    _stopped = threading.Event()
    if num_processes > 1:
        peers.publish_with_beats(own)
    threading.Thread(target=_watch, args=(timeout_s, process_id, num_processes, log, _stopped),
                     name="ciera-watchdog", daemon=True).start()


def stop() -> None:
    """The run is over (returned or raised): processes now leave one by one; that is not a
    hang. A run inside a longer-lived process (a test, a notebook) must not leave its watch
    behind to end that process later."""
    _stopped.set()


def watching() -> bool:
    """Whether a watch runs (started and not stopped)."""
    return not _stopped.is_set()


def _watch(timeout_s, process_id, num_processes, log, stopped: threading.Event) -> None:
    watch = Watch(num_processes, timeout_s, time.monotonic())
    while not stopped.wait(1.0):
        now = time.monotonic()
        look(watch, process_id, now)
        if watch.stuck(now) and not stopped.is_set():
            _end(process_id, watch, log)


def look(watch: Watch, process_id: int, now: float) -> None:
    """One round's look at every process's mark: this process's own, the others' as their last
    beats carried them (:func:`ciera_models.resilience.peers.marks`; with the coordination service gone,
    the peer watcher's case, they stand still until it ends the process)."""
    watch.update(process_id, own(), now)
    if len(watch.seen) > 1:
        for i, theirs in peers.marks().items():
            if i != process_id and 0 <= i < len(watch.seen):
                watch.update(i, theirs, now)


def _end(process_id: int, watch: Watch, log: str | None) -> NoReturn:
    def say():
        stacks = _write_stacks(log)
        print(stuck_line(process_id, watch, peers.restart_advice(len(watch.seen)), stacks),
              file=sys.stderr, flush=True)
        if process_id == 0 and len(watch.seen) > 1:
            time.sleep(EXIT_GRACE_S)

    peers.last_words(EXIT_HUNG, say, EXIT_GRACE_S)  # the peer watcher may be saying its own


def _write_stacks(log: str | None) -> str:
    """Every thread's stack into ``log`` (appended), else to stderr; where they went. Formatted
    here, not by ``faulthandler``: its write holds the GIL, so a stderr pipe nobody drains
    would also stop the thread armed to end the process."""
    text = "--- the watchdog: every thread's stack ---\n" + _stacks()
    if log:
        try:
            with open(log, "a") as f:
                f.write(text)
            return f"in {log}"
        except OSError:
            pass
    sys.stderr.write(text)
    return "above"


def _stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return "".join(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                   + "".join(traceback.format_stack(frame))
                   for ident, frame in sys._current_frames().items())

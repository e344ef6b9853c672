"""A lost process is one line: joining the process group with a bounded wait, and ending every
survivor with one line and :data:`~models.failures.EXIT_PEER_LOST` (69) when a peer dies or
stops answering.

Two things happen when a peer dies mid-run. The survivors' next collective fails at once (gloo:
"Connection reset by peer"), a Python exception that does not say which process died. Then
JAX's coordination service misses the dead process's heartbeats for ``heartbeat_timeout``
seconds and tells every client, whose reaction is a C++ ``LOG(FATAL)``: a 100-line abort dump.
(The client takes a ``missed_heartbeat_callback`` in its place, but calling a Python one
aborts too: its ``absl::Status`` argument has no Python conversion, ``std::bad_cast``.)

So the processes keep a heartbeat of their own, in the coordination service's key-value store:
a thread in each process bumps ``ciera/beat/<id>`` every second and reads every beat in one
call; the watchdog's progress mark travels in the same value (:func:`publish_with_beats`), so
the service answers two calls a second per process, not four. A peer whose beat stands still
for half of ``--peer-timeout`` is lost; a coordinator that stops answering is lost process 0.
The watcher prints one line (which process, the last step, the newest checkpoint complete on
disk, a save that was in flight) and ends the process with ``os._exit``, before JAX's own
timeout (the full ``--peer-timeout``) would abort it. A collective that fails in the step
(:func:`lost_peer`) waits for that line. A peer that never starts: ``initialization_timeout``
bounds the join. A peer that stops while alive (its beats go on) is the watchdog's
(:mod:`ciera_models.resilience.watchdog`, ``--hang-timeout``).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn

from ciera_models.resilience.failures import EXIT_PEER_LOST, PeerLost

DEFAULT_TIMEOUT_S = 60
BEATS = "ciera/beat/"  # + the process id: its heartbeat, in the coordination service
# set by the training loop: the last finished step, the checkpoint folder and (under the
# supervisor) the full log's path, for the line
progress: dict = {"step": None, "checkpoint_dir": None, "log": None}
_said = threading.Lock()  # taken by the path that says the process's last words
# what travels with this process's beat (the watchdog's mark), and every process's, as last read
_beside: dict = {"mark": lambda: "", "marks": {}}
WRITE_LIMIT_S = 20.0  # how long an ending process's last writes may take


def newest_checkpoint(directory: str | None) -> int | None:
    """The newest step folder in ``directory``: the newest checkpoint complete on disk (orbax
    renames a step into place only when every process has written it; a plain listing, safe
    from any thread)."""
    return max(_steps(directory, lambda name: name.isdigit()), default=None)


def unfinished_checkpoint(directory: str | None) -> int | None:
    """The newest step whose save was started but is not in place (orbax's temporary folder,
    ``<step>.orbax-checkpoint-tmp-*``): a save in flight when the run ended."""
    return max(_steps(directory, lambda name: ".orbax-checkpoint-tmp" in name), default=None)


def _steps(directory: str | None, kind) -> list[int]:
    if not directory:
        return []
    try:
        return [int(p.name.split(".")[0]) for p in Path(directory).iterdir()
                if kind(p.name) and p.name.split(".")[0].isdigit() and p.is_dir()]
    except OSError:
        return []


def lost_tasks(text: str) -> list[int]:
    """The process ids a coordination-service error names as gone."""
    m = re.search(r"unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+)", text)
    if m:
        return sorted({int(x) for x in re.findall(r"\d+", m.group(1))})
    return sorted({int(x) for x in re.findall(r"[Tt]ask (\d+) heartbeat timeout", text)})


def lost_line(process_id: int, num_processes: int, text: str,
              beating_s: int | None = None) -> str:
    """The one line a survivor prints (``text``: what JAX or gloo said). ``beating_s``: a
    collective failed and every peer still beat that many seconds later; say so, with the
    collective's error, instead of blaming a loss nobody saw."""
    step, log = progress.get("step"), progress.get("log")
    when = f" after step {step}" if step is not None else " before training started"
    tasks = [t for t in lost_tasks(text) if t != process_id]
    if tasks:
        what = f"lost process {', '.join(map(str, tasks))} of {num_processes}{when}"
    elif beating_s is not None:  # the coordinator answered all along: it is not gone
        what = (f"a collective failed{when}, and all {num_processes} processes still beat "
                f"{beating_s} s later ({_first_line(text)})")
    elif process_id != 0 and coordinator_gone(text):
        what = f"lost process 0 (the coordinator) of {num_processes}{when}"
    else:
        what = f"lost a peer process of {num_processes}{when}"
    return (f"ciera train (process {process_id}): {what}; {restart_advice(num_processes)}"
            + (f"; full log: {log}" if log else ""))


def _first_line(text: str, limit: int = 200) -> str:
    line = (text.strip().splitlines() or ["no message"])[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def restart_advice(num_processes: int) -> str:
    """What to restart from: the newest checkpoint complete on disk (and a save that did not
    finish), or that nothing was saved."""
    ck = progress.get("checkpoint_dir")
    newest, saving = newest_checkpoint(ck), unfinished_checkpoint(ck)
    unfinished = (f" (the save of step {saving} did not finish)"
                  if saving is not None and (newest is None or saving > newest) else "")
    if num_processes == 1:
        every = every_n = "the run"
    else:
        every, every_n = "all processes", f"all {num_processes} processes"
    if newest is not None:
        return (f"the newest complete checkpoint is step {newest} in {ck}{unfinished}: restart "
                f"{every_n} with --resume")
    if ck:
        return f"no checkpoint was saved{unfinished}: restart {every}"
    return f"nothing was saved (no --checkpoint-dir): restart {every}"


def coordinator_gone(text: str) -> bool:
    """Whether ``text`` (the watcher's error, or a client's abort) says the coordination
    service itself stopped answering: process 0, which hosts it, is gone."""
    return bool(re.search(r"coordination service unavailable|UNAVAILABLE|Socket closed|"
                          r"grpc_status:14", text))


def exit_within(code: int, extra_s: float = 0.0) -> None:
    """Arm an exit with ``code`` :data:`WRITE_LIMIT_S` (+ ``extra_s``) from now, whatever this
    thread is then doing: the last line's write blocks forever on a stderr pipe that nobody
    drains (a full pipe stalled a 2-process test once), and an ending process must not hang."""
    timer = threading.Timer(WRITE_LIMIT_S + extra_s, os._exit, (code,))
    timer.daemon = True
    timer.start()


def last_words(code: int, say: Callable[[], object], extra_s: float = 0.0) -> NoReturn:
    """End this process with ``code`` once ``say()`` has written its last words, within
    :data:`WRITE_LIMIT_S` (+ ``extra_s``) whatever the writes do (:func:`exit_within`), and
    without JAX's exit-time shutdown (it waits for every process at a barrier). The paths that
    end a process race (the peer watcher, the watchdog, a failed step): the first says its
    words, and any other waits here for the end it armed."""
    if not _said.acquire(blocking=False):
        threading.Event().wait()  # the path saying its words ends the process
    exit_within(code, extra_s)
    try:
        sys.stdout.flush()
        say()
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not keep the process alive
        pass
    os._exit(code)


def _say_and_exit(process_id: int, num_processes: int, text: str,
                  beating_s: int | None = None) -> NoReturn:
    last_words(EXIT_PEER_LOST, lambda: print(
        lost_line(process_id, num_processes, text, beating_s), file=sys.stderr))


def end_alone(code: int, say: Callable[[], object] = lambda: None) -> NoReturn:
    """End this process now, after ``say()`` (:func:`last_words`): for a failure the other
    processes did not share (a bug here, a write that failed on this host). JAX's exit-time
    shutdown waits for every process at a barrier, while the others wait for this one in their
    next collective, and the watcher's beats keep flowing until then: a hang. Gone, this process
    is a lost peer to the others, each ending in one line (exit 69)."""
    last_words(code, say)


def initialize(coordinator: str, num_processes: int, process_id: int,
               timeout_s: int = DEFAULT_TIMEOUT_S) -> None:
    """``jax.distributed.initialize`` with every wait bounded by ``timeout_s``: joining (a peer
    that never starts: :class:`~models.failures.PeerLost`) and the heartbeats (a peer that
    dies: one line and exit 69, from the watcher thread)."""
    import jax
    from jax._src import distributed

    joined = threading.Event()

    def give_up():  # JAX's own timeout (set a little later) ends in a C++ abort: beat it
        if not joined.wait(timeout_s):
            _never_joined(process_id, num_processes, coordinator, timeout_s)

    threading.Thread(target=give_up, name="ciera-join-timeout", daemon=True).start()
    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s + 10,
                                   heartbeat_timeout_seconds=timeout_s)
    except Exception as e:  # noqa: BLE001 - the client's connect: DEADLINE_EXCEEDED and kin
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PeerLost(
            f"process {process_id} of {num_processes} could not join the process group at "
            f"{coordinator} ({first}); start every process (same --coordinator and "
            "--num-processes, each its own --process-id)") from None
    joined.set()
    client = distributed.global_state.client
    threading.Thread(target=_watch, args=(client, process_id, num_processes, timeout_s),
                     name="ciera-peer-watch", daemon=True).start()


def _never_joined(process_id: int, num_processes: int, coordinator: str,
                  timeout_s: int) -> NoReturn:
    last_words(EXIT_PEER_LOST, lambda: print(
        f"ciera train (process {process_id}): the process group at {coordinator} did not "
        f"form within --peer-timeout {timeout_s}s (not every one of the {num_processes} "
        "processes started, or they disagree on --coordinator / --num-processes); nothing "
        "was trained", file=sys.stderr))


BARRIER_TIMEOUT_S = 6 * 3600  # a compile on one process, while the others wait for it
_barriers = itertools.count()


def all_arrived(what: str) -> None:
    """Wait until every process has come here (the coordination service's barrier; every
    process calls this the same number of times, so the n-th call of each meets the others'
    n-th). Before a collective that follows work of uneven length: gloo gives up on a peer that
    comes later than its own fixed timeout, the barrier waits as long as a compile takes, and a
    peer that dies meanwhile is the beat watcher's to report."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:  # one process
        return
    client.wait_at_barrier(f"ciera/{what}/{next(_barriers)}", BARRIER_TIMEOUT_S * 1000)


def publish_with_beats(mark: Callable[[], str]) -> None:
    """Send ``mark()`` with each of this process's beats (the watchdog's progress mark): one
    thread talks to the coordination service for both."""
    _beside["mark"] = mark


def marks() -> dict[int, str]:
    """Every process's mark (:func:`publish_with_beats`) as the last beats read carried them
    (``{process: mark}``; a process not read yet is absent)."""
    return dict(_beside["marks"])


def beat_value(beat: int, mark: str) -> str:
    """A beat as published: the counter (it changes every second) and the mark after it."""
    return f"{beat}|{mark}"


def marks_of(beats: dict) -> dict[int, str]:
    """``{process: mark}`` from the beats read (``{key: value}``, :func:`beat_value`'s)."""
    return {int(key.rsplit("/", 1)[-1]): value.split("|", 1)[1]
            for key, value in beats.items() if "|" in value}


def stop_watching() -> None:
    """The run is over: processes now leave one by one; that is not a loss."""
    _stopped.set()


_stopped = threading.Event()


ROUND_CREDIT_S = 2.0  # the most one watcher round counts for (a round is 1 s and two calls)


class PeerBeats:
    """Whose beat has stood still for ``limit`` seconds of this watcher's own watching. A round
    late by more than :data:`ROUND_CREDIT_S` (this process starved of CPU or of the GIL, or a
    slow call to the service) counts as that long: a peer is not blamed for a stall of the
    watcher's, and a dead one is still named ``limit`` seconds after its last beat."""

    def __init__(self, peers: list[int], limit: float, now: float):
        self.limit, self.watched, self.last_round = limit, 0.0, now
        self.seen = {i: (None, 0.0) for i in peers}  # last beat value, watched time it changed

    def round(self, beats: dict, now: float) -> list[int]:
        """``beats`` (``{key: value}`` from the service) read at ``now``: the stale peers."""
        self.watched += min(now - self.last_round, ROUND_CREDIT_S)
        self.last_round = now
        for i, (value, _) in self.seen.items():
            beat = beats.get(f"{BEATS}{i}")  # absent: it has not beaten yet
            if beat != value:
                self.seen[i] = (beat, self.watched)
        return [i for i, (_, t) in self.seen.items() if self.watched - t > self.limit]


def _watch(client, process_id: int, num_processes: int, timeout_s: int) -> None:
    """Beat every second; end this process with one line when a peer's beat stands still for
    ``timeout_s / 2`` (:class:`PeerBeats`) or the coordinator stops answering for as long."""
    limit = max(2.0, timeout_s / 2)
    watch = PeerBeats([i for i in range(num_processes) if i != process_id], limit,
                      time.monotonic())
    beat, unreachable_since = 0, None
    while not _stopped.wait(1.0):
        try:
            beat += 1
            client.key_value_set(f"{BEATS}{process_id}", beat_value(beat, _beside["mark"]()),
                                 allow_overwrite=True)
            # every beat in one call, not one per peer (127 a second each on 128 processes)
            beats = dict(client.key_value_dir_get(BEATS))
            _beside["marks"] = marks_of(beats)
            unreachable_since = None
        except Exception as e:  # noqa: BLE001 - the coordination service is gone
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since > limit and not _stopped.is_set():
                _say_and_exit(process_id, num_processes,
                              f"coordination service unavailable: {e}")
            continue
        stale = watch.round(beats, time.monotonic())
        if stale and not _stopped.is_set():
            _say_and_exit(process_id, num_processes,
                          "unhealthy (stopped sending heartbeats): "
                          + ", ".join(map(str, stale)))


def lost_peer(e: BaseException, process_id: int, num_processes: int,
              timeout_s: int = DEFAULT_TIMEOUT_S) -> None:
    """``e`` (raised in a step) is a collective that failed, most likely because a peer is
    gone: wait for the watcher to name the lost process and end this one. If it has not after
    ``timeout_s``, every peer still beats (the collective failed on its own: gloo's connect
    timeout under a peer stuck alive, for one): end with a line that says so and quotes ``e``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
    _say_and_exit(process_id, num_processes, str(e), beating_s=timeout_s)


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective or coordination failure (a peer died), not a bug."""
    text = str(e)
    return type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and bool(re.search(
        r"Gloo|Connection reset|Connection closed|Broken pipe|UNAVAILABLE|heartbeat|"
        r"coordination service|DEADLINE_EXCEEDED", text))

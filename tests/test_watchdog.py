"""The watchdog's judgement (``--hang-timeout``): a run is stuck when no process marked progress
for the timeout and none is compiling; its line says where each process was. The drills that
end real runs: ``tests/test_lost_peer.py`` (2 processes) and below (one process)."""

import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ciera_jax.cli import main as cli
from ciera_models.checkpoint import store
from ciera_models.resilience import peers
from ciera_models.resilience import watchdog
from ciera_models.resilience.failures import EXIT_HUNG
from ciera_models.resilience.watchdog import Watch
from ciera_models.train.config import TrainConfig


def _value(count: int, where: str, compiling: bool = False) -> str:
    return f"{count}|{int(compiling)}|{where}"


def test_stuck_only_when_every_process_stood_still_for_the_timeout():
    w = Watch(2, timeout_s=10, now=0.0)
    w.update(0, _value(1, "in step 3"), now=1.0)
    w.update(1, _value(1, "before step 3"), now=2.0)
    assert not w.stuck(11.0)  # process 1 moved 9 s ago
    assert w.stuck(12.0)
    w.update(1, _value(1, "before step 3"), now=12.0)  # the same mark again: no progress
    assert w.stuck(12.5)
    w.update(1, _value(2, "in step 3"), now=13.0)  # it moved on
    assert not w.stuck(13.0) and not w.stuck(22.9) and w.stuck(23.0)
    assert w.where() == "process 0 in step 3, process 1 in step 3"


def test_a_process_compiling_keeps_every_process_waiting_up_to_a_limit():
    w = Watch(3, timeout_s=5, now=0.0)
    w.update(0, _value(4, "in step 1"), now=0.0)
    w.update(1, _value(4, "in step 1"), now=0.0)
    w.update(2, _value(3, "in step 1", compiling=True), now=0.0)
    limit = watchdog.COMPILE_FLOOR_S  # an hour at least, whatever the timeout
    assert w.compile_limit_s == limit
    assert not w.stuck(limit - 0.1)
    w.update(2, _value(4, "in step 1"), now=limit - 0.1)  # its compile ended: a change
    assert not w.stuck(limit + 4.8) and w.stuck(limit + 4.9)
    w.update(2, _value(5, "in step 2", compiling=True), now=1e4)  # a compile that hangs
    assert not w.stuck(1e4 + limit - 0.1) and w.stuck(1e4 + limit)
    assert w.where() == ("process 0 in step 1, process 1 in step 1, process 2 in step 2, "
                         "compiling")
    assert watchdog.stuck_line(0, w, "restart", "above").startswith(
        "ciera train (process 0): no progress for 3600 s (a compile's limit: 4 x "
        "--hang-timeout, at least 3600 s): process 0 in step 1, ")
    assert Watch(1, timeout_s=1800, now=0.0).compile_limit_s == 4 * 1800  # 4 timeouts


def test_a_process_that_never_published_counts_from_the_start():
    w = Watch(2, timeout_s=5, now=0.0)
    w.update(0, _value(1, "checking checkpoint step 8"), now=0.0)
    w.update(1, None, now=4.0)  # NOT_FOUND: not published yet
    assert w.stuck(5.0)
    assert w.where() == "process 0 checking checkpoint step 8, process 1 not started"


def test_marks_and_compiles_from_any_thread_change_the_published_value():
    before = watchdog.own()
    watchdog.mark("in step 7")
    after = watchdog.own()
    assert after != before and after.endswith("|0|in step 7")
    inside = []
    with watchdog.compiling():
        t = threading.Thread(target=lambda: inside.append(watchdog.own()))
        t.start()
        t.join()
    assert inside[0].split("|")[1] == "1" and watchdog.own().split("|")[1] == "0"
    assert len({before, after, inside[0], watchdog.own()}) == 4  # each one a change


def test_the_line_names_each_process_and_what_to_restart_from(tmp_path):
    w = Watch(2, timeout_s=30, now=0.0)
    w.update(0, _value(9, "in step 3"), 0.0)
    w.update(1, _value(8, "before step 3 (--inject-hang)"), 0.0)
    line = watchdog.stuck_line(1, w, "nothing was saved (no --checkpoint-dir): restart all "
                               "processes", "in /x/ciera-train-process-1.log")
    assert line == ("ciera train (process 1): no progress for 30 s (--hang-timeout): process 0 "
                    "in step 3, process 1 before step 3 (--inject-hang); stopped; nothing was "
                    "saved (no --checkpoint-dir): restart all processes; the stacks of every "
                    "thread: in /x/ciera-train-process-1.log")


class FakeService:
    """The coordination service's key-value calls the peer watcher makes, counted."""

    def __init__(self, store: dict):
        self.store, self.calls = store, []

    def key_value_set(self, key, value, allow_overwrite=False):
        self.calls.append("set")
        self.store[key] = value

    def key_value_dir_get(self, prefix):
        self.calls.append("dir_get")
        return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


def test_the_marks_travel_with_the_beats_in_one_thread_s_two_calls(monkeypatch):
    """Several processes: the peer watcher's thread sends this process's mark inside its beat
    and reads every process's beat and mark in one call; nothing else talks to the service."""
    monkeypatch.setattr(peers, "_beside", {"mark": lambda: "", "marks": {}})
    theirs = _value(3, "before step 5")
    service = FakeService({f"{peers.BEATS}1": peers.beat_value(1, theirs)})
    watchdog.mark("in step 5")
    peers.publish_with_beats(watchdog.own)
    was_stopped = peers._stopped.is_set()  # an in-process run before this one ended watching
    peers._stopped.clear()
    t = threading.Thread(target=peers._watch, args=(service, 0, 2, 600), daemon=True)
    t.start()
    try:
        for _ in range(60):  # the first round comes after a second
            if service.calls:
                break
            t.join(0.1)
        t.join(0.5)
    finally:
        peers.stop_watching()
        t.join(5)
        if not was_stopped:
            peers._stopped.clear()
    assert not t.is_alive()  # no watcher left beating in this process
    rounds = service.calls.count("set")
    assert rounds >= 1 and service.calls[:2 * rounds] == ["set", "dir_get"] * rounds
    mine = service.store[f"{peers.BEATS}0"]
    assert mine.split("|", 1)[1] == watchdog.own()
    assert peers.marks() == {0: watchdog.own(), 1: theirs}


def test_a_beat_carries_its_mark_and_changes_every_second_when_the_mark_does_not():
    marks = [_value(7, "in step 2 | odd"), _value(7, "in step 2 | odd")]
    beats = {f"{peers.BEATS}{i}": peers.beat_value(i + 10, m) for i, m in enumerate(marks)}
    beats[f"{peers.BEATS}2"] = "5"  # a beat without a mark: not a mark of process 2
    assert peers.marks_of(beats) == {0: marks[0], 1: marks[1]}
    watch = peers.PeerBeats([1], limit=2.0, now=0.0)
    for second in range(1, 6):  # the mark stands still, the counter moves: alive
        value = peers.beat_value(second, marks[1])
        assert watch.round({f"{peers.BEATS}1": value}, float(second)) == []
    assert watch.round({f"{peers.BEATS}1": value}, 7.0) == []  # the beat stopped: 2 s
    assert watch.round({f"{peers.BEATS}1": value}, 8.0) == [1]  # 3 s > the limit


def test_the_watchdog_sees_the_others_marks_as_the_beats_brought_them(monkeypatch):
    w = Watch(3, timeout_s=5, now=0.0)
    read = {1: _value(1, "in step 1"), 2: _value(1, "before step 1"), 7: _value(1, "nobody")}
    monkeypatch.setattr(peers, "marks", lambda: dict(read))
    watchdog.look(w, 0, now=1.0)
    assert [s.since for s in w.seen] == [1.0, 1.0, 1.0]
    assert w.seen[0].value == watchdog.own() and w.seen[2].where == "before step 1"
    read[1] = _value(2, "in step 2")  # process 1 moved on; 2 stood still
    watchdog.look(w, 0, now=3.0)
    assert [s.since for s in w.seen] == [1.0, 3.0, 1.0]
    assert not w.stuck(7.9) and w.stuck(8.0)


def _watches_alive(within_s: float = 3.0) -> int:
    deadline = time.monotonic() + within_s  # a watch sees its stop within a second
    while True:
        alive = sum(t.name == "ciera-watchdog" and t.is_alive() for t in threading.enumerate())
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_a_run_that_raised_leaves_no_watch_behind(tmp_path, capsys):
    """A run inside a longer-lived process (a test, a notebook) that ends in an error stops its
    watch: left running, it would end that process ``--hang-timeout`` seconds later. A second
    start replaces the first watch instead of reviving it."""
    watchdog.start(600)
    watchdog.start(600)
    assert _watches_alive(0.0) >= 1
    watchdog.stop()
    assert _watches_alive() == 0
    ck = tmp_path / "ck"
    with store.Checkpointer(str(ck)) as c:  # another run's: the run starts, then refuses it
        c.save(4, {"w": np.zeros(4, np.float32)}, {"m": np.zeros(4, np.float32)},
               {"train_config": {**TrainConfig().__dict__, "gather": "plain", "seed": 0}})
    assert cli.main(["train", "--steps", "8", "--checkpoint-dir", str(ck), "--resume",
                     "--hang-timeout", "600"]) == 2
    assert "was trained with --gather plain" in capsys.readouterr().err
    assert _watches_alive() == 0


@pytest.mark.slow
def test_one_process_stuck_ends_with_its_stacks_above_one_line(tmp_path):
    """One process, ``--inject-hang 2``: within the timeout of the stop, every thread's stack
    on stderr (no supervisor, so no log), then the line last, exit 70."""
    p = subprocess.run([sys.executable, "-m", "ciera_jax.cli.main", "train", "--steps", "4",
                        "--gather", "plain", "--inject-hang", "2", "--hang-timeout", "5",
                        "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == EXIT_HUNG, p.stderr[-3000:]
    *stacks, line = p.stderr.strip().splitlines()
    assert re.fullmatch(r"ciera train: no progress for 5 s \(--hang-timeout\): before step 2 "
                        r"\(--inject-hang\); stopped; the newest complete checkpoint is step 1 "
                        rf"in {re.escape(str(tmp_path / 'ck'))}"
                        r"(?: \(the save of step \d+ did not finish\))?: restart the run with "
                        r"--resume; the stacks of every thread: above", line), p.stderr[-3000:]
    assert any("hang_if_due" in s for s in stacks), p.stderr[-3000:]


BLOCKED_STDERR = """
import fcntl, os, sys
from ciera_models.resilience import peers
from ciera_models.resilience import watchdog
peers.WRITE_LIMIT_S = 1.0
unread, w = os.pipe()  # a stderr pipe nobody drains (its read end open), already full
fcntl.fcntl(w, fcntl.F_SETFL, os.O_NONBLOCK)
try:
    while True:
        os.write(w, b"x" * 65536)
except BlockingIOError:
    pass
fcntl.fcntl(w, fcntl.F_SETFL, 0)
sys.stderr = open(w, "w")
{call}
"""


RACE = """
import sys, threading, time
from ciera_models.resilience import peers
first = threading.Thread(target=peers.last_words, args=(5, lambda: (
    time.sleep(0.5), print("the first path's line", file=sys.stderr))))
first.start()
time.sleep(0.1)
peers.end_alone(6, lambda: print("the second path's line", file=sys.stderr))
"""


def test_of_two_paths_ending_a_process_the_first_says_its_line_and_the_other_waits():
    """The peer watcher, the watchdog and a failed step race to end a process: one line, the
    first's, and its exit code."""
    p = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (5, "the first path's line\n")


@pytest.mark.parametrize("call, code", [
    ("peers._say_and_exit(0, 2, 'unhealthy (stopped sending heartbeats): 1')", 69),
    ("watchdog._end(1, watchdog.Watch(2, 5, 0.0), None)", EXIT_HUNG),
    ("peers._never_joined(1, 2, 'localhost:1', 5)", 69),
    ("peers.end_alone(3, lambda: print('a traceback', file=sys.stderr))", 3),
    ("peers.end_alone(4, lambda: 1 / 0)", 4),  # words that fail to be said end it too
    ("from ciera_models.resilience import preemption; g = preemption.PreemptionGuard(log=lambda s: None)"
     "; g._handle(15, None); g._handle(15, None)", 128 + 15)])  # a second SIGTERM
def test_a_last_line_that_cannot_be_written_still_ends_the_process(call, code):
    """Every path that ends a process (:func:`peers.last_words`): the line's write blocks on a
    full stderr pipe; the process exits anyway, within the armed limit, with the code the line
    would have come with."""
    p = subprocess.run([sys.executable, "-c", BLOCKED_STDERR.format(call=call)],
                       capture_output=True, timeout=120)
    assert p.returncode == code, p.stderr[-2000:]

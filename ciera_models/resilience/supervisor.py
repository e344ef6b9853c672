"""A thin parent for a multi-process ``ciera train``: the survivor of a lost coordinator ends in
one line too.

When process 0 dies, it takes JAX's coordination service with it. Every other process's
distributed-runtime client then polls an error (``PollForError``: socket closed) and calls
``LOG(FATAL)`` from a C++ thread within a second: exit 134 and ~30 lines of abort dump. No
Python code runs on that path. jaxlib 0.10.2 offers no way out in-process: the client's
``missed_heartbeat_callback`` aborts on its ``absl::Status`` argument (``std::bad_cast``), the
error poll cannot be turned off from Python, and ``jax_enable_recoverability`` only changes the
service, which is the part that died.

So ``ciera train`` with ``--num-processes`` > 1 runs the real job as a child (this module) and
stays small: it streams the child's stdout and stderr to the terminal, holding back the C++
log lines until it knows whether they are an abort; keeps the child's whole output in a log
file; passes SIGTERM / SIGINT on (the child saves and exits 75) and SIGUSR1 (the child prints
its stacks); and returns the child's exit code unchanged -- except for the coordination-service
abort, which becomes the lost-peer line (:func:`~models.peers.lost_line`, naming the log) and
exit 69. The child dies with its parent (``PR_SET_PDEATHSIG``): killing the ``ciera train``
process kills the process it runs.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ciera_models.resilience import peers
from ciera_models.resilience.failures import EXIT_PEER_LOST

CHILD_ENV = "CIERA_TRAIN_CHILD"  # set in the child: it runs the job itself
LOG_ENV = "CIERA_TRAIN_LOG"  # the log file's path, for the child's own lost-peer line
PROGRESS_FD_ENV = "CIERA_PROGRESS_FD"  # the child writes each finished step here
HOLD_S = 3.0  # C++ log lines not followed by an abort within this long reach the terminal
# A line read this soon after a C++ line goes on its message: the coordination service's
# errors span lines that look like nothing ("...(stopped sending heartbeats):", "1", "The
# tasks have crashed..."), written in one go.
BURST_S = 0.05
# absl / glog: "W1201 20:56:04.503986   18767 preemption_sync_manager.cc:147] ..."
_GLOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w./-]+:\d+\]")
# the lines a glog message or the abort dump carries on with
_CONTINUED = re.compile(rb"^(Additional GRPC error information|:UNKNOWN:|\*\*\* Check failure|"
                        rb"\s+@\s+0x|\s*$)")
_ABORT = re.compile(rb"Terminating process because the JAX distributed service detected "
                    rb"fatal errors|\*\*\* Check failure stack trace")


def is_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def log_path(checkpoint_dir: str | None, metrics_out: str | None, process_id: int) -> Path:
    """Where process ``process_id``'s full log goes: beside its checkpoints, else beside the
    metrics file, else in the temporary folder (a new name each run)."""
    name = f"ciera-train-process-{process_id}.log"
    if checkpoint_dir:
        return Path(checkpoint_dir).absolute() / name
    if metrics_out:
        return Path(metrics_out).absolute().parent / name
    fd, path = tempfile.mkstemp(prefix=f"ciera-train-process-{process_id}-", suffix=".log")
    os.close(fd)
    return Path(path)


class StderrFilter:
    """The child's stderr to the terminal, less a coordination-service abort: a C++ log line
    (and what follows it) is held until a plain line comes, :data:`HOLD_S` pass, or the child
    ends; an abort drops what is held and every C++ line after it."""

    def __init__(self, write):
        self._write = write
        self._held: list[bytes] = []
        self._since = 0.0
        self._last_cxx = float("-inf")  # when the last C++ line came
        self._lock = threading.Lock()
        self.aborted = False
        self.abort_text: list[bytes] = []  # what the abort said, for naming the lost process

    def feed(self, line: bytes) -> None:
        with self._lock:
            now = time.monotonic()
            follows = now - self._last_cxx <= BURST_S  # written with the C++ line before it
            cxx = bool(_GLOG.match(line)) or (bool(self._held or self.aborted) and (
                follows or bool(_CONTINUED.match(line))))
            if cxx:
                self._last_cxx = now
            if self.aborted and cxx:
                self.abort_text.append(line)
                return
            if _ABORT.search(line):
                self.aborted = True
                self.abort_text += self._held + [line]
                self._held = []
                return
            if cxx:
                if not self._held:
                    self._since = time.monotonic()
                self._held.append(line)
                return
            self._release()
            self._write(line)

    def tick(self, end: bool = False) -> None:
        """Let held lines go once they have waited :data:`HOLD_S` (all of them at ``end``)."""
        with self._lock:
            if self._held and (end or time.monotonic() - self._since >= HOLD_S):
                self._release()

    def _release(self) -> None:
        for line in self._held:
            self._write(line)
        self._held = []


def _die_with_parent():
    """A ``preexec_fn``: the child gets SIGKILL when the supervisor dies (Linux)."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork
    except (OSError, AttributeError):
        return None

    def arm():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(EXIT_PEER_LOST)

    return arm


def train_command(train_args: list[str]) -> list[str]:
    """The child's command line: ``ciera train train_args`` in this Python."""
    return [sys.executable, "-m", "ciera_jax.cli.main", "train", *train_args]


def supervise(cmd: list[str], process_id: int, num_processes: int,
              checkpoint_dir: str | None, metrics_out: str | None) -> int:
    """Run ``cmd`` (:func:`train_command`) as a child and return its exit code (the lost-peer
    line and 69 for a coordination-service abort; ``128 + N`` for death by signal N)."""
    log = log_path(checkpoint_dir, metrics_out, process_id)
    read_progress, write_progress = os.pipe()
    env = {**os.environ, CHILD_ENV: "1", LOG_ENV: str(log), "PYTHONUNBUFFERED": "1",
           PROGRESS_FD_ENV: str(write_progress)}
    with open(log, "ab") as out:
        out.write(f"=== ciera train (process {process_id}) {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  f": {' '.join(cmd)}\n".encode())
        out.flush()
        lock = threading.Lock()

        def to(stream):
            def write(line: bytes) -> None:
                stream.buffer.write(line)
                stream.flush()
            return write

        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                 pass_fds=(write_progress,), process_group=0,
                                 preexec_fn=_die_with_parent())
        os.close(write_progress)
        errors = StderrFilter(to(sys.stderr))
        step: list[int] = []
        threads = [threading.Thread(target=_pump, args=(child.stdout, out, lock, to(sys.stdout)),
                                    daemon=True),
                   threading.Thread(target=_pump, args=(child.stderr, out, lock, errors.feed),
                                    daemon=True),
                   threading.Thread(target=_steps, args=(read_progress, step), daemon=True)]
        for t in threads:
            t.start()
        previous = _forward_signals(child)
        try:
            while child.poll() is None:
                try:
                    child.wait(timeout=0.25)
                except subprocess.TimeoutExpired:
                    pass
                errors.tick()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        for t in threads:
            t.join(timeout=10)
        errors.tick(end=True)
    rc = child.returncode
    if errors.aborted and rc != EXIT_PEER_LOST:
        peers.progress.update(step=step[-1] if step else None, checkpoint_dir=checkpoint_dir,
                              log=str(log))
        text = b"".join(errors.abort_text).decode(errors="replace")
        sys.stdout.flush()
        print(peers.lost_line(process_id, num_processes, text), file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    return rc if rc >= 0 else 128 - rc



def _pump(stream, log, lock, write) -> None:
    """Each line of ``stream`` into the log file, then to ``write``."""
    for line in iter(stream.readline, b""):
        with lock:
            log.write(line)
            log.flush()
        write(line)
    stream.close()


def _steps(fd: int, step: list[int]) -> None:
    """The child's finished steps, one number a line, the last kept in ``step``."""
    with os.fdopen(fd, "rb") as f:
        for line in f:
            try:
                step.append(int(line))
            except ValueError:
                continue
            del step[:-1]


def _forward_signals(child) -> dict:
    """SIGTERM and SIGINT go on to the child (in its own process group, so a terminal's Ctrl-C
    reaches it once, from here), and SIGUSR1 (the child prints its threads' stacks); one that
    this process ignores stays ignored."""
    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        if signal.getsignal(s) is signal.SIG_IGN:
            continue
        previous[s] = signal.signal(s, lambda signum, frame: _send(child, signum))
    return previous


def _send(child, signum: int) -> None:
    try:
        child.send_signal(signum)
    except ProcessLookupError:
        pass


def report_step(step: int) -> None:
    """In the child: tell the supervisor that ``step`` finished (for its lost-peer line)."""
    fd = os.environ.get(PROGRESS_FD_ENV)
    if fd is None:
        return
    try:
        os.write(int(fd), f"{step}\n".encode())
    except (OSError, ValueError):
        pass

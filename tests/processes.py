"""Waiting for the processes of a multi-process ``ciera train`` drill: when a run does not end in
time, the test fails with every process's stacks and the end of its output, not with one
process's ``TimeoutExpired`` (a hang in CI is then readable from CI's log alone)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_env(**extra: str) -> dict:
    """The test session's environment for a child process that sets its own device count
    (``--devices``): XLA_FLAGS without the session's count, the rest (the compile flags) as the
    session has them; ``extra`` on top."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith(DEVICE_COUNT_FLAG)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, **({"XLA_FLAGS": " ".join(flags)} if flags else {}), **extra}


STACKS_WAIT_S = 5  # for each process to print its stacks after SIGUSR1


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kill each process and close its pipes (what it wrote and nobody read is dropped): a
    pipe left open is a ResourceWarning, and a file descriptor, per process."""
    for p in procs:
        p.kill()
        p.wait()
        for pipe in (p.stdin, p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()


def finish(procs: list[subprocess.Popen], timeout: float,
           logs: list[Path] | None = None) -> list[tuple[int, str, str]]:
    """Each process's ``(exit code, stdout, stderr)`` (stderr ``""`` where it goes to stdout),
    all of them ended within ``timeout`` seconds together. Every process's pipes are read at
    once, each in a thread: read one after another, a process that writes more than a pipe
    holds (64 KB) while an earlier one runs stalls in its write, and the earlier one waits for
    it in a collective, a hang this harness made. Past the timeout, each live one gets SIGUSR1
    (``ciera train`` prints its threads' stacks), then all are killed and the test fails with
    the end of each one's output, and of its log file in ``logs`` (the supervisor's copy of
    everything its child wrote)."""
    outs: list = [("", "")] * len(procs)

    def drain(i: int, p: subprocess.Popen) -> None:
        outs[i] = p.communicate()

    readers = [threading.Thread(target=drain, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in readers):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(STACKS_WAIT_S)
            for p in procs:
                p.kill()
            for t in readers:
                t.join()  # all output so far, stacks included
            pytest.fail(f"the {len(procs)}-process run did not end within {timeout:.0f} s:\n"
                        + "\n".join(f"--- process {i} (exit {p.returncode}):\n{_tail(out)}\n"
                                    f"{_tail(err)}" for i, (p, (out, err))
                                    in enumerate(zip(procs, outs)))
                        + log_tails(logs or []))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [(p.returncode, out, err or "") for p, (out, err) in zip(procs, outs)]


def _tail(text: str | None, chars: int = 5000) -> str:
    return (text or "")[-chars:]


def log_tails(logs: list[Path]) -> str:
    """The end of each log file, for a failure's message (its stacks, after a watchdog's
    line)."""
    return "".join(f"\n--- log {log}:\n{_tail(_read(log))}" for log in logs)


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError as e:
        return f"(not readable: {e.strerror})"

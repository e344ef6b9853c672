"""One run per checkpoint folder: ``<dir>/.ciera-train.lock`` holds the process id and host of
the run that uses the folder.

A second run is refused in one line while the holder lives. A lock left by a dead process (a
SIGKILL, a crashed host) is taken over with a note: on the same host the process id is checked;
a lock from another host cannot be checked from here, so it is refused with the command that
removes it. The lock is created whole (written to a private file, then hard-linked into place),
so a reader never sees half a lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".ciera-train.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _read(path: Path) -> dict | None:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and isinstance(got.get("pid"), int) else None


def me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def acquire(directory: str | Path, log) -> Path:
    """Take the folder's lock for this process (ValueError in one line if another live run
    holds it). Returns the lock's path."""
    directory = Path(directory)
    lock = directory / LOCK_NAME
    mine = {**me(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = directory / f"{LOCK_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(mine) + "\n")
    try:
        for _ in range(5):
            try:
                os.link(tmp, lock)
                return lock
            except FileExistsError:
                pass
            holder = _read(lock)
            if holder is not None and {k: holder.get(k) for k in ("pid", "host")} == me():
                return lock  # this process holds it already (a nested train() call)
            if holder is not None and holder.get("host") != mine["host"]:
                raise ValueError(
                    f"--checkpoint-dir {directory} is in use by process {holder['pid']} on host "
                    f"{holder.get('host')} (since {holder.get('started', '?')}); if that run is "
                    f"gone, remove {lock} and start again")
            if holder is not None and _alive(holder["pid"]):
                raise ValueError(
                    f"--checkpoint-dir {directory} is in use by another run (process "
                    f"{holder['pid']} on this host, since {holder.get('started', '?')}); wait "
                    "for it to end, or pass another --checkpoint-dir")
            if holder is None and time.time() - _mtime(lock) < 2:
                time.sleep(0.5)  # perhaps being replaced right now: look again
                continue
            # stale: move it aside atomically (only one taker wins), then link ours
            with contextlib.suppress(FileNotFoundError):
                os.replace(lock, directory / f"{LOCK_NAME}.stale")
                log(f"note: took over the lock of {directory}: "
                    + (f"its holder (process {holder['pid']} on this host, since "
                       f"{holder.get('started', '?')}) is no longer running" if holder else
                       "the lock file was unreadable"))
        raise ValueError(f"--checkpoint-dir {directory}: could not take its lock {lock}; "
                         "another run keeps replacing it")
    finally:
        tmp.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def release(lock: Path) -> None:
    """Remove the lock if this process holds it."""
    holder = _read(lock)
    if holder is not None and {k: holder.get(k) for k in ("pid", "host")} == me():
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def hold(directory: str | Path, log):
    """The folder's lock for the ``with`` block (released at its end, also on an error).
    A nested hold by the same process leaves the release to the outer one."""
    lock = Path(directory) / LOCK_NAME
    outer = _read(lock)
    nested = outer is not None and {k: outer.get(k) for k in ("pid", "host")} == me()
    acquire(directory, log)
    try:
        yield lock
    finally:
        if not nested:
            release(lock)

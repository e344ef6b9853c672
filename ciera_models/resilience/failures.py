"""How ``ciera train`` ends when something outside the training math goes wrong: one line on
stderr and a documented exit code, never a traceback wall.

=====  =================================================================================
code   meaning
=====  =================================================================================
0      done (also: ``--resume`` found a checkpoint at or past ``--steps``: nothing to do)
1      a crash (a bug, a non-finite loss, a self-check that keeps failing): a traceback
2      bad input, refused before any work (also: the checkpoint folder is locked by a run
       that is still going)
66     ``--resume``: every checkpoint in the folder is damaged (all were set aside)
69     a peer process was lost or never started (multi-process runs)
70     no process made progress for ``--hang-timeout`` seconds: every thread's stack is in
       the log
74     a write failed (disk full, or another OSError): the newest checkpoint is intact
75     preempted (SIGTERM/SIGINT): saved with ``--checkpoint-dir``; rerun with ``--resume``
=====  =================================================================================
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

from ciera_jax.runtime.units import fmt_bytes

EXIT_NO_GOOD_CHECKPOINT = 66  # EX_NOINPUT
EXIT_PEER_LOST = 69  # EX_UNAVAILABLE
EXIT_HUNG = 70  # EX_SOFTWARE
EXIT_WRITE_FAILED = 74  # EX_IOERR


class RunFailure(RuntimeError):
    """A run that cannot go on for a reason outside the training math: its message is one line
    for a person, :attr:`exit_code` the process's exit status."""

    exit_code = 1


class NoGoodCheckpoint(RunFailure):
    exit_code = EXIT_NO_GOOD_CHECKPOINT


class WriteFailed(RunFailure):
    exit_code = EXIT_WRITE_FAILED


class PeerLost(RunFailure):
    exit_code = EXIT_PEER_LOST


def everywhere(e: BaseException) -> BaseException:
    """``e``, marked as raised by every process at the same point (after an agreement, or
    from values every process holds alike). Such a run ends through JAX's exit-time shutdown,
    which every process reaches; any other failure of a multi-process run ends its process at
    once (:func:`ciera_models.resilience.peers.end_alone`)."""
    e.ciera_everywhere = True
    return e


@contextlib.contextmanager
def raised_by_all():
    """What the ``with`` raises is :func:`everywhere`: checks of what every process holds
    alike (the arguments, agreed values)."""
    try:
        yield
    except Exception as e:
        raise everywhere(e)


def raised_everywhere(e: BaseException) -> bool:
    """Whether :func:`everywhere` marked ``e``."""
    return getattr(e, "ciera_everywhere", False)


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (itself, or one in its cause/context chain), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno or e.strerror):
            return e
        e = e.__cause__ or e.__context__
    return None


def describe_os_error(e: BaseException, path: str | Path) -> str:
    """``"No space left on device; 12 KB free there"``: what failed, and the free space of
    ``path``'s file system when it can be read."""
    os_err = os_error_in(e)
    if os_err is not None:
        what = os_err.strerror or errno.errorcode.get(os_err.errno, str(os_err))
    else:
        text = str(e).strip().splitlines()
        what = text[0] if text else type(e).__name__
        if "no space left" in what.lower():
            what = "No space left on device"
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return what
    return f"{what}; {fmt_bytes(free)} free there"

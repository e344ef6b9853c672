"""``ciera train --inject-crash STEP[:PROCESS]``: a drill of a crash on one process only (and
``--inject-hang``, one of a process that stops, alive).

Before step STEP, process PROCESS (default 0) raises :class:`InjectedCrash`, as a bug on one
host would; every other process goes on into the step. The crashed process prints its
traceback and ends at once (exit 1), and the others then see a lost peer: one line each, exit
69, within ``--peer-timeout`` (at once where the crashed one is process 0, the coordinator).
Without this, the crashed process would wait in JAX's exit-time shutdown for the others while
they wait for it in the step's collectives (docs/training.md, "Multi-process: a lost peer").

``--inject-hang STEP[:PROCESS]``: before step STEP, process PROCESS stops where it is, alive, as
one stuck in a library would (its heartbeats go on); the others wait for it in the step. The
watchdog (``--hang-timeout``, :mod:`ciera_models.resilience.watchdog`) then ends every process in one line,
exit 70.
"""

from __future__ import annotations

import dataclasses
import threading

from ciera_models.resilience import watchdog


class InjectedCrash(RuntimeError):
    """The drill's error: a stand-in for a bug that only one process hits."""


@dataclasses.dataclass(frozen=True)
class CrashDrill:
    step: int
    process: int = 0


def parse_crash(text: str | None, flag: str = "--inject-crash") -> CrashDrill | None:
    """``STEP[:PROCESS]`` -> :class:`CrashDrill` (ValueError with the format if bad)."""
    if not text:
        return None
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        drill = CrashDrill(*map(int, parts))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected STEP[:PROCESS], e.g. 5 or 5:1") from None
    if drill.step < 1 or drill.process < 0:
        raise ValueError(f"{flag} {text!r}: STEP must be >= 1 and PROCESS >= 0")
    return drill


def check_crash(drill: CrashDrill, steps: int, start: int, processes: int,
                flag: str = "--inject-crash") -> None:
    """ValueError unless the drill's step is one this run trains and its process exists."""
    if not start < drill.step <= steps:
        raise ValueError(f"{flag} step {drill.step} is not trained by this run; pick a step "
                         f"from {start + 1} to {steps}")
    if drill.process >= processes:
        raise ValueError(f"{flag}: process {drill.process} is not among the {processes} "
                         "process(es)")


def crash_if_due(drill: CrashDrill | None, step: int, process: int) -> None:
    """Raise :class:`InjectedCrash` on the drill's process before the drill's step."""
    if drill is not None and drill.step == step and drill.process == process:
        raise InjectedCrash(f"injected crash (--inject-crash) before step {step} on process "
                            f"{process}")


def hang_if_due(drill: CrashDrill | None, step: int, process: int) -> None:
    """Stop for good on the drill's process before the drill's step (the watchdog ends it)."""
    if drill is not None and drill.step == step and drill.process == process:
        watchdog.mark(f"before step {step} (--inject-hang)")
        threading.Event().wait()

"""Leaving orbax's CheckpointManager with none of its background work still running.

A ``CheckpointManager`` starts work in threads of its own: its constructor starts removing an
earlier run's unfinished ``*.orbax-checkpoint-tmp-*`` folders (only ``save`` waits for that,
not ``close``), and an async save writes and finalizes behind the caller. A process that ends
while such a thread still runs races the interpreter's shutdown: the thread's
``asyncio.to_thread`` meets a closed executor (``RuntimeError: cannot schedule new futures
after shutdown``, printed after the run's last line), and native code still working in it can
die with the process (a bus error). So a run waits for all of it, on every way out.
"""

from __future__ import annotations

import logging


def await_cleanup(mgr) -> None:
    """Until ``mgr``'s removal of earlier runs' temporary folders (started by its constructor)
    has ended; its failure is left to the first save, which orbax makes wait for it anyway."""
    wait = getattr(mgr, "_maybe_await_cleanup_tmp_directory", None)
    if wait is None:  # an orbax without the background clean-up
        return
    try:
        wait()
    except Exception:  # noqa: BLE001 - the folder's problem is the save's to report
        pass


def close(mgr) -> None:
    """Close ``mgr`` with nothing of it left running: its clean-up and any save in flight are
    waited for, then its threads and event loops are shut. A save that failed makes orbax's
    ``close`` raise that failure again before it shuts anything (the caller has reported it
    already, from :meth:`Checkpointer.wait`): then the rest is shut here, quietly, so that no
    write fragment's error is left in a future nobody reads."""
    await_cleanup(mgr)
    logger = logging.getLogger("absl")
    level = logger.level
    try:
        mgr.close()
        return
    except Exception:  # noqa: BLE001 - the failed save's error, reported once already
        logger.setLevel(logging.CRITICAL)  # orbax logs each failed thread's traceback
    try:
        for part in ("_checkpointer", "_non_blocking_metadata_store",
                     "_blocking_metadata_store", "_checkpoint_deleter"):
            obj = getattr(mgr, part, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 - the same failure again
                    pass
    finally:
        logger.setLevel(level)


class _AbandonedFutures(logging.Filter):
    """asyncio's "... exception was never retrieved" for the write fragments of a save that
    failed: orbax awaits the first fragment's error and abandons the others' futures, which
    report the same error (a full disk) when collected. The failure is one line already.

    The reports are dropped here, not prevented where they arise: the fragments are gathered
    inside orbax's private serialization module (``asyncio.gather`` without
    ``return_exceptions``, in a coroutine local to one of its functions), and neither its
    public API nor the manager's hands the caller those futures to collect. Only records with
    that message are dropped; asyncio's other reports pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in str(record.msg)


def hush_abandoned_futures() -> None:
    """From a save on: the process's asyncio drops those reports (they come as the save
    fails, before its wait reports it in one line), and Python's warning at exit about the
    abandoned fragments' coroutines is off."""
    import warnings

    warnings.filterwarnings("ignore", message=r"coroutine .*write_fragment.* was never awaited",
                            category=RuntimeWarning)
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedFutures) for f in logger.filters):
        logger.addFilter(_AbandonedFutures())

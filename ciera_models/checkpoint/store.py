"""Orbax checkpoints of the training state: params, optimizer state, step, data position, and
the TrainConfig, seed and mesh that produced them.

Exponent caches are not saved: they are derived state, and a restored run starts with fresh
(unprimed) caches whose first gather re-primes them, bitwise exactly. The data position is the
step (batch ``i`` is a pure function of ``(seed, i)``), stored explicitly for readers.

Saves are atomic: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it
when complete, so a run killed during a save leaves the previous checkpoint the latest; the
partial directory is ignored and removed when the next run opens the directory.

Saves run in the background: ``save`` copies this process's shards to host memory and
returns; orbax writes them, and hashes them (:mod:`models.shard_digest`), in its commit thread,
then renames the step into place. One save is in flight at a time (the next one, and the end of
the run, wait for it); a background failure is reported by that wait, naming its step.

Checkpoints check themselves (format 2). Every save records, per array shard, a SHA-256 of its
bytes (``digests/process_<i>.json``: each process hashes the shards it holds) and, in its
metadata, a digest of the metadata itself (``meta_sha256``). A restore checks the metadata,
reads the arrays, and hashes every shard where it lies. A checkpoint whose metadata cannot be
read or does not match, whose arrays cannot be read, or whose shards do not match their
digests (the line names the shard) is reported in one line, moved (not deleted) to
``<dir>/damaged/<step>``, and the previous one is tried; when none is good,
:class:`~models.failures.NoGoodCheckpoint` says so. Checkpoints of format 1 (a whole-state
``params_sha256`` / ``opt_state_sha256`` in the metadata) still verify, the old way; those
saved before digests existed restore with a note.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from ciera_models.resilience import peers
from ciera_models.checkpoint import close as checkpoint_close, shard_digest
from ciera_models.resilience import watchdog
from ciera_models.checkpoint.meta import (FORMAT, check_meta, checkpoint_format, meta_sha256,
                                         tree_sha256)
from ciera_models.resilience.failures import (NoGoodCheckpoint, RunFailure, WriteFailed,
                                   describe_os_error, everywhere)
from ciera_models.checkpoint.params_hash import params_sha256
from ciera_models.resilience.preemption import agree, agree_steps
from ciera_models.checkpoint.shard_digest import Damaged

DAMAGED = "damaged"  # damaged checkpoints are moved to <dir>/damaged/<step>


READS = 2  # how many times a restore reads a step whose arrays fail before setting it aside


def check_dir(directory: str) -> None:
    """Fail now, with one line, if ``directory`` cannot hold checkpoints (it is created)."""
    p = Path(directory)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--checkpoint-dir {p} is a file, not a directory; pass a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {p} is not writable ({e.strerror}); pass a "
                         "directory you can write to") from None


def _closed_loop(kind, value) -> bool:
    return kind is RuntimeError and str(value) == "Event loop is closed"


def _abandoned_read(u) -> bool:
    """An orbax read of one array's shard, left unfinished when the restore it was part of
    failed and closed when it is garbage-collected: it raises again, to nobody."""
    return getattr(u.object, "__name__", None) == "_read_array_index_and_device_put"


def _drop_closed_loop_errors() -> None:
    """Once per hook, for the process: tensorstore callbacks into an event loop that orbax
    closed after a failed read or write print "Event loop is closed" (through
    ``sys.excepthook`` or ``sys.unraisablehook``), and each array read a failed restore left
    unfinished prints its error with the array's whole TensorStore spec when it is collected
    (enough of them fill a stderr pipe nobody drains, and the process stalls in the hook). That is noise after a failure already reported in one line."""
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def on_except(kind, value, tb):
        if not _closed_loop(kind, value):
            excepthook(kind, value, tb)

    def on_unraisable(u):
        if not (_closed_loop(u.exc_type, u.exc_value) or _abandoned_read(u)):
            unraisablehook(u)

    # each hook on its own: another library (pytest's capture, for one) may replace one of them
    for name, quiet in (("excepthook", on_except), ("unraisablehook", on_unraisable)):
        if not getattr(getattr(sys, name), "ciera_quiet", False):
            quiet.ciera_quiet = True
            setattr(sys, name, quiet)


@contextlib.contextmanager
def _orbax_quiet(after_error: bool = False):
    """Orbax's own error logs off for the ``with`` (a failure is reported in one line by the
    caller). A save that fails makes orbax's writer threads fail one after another, and log a
    traceback each, some after the save returned: ``after_error`` keeps them off after one."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    _drop_closed_loop_errors()
    try:
        yield
    except BaseException:
        if not after_error:
            logger.setLevel(level)
        raise
    else:
        logger.setLevel(level)


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__


class Checkpointer:
    """The run's checkpoint directory: periodic and final saves (in the background), the
    newest ``keep`` kept. ``read_only``: only look (no clean-up of another run's temporary
    directories)."""

    def __init__(self, directory: str, keep: int = 3, create: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.keep = keep
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                            cleanup_tmp_directories=not read_only,
                                            enable_async_checkpointing=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=opts,
                                          item_names=("state", "meta", "digests"))
        checkpoint_close.await_cleanup(self._mgr)  # a refusal next must not race its thread
        self._pending: tuple[int, int | None, object] | None = None  # step, newest before, say
        self._said: set[int] = set()
        self._lock = threading.Lock()
        self._absl_level: int | None = None  # orbax's log level while a save is in flight

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            self.wait()  # the save in flight ends whole (or fails in one line)
        except WriteFailed:
            if kind is None:
                raise
        finally:
            checkpoint_close.close(self._mgr)

    def save(self, step: int, params, opt_state, meta: dict, wait: bool = False,
             say=None) -> None:
        """Start saving step ``step`` (``meta`` is small JSON) and return once this process's
        shards are copied to host memory; the write and the digests finish in the background
        (``wait``: here). ``say`` gets one line when the step is complete on disk. A failed
        write (a full disk, ...) raises :class:`WriteFailed` in one line, from here or from
        the next wait; the step is then not among the checkpoints (orbax renames a step into
        place only when whole)."""
        self.wait()  # one save in flight at a time; a failure of the last one is named here
        meta = {**meta, "step": step, "data_position": step, "checkpoint_format": FORMAT,
                "digest_processes": jax.process_count()}
        meta["meta_sha256"] = meta_sha256(meta)
        tree = {"params": params, "opt_state": opt_state}
        self._pending = (step, self.latest_step(), say)
        self._hush()
        try:
            snapshot = shard_digest.take(tree)
            self._mgr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta),
                digests=shard_digest.DigestSave(snapshot)), force=True)
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore wrap OSErrors their way
            raise self._failed(e) from None
        if say is not None:
            threading.Thread(target=self._watch, args=(step,), daemon=True,
                             name=f"ciera-checkpoint-{step}").start()
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the save in flight is complete on disk; :class:`WriteFailed` if it failed."""
        if self._pending is None:
            return
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(e) from None  # still hushed: late threads log tracebacks too
        step = self._pending[0]
        self._announce(step)
        self._pending = None
        self._unhush()

    def _hush(self) -> None:
        """Orbax's own logs off while a save is in flight: a failure is reported in one line
        (by :meth:`wait`), and orbax's threads would each log a traceback for it, some after
        the wait returned (so after a failure they stay off)."""
        if self._absl_level is None:
            logger = logging.getLogger("absl")
            self._absl_level = logger.level
            logger.setLevel(logging.CRITICAL)
            _drop_closed_loop_errors()
            checkpoint_close.hush_abandoned_futures()  # they fail before the wait says so

    def _unhush(self) -> None:
        if self._absl_level is not None:
            logging.getLogger("absl").setLevel(self._absl_level)
            self._absl_level = None

    def _failed(self, e: BaseException) -> BaseException:
        """What to raise for a save that failed with ``e``: :class:`WriteFailed`, or ``e``
        itself where it is a peer's failure (another process died while this one saved beside
        it, and orbax's collective broke here): the lost-peer line names that process, where
        this one would blame the disk."""
        step, before, _ = self._pending
        self._pending = None
        if peers.is_peer_failure(e):
            return e
        return WriteFailed(
            f"checkpoint: saving step {step} to {self.directory} failed "
            f"({describe_os_error(e, self.directory)}); the newest checkpoint is "
            + (f"still step {before}" if before is not None else "none")
            + ": free space (or fix the folder), then rerun with --resume")

    def _watch(self, step: int) -> None:
        """Say the save's line as soon as the step is in place (the rename is the last act)."""
        final = self.directory / str(step)
        while not final.is_dir():
            pending = self._pending
            if pending is None or pending[0] != step:
                return  # waited for (and said, or failed) on the main thread
            time.sleep(0.05)
        self._announce(step)

    def _announce(self, step: int) -> None:
        pending = self._pending
        say = pending[2] if pending is not None and pending[0] == step else None
        with self._lock:
            if say is None or step in self._said:
                return
            self._said.add(step)
        say(f"checkpoint: step {step} saved to {self.directory} (keeping the newest "
            f"{self.keep})")

    def latest_step(self) -> int | None:
        """The newest step complete on disk (a save in flight is not one yet)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The steps complete on disk."""
        return sorted(s for s in self._mgr.all_steps() if (self.directory / str(s)).is_dir())

    def read_meta(self, step: int) -> dict:
        """Step ``step``'s metadata, checked (:class:`Damaged` if it is not intact). Read by
        the handler, not the manager: no barrier, so a process that fails here cannot leave
        the others waiting in one (the callers agree on the outcome instead)."""
        try:
            with _orbax_quiet():
                meta = ocp.JsonCheckpointHandler().restore(self._item(step, "meta"))
        except Exception as e:  # noqa: BLE001 - a missing or cut file: each its own error
            raise Damaged(f"its metadata cannot be read ({_why(e)})") from None
        return check_meta(dict(meta) if isinstance(meta, dict) else meta)

    def _item(self, step: int, item: str):
        from etils import epath

        return epath.Path(self.directory / str(step) / item)

    def latest_meta(self) -> dict | None:
        """The metadata of the newest checkpoint whose metadata is intact (None if none);
        only looks."""
        for step in reversed(self.all_steps()):
            try:
                return self.read_meta(step)
            except Damaged:
                continue
        return None

    def newest_meta(self, log) -> dict | None:
        """The metadata of the newest checkpoint whose metadata is intact; each newer one whose
        metadata is not is reported and set aside. None if there is no checkpoint;
        :class:`NoGoodCheckpoint` if there are some, none intact."""
        return self._newest_intact([self.read_meta], log)

    def restore(self, params, opt_state, log=print):
        """The newest intact ``(params, opt_state, meta)``, into the shapes and shardings of the
        given (fresh) ``params`` and ``opt_state``; None if there is no checkpoint. Each newer
        damaged one is reported in one line and set aside; :class:`NoGoodCheckpoint` if none
        is intact."""
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            {"params": params, "opt_state": opt_state})
        return self._newest_intact(
            [self.read_meta, lambda step, meta: (meta, self._read_arrays(step, abstract)),
             lambda step, got: self._check_digests(step, *got, log)], log)

    def _newest_intact(self, phases, log):
        """The newest step that passes every phase on every process, setting each newer one
        aside; None if there are no steps. The processes walk the same steps (the union of
        what each sees) in lockstep: they agree after every phase (the first takes the step,
        each next one what the last returned), so a checkpoint that is damaged on one process
        only -- say, in the file of arrays it alone reads -- is skipped by all, and no
        process enters a collective (the digests gather the arrays) that another skips.

        A step whose arrays fail (unreadable, or not their digests) is read once more before it
        is set aside, and the log says so: on a loaded 2-process CPU run a read of a checkpoint
        whose files were intact has returned shards that did not match their digests (the
        files, re-read afterwards, did), and one bad read must not cost a good checkpoint."""
        steps = agree_steps(self.all_steps())
        reasons = {}
        for i, step in enumerate(reversed(steps)):
            for attempt in range(READS):
                got, why, failed_at = self._walk_phases(step, phases)
                if failed_at is None:
                    return got
                if failed_at == 0 or attempt == READS - 1:
                    break
                log(f"checkpoint step {step} in {self.directory} did not pass on read "
                    f"{attempt + 1} ({why}): reading it again")
            reasons[step] = why
            self._set_aside(step, reasons[step], steps[: len(steps) - i - 1], log)
        if steps:
            raise everywhere(self._none_good(steps, reasons))  # every step was set aside by all
        return None

    def _walk_phases(self, step: int, phases):
        """``(what the last phase returned, the damage as this process saw it, the phase at
        which any process failed)``; ``(got, None, None)`` when every phase passed everywhere.
        Every process stops at the same phase. An error that is not damage (a bug, an
        unexpected exception) ends every process there too: the one that raised it re-raises
        it, the others a :class:`RunFailure`; none is left waiting in the next agreement."""
        got, why, here = None, None, step in self.all_steps()
        for k, phase in enumerate(phases):
            watchdog.mark(f"checking checkpoint step {step}")
            error = None
            try:
                if not here:
                    raise Damaged("it is not in the folder as this process sees it")
                got = phase(step) if k == 0 else phase(step, got)
            except Damaged as e:
                got, why = None, str(e)
            except Exception as e:  # noqa: BLE001 - raised below, once every process knows
                error = e
            bad, broken = agree(why is not None, error is not None)
            if broken:
                if error is not None:
                    raise everywhere(error)
                raise everywhere(RunFailure(
                    f"--resume: another process failed while checking checkpoint step {step} "
                    f"in {self.directory} (its log says why)"))
            if bad:
                return None, why or "on another process", k
        return got, None, None

    def _read_arrays(self, step: int, abstract):
        """Step ``step``'s arrays, read by the handler (no barrier, as in :meth:`read_meta`)."""
        try:
            with _orbax_quiet():
                got = ocp.StandardCheckpointHandler().restore(
                    self._item(step, "state"), args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # noqa: BLE001 - a cut or garbled array file: tensorstore's
            raise Damaged(f"its arrays cannot be read ({_why(e)})") from None
        return got["params"], got["opt_state"]

    def _check_digests(self, step: int, meta: dict, arrays, log):
        """``(params, opt_state, meta)`` if the arrays match their digests; :class:`Damaged` if
        not. Format 2: this process hashes the recorded shards it holds (no collective);
        format 1: every process hashes the whole arrays (collective)."""
        params, opt_state = arrays
        fmt = checkpoint_format(meta)
        if fmt == 0:
            log(f"note: checkpoint step {step} in {self.directory} predates digests: its "
                "arrays are not verified")
        elif fmt == 1:
            if params_sha256(params) != meta["params_sha256"]:
                raise Damaged("its params do not match their digest (params_sha256)")
            if tree_sha256(opt_state) != meta["opt_state_sha256"]:
                raise Damaged("its optimizer state does not match its digest "
                              "(opt_state_sha256)")
        else:
            manifest = shard_digest.read_manifest(self._item(step, "digests"),
                                                  int(meta["digest_processes"]))
            total, unverified = shard_digest.verify(
                {"params": params, "opt_state": opt_state}, manifest)
            if unverified:
                log(f"note: checkpoint step {step} in {self.directory}: {unverified} of {total} "
                    "shards are split across processes on this layout and were not verified")
        return params, opt_state, meta

    def _set_aside(self, step: int, why: str, older: list[int], log) -> None:
        """Move step ``step`` to ``<dir>/damaged/`` (process 0 moves; all report)."""
        src = self.directory / str(step)
        dest = self.directory / DAMAGED / str(step)
        n = 1
        while dest.exists():
            n += 1
            dest = self.directory / DAMAGED / f"{step}-{n}"
        error = None
        if jax.process_index() == 0 and src.exists():
            try:
                dest.parent.mkdir(exist_ok=True)
                os.replace(src, dest)
            except OSError as e:
                error = e
        # a barrier (nobody looks at the folder while it changes) that also ends every process
        # when the move failed, not only process 0
        if agree(error is not None)[0]:
            raise everywhere(RunFailure(
                f"--resume: checkpoint step {step} in {self.directory} is damaged ({why}) and "
                f"could not be set aside as {dest}: "
                + (describe_os_error(error, dest.parent) if error is not None
                   else "see process 0's log")))
        self._mgr.reload()
        nxt = f"trying step {older[-1]}" if older else "no older checkpoint"
        log(f"checkpoint step {step} in {self.directory} is damaged ({why}): set aside as "
            f"{dest}; {nxt}")

    def _none_good(self, steps: list[int], reasons: dict[int, str]) -> NoGoodCheckpoint:
        """The one line when every checkpoint was set aside; it names each one's damage as
        this process saw it (the full lines are in the log)."""
        each = "; ".join(f"step {s}: {reasons[s]}" for s in reversed(steps))
        return NoGoodCheckpoint(
            f"--resume: none of the checkpoints in {self.directory} is intact (steps "
            f"{', '.join(map(str, steps))}, set aside in {self.directory / DAMAGED}; {each}); "
            "start again without --resume, or with another --checkpoint-dir")


def latest_meta(directory: str) -> dict | None:
    """The metadata of the newest intact checkpoint in ``directory`` (None if there is none);
    only looks (another run's temporary directories are left alone)."""
    if not Path(directory).is_dir():
        return None
    with Checkpointer(directory, create=False, read_only=True) as ck:
        return ck.latest_meta()

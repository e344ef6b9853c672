"""Checkpoints that check themselves, one run per checkpoint folder, a full disk, and what resume
and signals say.

A damaged newest checkpoint (a flipped byte in any kind of file orbax writes, a truncated
array file, deleted or garbled metadata) is reported in one line, set aside, and the run goes
on from the previous one: it ends bitwise where a straight run ends. All damaged: one line and
exit 66. Trains test_train's config (the compiled step is shared in-process).
"""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import pytest

from ciera_jax.cli import main as cli
from ciera_models.checkpoint import store as ckpt
from ciera_models.train import loop
from ciera_models.checkpoint import meta as checkpoint_meta
from ciera_models.resilience import peers
from ciera_models.resilience import run_lock
from ciera_models.resilience.failures import EXIT_NO_GOOD_CHECKPOINT, EXIT_WRITE_FAILED, NoGoodCheckpoint, WriteFailed
from ciera_models.resilience.failures import raised_everywhere
from ciera_models.train import TrainConfig, make_mesh, train
from conftest import TINY_PROGRAMS

STEPS = 20
TC = TrainConfig(config="tiny", schedule_steps=STEPS, **TINY_PROGRAMS)  # test_train's
RESUMED = 16  # a resume from the newest checkpoint (15) runs to here: one step, or six from 10


@pytest.fixture(scope="module")
def straight_sha(tiny_run):
    return tiny_run("ciera").sha256  # conftest's: train(TC, steps=STEPS), once per session


@pytest.fixture(scope="module")
def resumed_sha():
    """Where a straight run is at step RESUMED (the schedule is TC's: 20 steps)."""
    return train(TC, steps=RESUMED, seed=0, mesh=make_mesh(8), log=None).sha256


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at steps 5, 10, 15 (a run stopped at 15), copied by each test."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    train(TC, steps=15, seed=0, mesh=make_mesh(8), checkpoint_dir=str(ck), checkpoint_every=5,
          log=None)
    return ck


def _copy(saved, tmp_path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    return ck


def _resume(ck, logs, **kw):
    return train(TC, steps=kw.pop("steps", RESUMED), seed=0, mesh=make_mesh(8),
                 checkpoint_dir=str(ck), checkpoint_every=5, resume=True, log=logs.append, **kw)


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x5A
    path.write_bytes(bytes(data))


def _biggest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


# Every kind of file in a step's state/ folder: where it lives, and whether damage there
# must be caught (array bytes: always; orbax's own bookkeeping: caught, or harmless to the
# restored arrays -- then the digests match and the run uses the step).
FILES = {
    "array data, the largest file": (lambda s: _biggest(s / "state/ocdbt.process_0/d"), True),
    "array data, the smallest file": (
        lambda s: min((p for p in (s / "state/ocdbt.process_0/d").iterdir()),
                      key=lambda p: p.stat().st_size), None),
    "ocdbt manifest (per process)": (lambda s: s / "state/ocdbt.process_0/manifest.ocdbt", None),
    "ocdbt manifest (top)": (lambda s: s / "state/manifest.ocdbt", None),
    "ocdbt index": (lambda s: next((s / "state/d").iterdir()), None),
    "tree metadata": (lambda s: s / "state/_METADATA", None),
    "sharding": (lambda s: s / "state/_sharding", None),
    "array metadata": (lambda s: s / "state/array_metadatas/process_0", None),
}


@pytest.mark.parametrize("kind", list(FILES))
def test_a_flipped_byte_in_any_file_never_goes_unnoticed(kind, saved, tmp_path, resumed_sha):
    ck = _copy(saved, tmp_path)
    where, must_catch = FILES[kind]
    _flip(where(ck / "15"))
    logs: list[str] = []
    res = _resume(ck, logs)
    assert res.sha256 == resumed_sha  # from step 15 (harmless) or from 10 (set aside)
    damaged = [line for line in logs if "is damaged" in line]
    if must_catch or damaged:
        assert damaged and damaged[0].startswith(f"checkpoint step 15 in {ck} is damaged (")
        assert damaged[0].endswith(f"set aside as {ck / 'damaged' / '15'}; trying step 10")
        assert f"resumed from {ck} at step 10 (caches re-prime)" in logs
        assert (ck / "damaged" / "15" / "state").is_dir()  # moved, not deleted
    else:
        assert f"resumed from {ck} at step 15 (caches re-prime)" in logs


def test_a_flipped_array_byte_is_named_by_its_digest(saved, tmp_path, resumed_sha):
    """Raw array bytes that still decode: only the digest sees the change."""
    ck = _copy(saved, tmp_path)
    _flip(_biggest(ck / "15" / "state/ocdbt.process_0/d"), at=0.9)
    logs: list[str] = []
    assert _resume(ck, logs).sha256 == resumed_sha
    assert any("is damaged (" in line for line in logs), logs


def test_a_truncated_array_file_falls_back(saved, tmp_path, resumed_sha):
    ck = _copy(saved, tmp_path)
    f = _biggest(ck / "15" / "state/ocdbt.process_0/d")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    logs: list[str] = []
    res = _resume(ck, logs)
    assert res.sha256 == resumed_sha and res.history[0]["step"] == 11
    line = next(line for line in logs if "is damaged" in line)
    assert "its arrays cannot be read" in line or "does not match its digest" in line, line
    assert "Traceback" not in "\n".join(logs)


@pytest.mark.parametrize("damage, why", [
    ("delete", "its metadata cannot be read"),
    ("truncate", "its metadata cannot be read"),
    ("edit", "its metadata does not match its digest (meta_sha256)"),
    ("strip digests", "its metadata lacks digest_processes"),
])
def test_damaged_metadata_falls_back_before_compiling(damage, why, saved, tmp_path,
                                                      resumed_sha):
    ck = _copy(saved, tmp_path)
    meta = ck / "15" / "meta" / "metadata"
    if damage == "delete":
        meta.unlink()
    elif damage == "truncate":
        meta.write_bytes(meta.read_bytes()[:100])
    else:
        m = json.loads(meta.read_text())
        if damage == "edit":
            m["train_config"]["lr"] = 0.5  # parses, and would change the run
        else:
            m = {k: v for k, v in m.items() if k != "digest_processes"}
        meta.write_text(json.dumps(m))
    logs: list[str] = []
    res = _resume(ck, logs)
    assert res.sha256 == resumed_sha
    assert f"checkpoint step 15 in {ck} is damaged ({why}" in logs[0], logs[:2]
    assert ckpt.latest_meta(str(ck))["step"] == RESUMED  # the run saved 15 and 16 anew


def test_all_checkpoints_damaged_is_one_line_and_exit_66(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    for step in (5, 10, 15):
        f = _biggest(ck / str(step) / "state/ocdbt.process_0/d")
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(NoGoodCheckpoint, match=r"none of the checkpoints in .* is intact "
                                               r"\(steps 5, 10, 15, .*; step 15: its .*; "
                                               r"step 10: its .*; step 5: its "):
        _resume(ck, [])
    assert sorted(p.name for p in (ck / "damaged").iterdir()) == ["10", "15", "5"]
    for step in (5, 10, 15):  # put them back, and ask the command line
        os.replace(ck / "damaged" / str(step), ck / str(step))
    code = cli.main(["train", "--steps", str(STEPS), "--schedule-steps", str(STEPS),
                     "--checkpoint-dir", str(ck), "--resume"])
    err = capsys.readouterr().err
    assert code == EXIT_NO_GOOD_CHECKPOINT == 66, err
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("ciera train: --resume: none of the checkpoints in ")


def test_a_checkpoint_without_digests_still_restores(saved, tmp_path, resumed_sha):
    """Saved before digests existed: restored, with a note that it is not verified."""
    ck = _copy(saved, tmp_path)
    meta = ck / "15" / "meta" / "metadata"
    m = {k: v for k, v in json.loads(meta.read_text()).items()
         if k not in checkpoint_meta.DIGESTS + checkpoint_meta.FORMAT_KEYS}
    meta.write_text(json.dumps(m))
    logs: list[str] = []
    assert _resume(ck, logs).sha256 == resumed_sha
    assert any("predates digests: its arrays are not verified" in line for line in logs)
    assert f"resumed from {ck} at step 15 (caches re-prime)" in logs


def _phases_with(c, fault):
    """``c.read_meta``, then a phase that calls ``fault`` (the arrays' place in restore)."""
    return [c.read_meta, lambda step, meta: fault()]


def test_an_unexpected_error_in_a_check_ends_every_process_not_only_its_own(saved, tmp_path,
                                                                            monkeypatch):
    """A check that raises something other than damage (a bug) re-raises it here; where
    another process raised it, this one ends too (RunFailure), instead of waiting for that
    process in the next agreement; either way no checkpoint is set aside for it. Both are
    marked as raised everywhere: the run then ends through JAX's shutdown on every process."""
    ck = _copy(saved, tmp_path)
    with ckpt.Checkpointer(str(ck), create=False) as c:
        with pytest.raises(ZeroDivisionError) as here:
            c._newest_intact(_phases_with(c, lambda: 1 / 0), print)
        # another process broke at the same phase (its flag in this process's agreement)
        real = ckpt.agree
        monkeypatch.setattr(ckpt, "agree", lambda *f: real(*f[:1], True) if len(f) == 2
                            else real(*f))
        with pytest.raises(ckpt.RunFailure, match=r"another process failed while checking "
                                                  rf"checkpoint step 15 in {ck} \(its log"
                           ) as there:
            c._newest_intact(_phases_with(c, lambda: None), print)
    assert not (ck / "damaged").exists() and (ck / "15").is_dir()
    assert raised_everywhere(here.value) and raised_everywhere(there.value)


def test_a_checkpoint_that_cannot_be_set_aside_is_one_line(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    f = _biggest(ck / "15" / "state/ocdbt.process_0/d")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    (ck / "damaged").write_text("a file where the folder for damaged checkpoints goes")
    with pytest.raises(ckpt.RunFailure, match=r"checkpoint step 15 in .* is damaged \(its .*\) "
                                              r"and could not be set aside as .*damaged/15: "
                       ) as e:
        _resume(ck, [])
    assert (ck / "15").is_dir()  # left where it was
    assert raised_everywhere(e.value)  # agreed: every process ends together


def test_a_metrics_write_failed_on_another_process_stops_this_one(monkeypatch):
    """Only process 0 writes the metrics: when its write fails, every process stops after the
    same step (the step's agreement carries it), with the same exit code, instead of the
    others waiting for process 0 in the next step's collectives. Here this process is told,
    at step 3, that another one failed."""
    real, calls = loop.agree, []

    def agree(*flags):
        got = real(*flags)
        if len(flags) == 3:  # the step's: stop, save due, a metrics write failed
            calls.append(flags)
            return got[:2] + (len(calls) == 3,)
        return got

    monkeypatch.setattr(loop, "agree", agree)
    with pytest.raises(WriteFailed, match=r"^another process could not write the metrics "
                                          r"after step 3 \(its line says why\); stopped there"
                       ) as e:
        train(TC, steps=5, seed=0, mesh=make_mesh(8), log=None)
    assert len(calls) == 3 and not any(f[2] for f in calls)  # this process wrote (nothing)
    assert raised_everywhere(e.value)


# ---- one run per checkpoint folder ------------------------------------------------------

def _lock_file(ck: Path, pid: int, host: str | None = None) -> Path:
    ck.mkdir(parents=True, exist_ok=True)
    lock = ck / run_lock.LOCK_NAME
    lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                "started": "2025-01-01 00:00:00"}))
    return lock


def test_a_second_run_on_a_locked_folder_is_refused(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = _lock_file(tmp_path / "ck", holder.pid)
        with pytest.raises(ValueError, match=rf"is in use by another run \(process "
                                             rf"{holder.pid} on this host"):
            train(TC, steps=1, checkpoint_dir=str(tmp_path / "ck"), log=None)
        assert cli.main(["train", "--steps", "1", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is in use by another run" in err, err
        assert json.loads(lock.read_text())["pid"] == holder.pid  # left to its holder
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_from_another_host_is_refused_with_the_way_out(tmp_path):
    lock = _lock_file(tmp_path / "ck", 1, host="elsewhere.example")
    with pytest.raises(ValueError, match=rf"in use by process 1 on host elsewhere.example .*"
                                         rf"remove {lock}"):
        train(TC, steps=1, checkpoint_dir=str(tmp_path / "ck"), log=None)


def test_a_stale_lock_is_taken_over_with_a_note_and_released(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = _lock_file(tmp_path / "ck", dead.pid)
    logs: list[str] = []
    train(TC, steps=0, checkpoint_dir=str(tmp_path / "ck"), log=logs.append)
    assert any(line.startswith(f"note: took over the lock of {tmp_path / 'ck'}: its holder "
                               f"(process {dead.pid} on this host") for line in logs), logs
    assert not lock.exists()  # released at the end


# ---- what resume and signals say --------------------------------------------------------

def test_resume_at_or_past_steps_says_nothing_to_do(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    logs: list[str] = []
    res = _resume(ck, logs, steps=10)
    assert res.history == [] and res.final_step == 15
    assert (f"nothing to do: the checkpoint in {ck} is at step 15, at or past --steps 10; "
            "pass a larger --steps to train on (exit 0)") in logs
    assert ckpt.Checkpointer(str(ck), create=False).all_steps() == [5, 10, 15]  # no new save
    assert cli.main(["train", "--steps", "15", "--checkpoint-dir", str(ck), "--resume"]) == 0
    assert "nothing to do: the checkpoint" in capsys.readouterr().out


def test_resume_with_nothing_to_do_compiles_nothing(saved, tmp_path, monkeypatch):
    """Nor does it start the encode program's compile, which Python would wait for at exit."""
    from ciera_models.train.state import Trainer

    started = []
    monkeypatch.setattr(Trainer, "start_encode_compile", lambda self: started.append(self))
    assert _resume(_copy(saved, tmp_path), [], steps=15).history == []
    assert started == []
    _resume(_copy(saved, tmp_path / "more"), [], steps=16)  # one step to do: it does
    assert started


def test_resume_on_another_device_count_says_results_differ(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    logs: list[str] = []
    train(TC, steps=15, seed=0, mesh=make_mesh(4), checkpoint_dir=str(ck), resume=True,
          log=logs.append)
    notes = [line for line in logs if "devices in" in line]
    assert notes == [
        "note: the checkpoint (step 15) was saved on 8 devices in 1 process, this run has 4 "
        "devices in 1 process: sums reduce in another order, so the resumed run will not be "
        "bitwise equal to an uninterrupted run on either layout"], logs


def test_a_signal_without_checkpoint_dir_says_nothing_was_saved():
    logs: list[str] = []
    signalled = []

    def log(line):
        logs.append(line)
        # once: a second signal ends the process at once (the test's), and a run may log
        # step 2 twice (a self-check that failed, then healed)
        if line.startswith("[") and "step    2/" in line and not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    res = train(TC, steps=STEPS, seed=0, mesh=make_mesh(8), log_every=1, log=log)
    assert res.preempted == "SIGTERM" and res.final_step < STEPS
    said = "\n".join(logs)
    assert "SIGTERM received: finishing this step, then exiting (nothing will be saved: no " \
           "--checkpoint-dir)" in said
    assert f"after step {res.final_step} of {STEPS}: nothing was saved (no --checkpoint-dir); " \
           "a new run starts from step 0" in said
    assert "--resume" not in said


# ---- a full disk ------------------------------------------------------------------------

def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous(saved, tmp_path,
                                                                      monkeypatch, resumed_sha):
    ck = _copy(saved, tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(ocp.CheckpointManager, "save", full)
        with pytest.raises(WriteFailed) as e:
            _resume(ck, [])
    msg = str(e.value)
    assert e.value.exit_code == EXIT_WRITE_FAILED == 74 and "\n" not in msg
    assert msg.startswith(f"checkpoint: saving step {RESUMED} to {ck} failed (No space left "
                          "on device; ")
    assert "free there); the newest checkpoint is still step 15" in msg
    logs: list[str] = []
    assert _resume(ck, logs).sha256 == resumed_sha  # space again: nothing was lost
    assert f"resumed from {ck} at step 15 (caches re-prime)" in logs


def test_a_save_broken_by_a_lost_peer_is_not_blamed_on_the_disk(saved, tmp_path, monkeypatch):
    """Another process died while this one saved beside it, and orbax's collective broke here:
    the save raises that failure as it is (the CLI then prints the lost-peer line naming the
    process, exit 69), not a WriteFailed telling the user to free space."""
    ck = _copy(saved, tmp_path)
    broken = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error: Connection reset by peer")

    def lost_peer(*a, **k):
        raise broken

    monkeypatch.setattr(ocp.CheckpointManager, "save", lost_peer)
    with pytest.raises(jax.errors.JaxRuntimeError) as e:
        _resume(ck, [])
    assert e.value is broken and peers.is_peer_failure(e.value)


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _cut_short_on_the_fourth_row(real_write):
    """An ``os.write`` that writes half of the fourth row it is given, then fails like a full
    disk: the line cut short that --resume must drop, every time."""
    def write(fd, data):
        write.n += 1
        if write.n == 4:
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    write.n = 0
    return write


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("disk", ["a 4 KB tmpfs", "a write cut short"])
def test_a_full_disk_under_the_metrics_file_loses_nothing(disk, saved, tmp_path, straight_sha):
    """The metrics file fills a 4 KB tmpfs (root only), or a write fails halfway like one: one
    line naming the file and the newest checkpoint; --resume repairs the file (a line cut short
    is dropped) and ends bitwise where a straight run ends. The tmpfs fills wherever the rows'
    lengths put its 4,096th byte: a line's end, or just before its newline (a whole row, no cut),
    cuts nothing there; the second case cuts a line every time."""
    ck = _copy(saved, tmp_path)
    small = tmp_path / "small"
    mounted = disk == "a 4 KB tmpfs" and _tmpfs(small, "4k")
    if disk == "a 4 KB tmpfs" and not mounted:
        pytest.skip("mounting a tmpfs needs root and mount(8); the cut write runs everywhere")
    small.mkdir(exist_ok=True)
    try:
        out = small / "m.jsonl"
        saved_write = os.write
        if not mounted:
            os.write = _cut_short_on_the_fourth_row(saved_write)
        try:
            with pytest.raises(WriteFailed) as e:
                _resume(ck, [], metrics_out=str(out), trace_every=1, steps=STEPS)
        finally:
            os.write = saved_write
        msg = str(e.value)
        assert msg.startswith("metrics: writing step ") and f"to {out} failed (No space left " \
            "on device" in msg and "\n" not in msg
        assert msg.endswith("the newest checkpoint is step 15 in "
                            f"{ck}: free space, then rerun with --resume (the metrics file is "
                            "repaired then)")
        moved = tmp_path / "m.jsonl"
        shutil.copy(out, moved)
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)
    cut = not _parses(moved.read_text().splitlines()[-1])
    assert cut or mounted  # a write cut short always leaves a partial line
    logs: list[str] = []
    res = _resume(ck, logs, metrics_out=str(moved), steps=STEPS)
    assert res.sha256 == straight_sha
    dropped = f"metrics: dropped 1 line(s) of {moved} that a failed write cut short"
    assert (dropped in logs) == cut, logs
    rows = [json.loads(line) for line in moved.read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == list(range(16, STEPS + 1))
    assert sum("header" in r for r in rows) == 2

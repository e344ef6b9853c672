"""Per-shard checkpoint digests (format 2), without training: a save returns before its hashes
are done; a shard that does not match is named and the previous checkpoint restores; an
interrupted or failed background save leaves no checkpoint that verifies wrong; another device
count still verifies; format-1 checkpoints still verify.

The state is a few small arrays sharded over the emulated devices (conftest: 8).
"""

import errno
import json
import logging
import shutil
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ciera_jax.runtime.devices import make_mesh
from ciera_models.checkpoint import store as ckpt
from ciera_models.checkpoint import meta as checkpoint_meta
from ciera_models.resilience import peers
from ciera_models.checkpoint import shard_digest
from ciera_models.resilience.failures import WriteFailed
from ciera_models.checkpoint.params_hash import params_sha256
from processes import kill_all  # tests/processes.py


def _state(n_devices: int = 8, bump: int = 0):
    """``(params, opt_state)``: 2-d and 1-d arrays sharded on axis 0, a replicated one, a
    scalar; ``bump`` shifts every value (a later step's state)."""
    mesh = make_mesh(n_devices)
    split, whole = NamedSharding(mesh, PartitionSpec("fsdp")), NamedSharding(mesh, PartitionSpec())
    w = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) + bump
    params = {"w": jax.device_put(w, split),
              "norm": jax.device_put(jnp.full(8, 1 + bump, jnp.bfloat16), whole)}
    opt_state = {"mu": jax.device_put(w / 7, split), "count": jnp.int32(bump)}
    return params, opt_state


def _save(ck_dir, *steps, n_devices: int = 8):
    with ckpt.Checkpointer(str(ck_dir)) as ck:
        for step in steps:
            ck.save(step, *_state(n_devices, bump=step), {"run": "test"}, wait=True)


def _restore(ck_dir, n_devices: int = 8):
    logs: list[str] = []
    with ckpt.Checkpointer(str(ck_dir)) as ck:
        got = ck.restore(*_state(n_devices), log=logs.append)
    return got, logs


def _same(got, step: int) -> bool:
    want = jax.tree.leaves(_state(bump=step))
    return all(np.array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                              np.asarray(b).reshape(-1).view(np.uint8))
               for a, b in zip(jax.tree.leaves(got[:2]), want))


def test_a_save_returns_before_its_digests_are_done(tmp_path, monkeypatch):
    """The loop is blocked only for the host copy: the hashes and the write come after, and
    the step is on disk (and said) only when they are done."""
    release, hashing = threading.Event(), threading.Event()
    real = shard_digest.record

    def held(snap):
        hashing.set()
        release.wait(60)
        return real(snap)

    monkeypatch.setattr(shard_digest, "record", held)
    logs: list[str] = []
    with ckpt.Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(1, *_state(bump=1), {"run": "test"}, say=logs.append)
        assert hashing.wait(60)  # returned while the hashing thread is held
        assert ck.latest_step() is None and not (tmp_path / "ck" / "1").exists() and not logs
        release.set()
        ck.wait()
        assert ck.latest_step() == 1
    assert logs == [f"checkpoint: step 1 saved to {tmp_path / 'ck'} (keeping the newest 3)"]
    files = sorted(p.name for p in (tmp_path / "ck" / "1" / "digests").glob("process_*.json"))
    assert files == ["process_0.json"]
    got, logs = _restore(tmp_path / "ck")
    assert got[2]["step"] == 1 and _same(got, 1)
    assert got[2]["checkpoint_format"] == checkpoint_meta.FORMAT
    assert not logs  # verified: no note, no damage


def _step_1_values_but_one_shard(ck, at, change) -> None:
    """Steps 1 and 2 saved, step 2 holding step 1's digests and step 1's values, but for
    ``w[at]``, which holds ``change(w[at])`` (rows 16:24 are the third of 8 shards)."""
    _save(ck, 1)
    params, opt_state = _state(bump=1)
    w = np.asarray(params["w"]).copy()
    w[at] = change(w[at])
    params["w"] = jax.device_put(w, params["w"].sharding)
    with ckpt.Checkpointer(str(ck)) as c:
        c.save(2, params, opt_state, {"run": "test"}, wait=True)
    shutil.copy(ck / "1" / "digests" / "process_0.json", ck / "2" / "digests" / "process_0.json")


def test_a_shard_that_does_not_match_is_named_and_the_older_checkpoint_restores(tmp_path):
    """Step 2's arrays differ from what its digests say in one shard only (step 2 holds step
    1's digests but one shard of step 1's values): the line names that shard, and step 1 is
    restored bitwise."""
    ck = tmp_path / "ck"
    _step_1_values_but_one_shard(ck, (16, 3), lambda v: v + 1.0)
    got, logs = _restore(ck)
    why = "its shard [16:24, 0:8] of params/w, saved by process 0, does not match its digest"
    assert logs == [f"checkpoint step 2 in {ck} did not pass on read 1 ({why}): reading it again",
                    f"checkpoint step 2 in {ck} is damaged ({why}): set aside as "
                    f"{ck / 'damaged' / '2'}; trying step 1"]
    assert got[2]["step"] == 1 and _same(got, 1)


def test_a_shard_that_reads_as_zeros_says_so(tmp_path):
    """A shard whose bytes read back as zeros (a write or a read that never landed) is named
    with that clue."""
    ck = tmp_path / "ck"
    _step_1_values_but_one_shard(ck, np.s_[16:24], np.zeros_like)
    got, logs = _restore(ck)
    assert logs[-1] == (f"checkpoint step 2 in {ck} is damaged (its shard [16:24, 0:8] of "
                        "params/w, saved by process 0, does not match its digest (it reads as "
                        f"all zeros)): set aside as {ck / 'damaged' / '2'}; trying step 1")
    assert got[2]["step"] == 1 and _same(got, 1)


def test_a_read_that_fails_once_is_read_again_and_the_checkpoint_kept(tmp_path, monkeypatch):
    """A read of intact files that does not match its digests once (seen on a loaded 2-process
    run) costs a second read, said in the log, not the checkpoint."""
    ck = tmp_path / "ck"
    _save(ck, 1, 2)
    real, reads = shard_digest.verify, []

    def wrong_once(tree, manifest):
        reads.append(1)
        if len(reads) == 1:
            raise shard_digest.Damaged("its shard [0:8, 0:8] of params/w, saved by process 0, "
                                       "does not match its digest")
        return real(tree, manifest)

    monkeypatch.setattr(shard_digest, "verify", wrong_once)
    got, logs = _restore(ck)
    assert len(reads) == 2 and got[2]["step"] == 2 and _same(got, 2)
    assert logs == [f"checkpoint step 2 in {ck} did not pass on read 1 (its shard [0:8, 0:8] of "
                    "params/w, saved by process 0, does not match its digest): reading it again"]
    assert (ck / "2").is_dir() and not (ck / "damaged").exists()


@pytest.mark.parametrize("damage, why", [
    ("delete", "its shard digests of process 0 are missing (digests/process_0.json)"),
    ("edit", "its shard digests of process 0 do not match their own digest"),
    ("drop a shard", "its shard digests of process 0 do not match their own digest"),
])
def test_damaged_digest_files_fall_back(damage, why, tmp_path):
    ck = tmp_path / "ck"
    _save(ck, 1, 2)
    f = ck / "2" / "digests" / "process_0.json"
    if damage == "delete":
        f.unlink()
    else:
        d = json.loads(f.read_text())
        shards = d["leaves"]["params/w"]["shards"]
        if damage == "edit":
            shards[0][1] = "0" * 64
        else:
            del shards[-1]
        f.write_text(json.dumps(d))
    got, logs = _restore(ck)
    assert logs[0].startswith(f"checkpoint step 2 in {ck} did not pass on read 1 ({why}"), logs
    assert logs[1].startswith(f"checkpoint step 2 in {ck} is damaged ({why}"), logs
    assert got[2]["step"] == 1 and _same(got, 1)


def test_digests_that_miss_a_shard_are_incomplete(tmp_path):
    """A file re-signed without one shard (as a writer that lost one would leave it)."""
    ck = tmp_path / "ck"
    _save(ck, 1, 2)
    f = ck / "2" / "digests" / "process_0.json"
    d = json.loads(f.read_text())
    del d["leaves"]["opt_state/mu"]["shards"][3]
    body = {"process": d["process"], "leaves": d["leaves"]}
    f.write_text(json.dumps({**body, "sha256": shard_digest._body_sha(body)}))
    got, logs = _restore(ck)
    assert "(its shard digests do not cover opt_state/mu exactly once)" in logs[0], logs
    assert got[2]["step"] == 1


@pytest.mark.parametrize("saved_on, restored_on", [(8, 4), (8, 1), (2, 8)])
def test_another_device_count_still_verifies_every_shard(saved_on, restored_on, tmp_path):
    """Coarser shards hold several recorded ones; finer ones are put together again (one
    process holds them all): every shard is checked, and a wrong one is still named."""
    ck = tmp_path / "ck"
    _save(ck, 1, 2, n_devices=saved_on)
    got, logs = _restore(ck, restored_on)
    assert got[2]["step"] == 2 and _same(got, 2) and not logs
    with ckpt.Checkpointer(str(ck)) as c:  # step 3: one recorded shard's values changed
        params, opt_state = _state(saved_on, bump=2)
        mu = np.asarray(opt_state["mu"]).copy()
        mu[-1, 0] = -1.0
        opt_state["mu"] = jax.device_put(mu, opt_state["mu"].sharding)
        c.save(3, params, opt_state, {"run": "test"}, wait=True)
    shutil.copy(ck / "2" / "digests" / "process_0.json", ck / "3" / "digests" / "process_0.json")
    got, logs = _restore(ck, restored_on)
    rows = 64 // saved_on
    assert f"(its shard [{64 - rows}:64, 0:8] of opt_state/mu, saved by process 0" in logs[0]
    assert got[2]["step"] == 2


def test_a_format_1_checkpoint_still_verifies(tmp_path):
    """Whole-state digests in the metadata (the format before this one): checked as before."""
    ck = tmp_path / "ck"
    _save(ck, 1, 2)
    params, opt_state = _state(bump=2)
    meta_file = ck / "2" / "meta" / "metadata"
    meta = {k: v for k, v in json.loads(meta_file.read_text()).items()
            if k not in checkpoint_meta.FORMAT_KEYS}

    def write(params_digest):
        m = {**meta, "params_sha256": params_digest,
             "opt_state_sha256": checkpoint_meta.tree_sha256(opt_state)}
        meta_file.write_text(json.dumps({**m, "meta_sha256": checkpoint_meta.meta_sha256(m)}))

    write(params_sha256(params))
    shutil.rmtree(ck / "2" / "digests")
    got, logs = _restore(ck)
    assert got[2]["step"] == 2 and _same(got, 2) and not logs
    write("0" * 64)
    got, logs = _restore(ck)
    assert "(its params do not match their digest (params_sha256))" in logs[0]
    assert got[2]["step"] == 1


def test_a_failed_background_save_is_one_line_at_the_next_wait(tmp_path, monkeypatch):
    """The hashing thread fails (a full disk): the next save says so in one line, naming the
    step; orbax's threads print no traceback; the previous checkpoint restores."""
    ck = tmp_path / "ck"
    _save(ck, 1)

    returned = threading.Event()

    def full(snap):  # fails once the save has returned, as a slow disk would
        returned.wait(60)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_digest, "record", full)
    logged = _Records()
    logging.getLogger("absl").addHandler(logged)
    try:
        with ckpt.Checkpointer(str(ck)) as c:
            c.save(2, *_state(bump=2), {"run": "test"})  # returns: it fails in the thread
            returned.set()
            with pytest.raises(WriteFailed) as e:
                c.save(3, *_state(bump=3), {"run": "test"})
            assert c.all_steps() == [1]
    finally:
        logging.getLogger("absl").removeHandler(logged)
    assert not logged.errors  # orbax's threads logged no traceback
    msg = str(e.value)
    assert msg.startswith(f"checkpoint: saving step 2 to {ck} failed (No space left on device")
    assert msg.endswith("the newest checkpoint is still step 1: free space (or fix the "
                        "folder), then rerun with --resume") and "\n" not in msg
    monkeypatch.undo()
    got, _ = _restore(ck)
    assert got[2]["step"] == 1 and _same(got, 1)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record):
        self.errors.append(record.getMessage())


INTERRUPTED = textwrap.dedent("""
    import sys, threading
    sys.path[:0] = [{tests!r}]
    import conftest  # 8 emulated devices, before JAX starts
    from test_shard_digest import _state
    from ciera_models.checkpoint import store as ckpt
    from ciera_models.checkpoint import shard_digest
    with ckpt.Checkpointer({ck!r}) as ck:
        ck.save(1, *_state(bump=1), {{}}, wait=True)
        def stuck(snap):
            print("hashing", flush=True)
            threading.Event().wait()
        shard_digest.record = stuck
        ck.save(2, *_state(bump=2), {{}})
        print("saving", flush=True)
        threading.Event().wait()
""")


def test_an_interrupted_background_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A process killed while its save of step 2 is hashing: no step 2 (only orbax's
    temporary folder, removed by the next run); the lost-peer line names step 1 as the newest
    complete checkpoint and says that step 2's save did not finish; step 1 restores."""
    ck = tmp_path / "ck"
    tests = str(__import__("pathlib").Path(__file__).parent)
    child = subprocess.Popen([sys.executable, "-c", INTERRUPTED.format(tests=tests, ck=str(ck))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = {child.stdout.readline().strip() for _ in range(2)}
        assert said == {"hashing", "saving"}, (said, child.stderr.read()[-2000:])
    finally:
        kill_all([child])
    assert (ck / "1").is_dir() and not (ck / "2").exists()
    assert [p.name.split(".")[0] for p in ck.iterdir() if "tmp" in p.name] == ["2"]
    monkeypatch.setitem(peers.progress, "step", 2)
    monkeypatch.setitem(peers.progress, "checkpoint_dir", str(ck))
    monkeypatch.setitem(peers.progress, "log", None)
    line = peers.lost_line(0, 2, "unhealthy (stopped sending heartbeats): 1")
    assert line == (f"ciera train (process 0): lost process 1 of 2 after step 2; the newest "
                    f"complete checkpoint is step 1 in {ck} (the save of step 2 did not "
                    "finish): restart all 2 processes with --resume")
    got, logs = _restore(ck)
    assert got[2]["step"] == 1 and _same(got, 1) and not logs
    assert not [p for p in ck.iterdir() if "tmp" in p.name]  # removed when the folder opened

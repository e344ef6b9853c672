"""Checkpoints: atomic saves (a save killed half-way leaves the previous one the latest), the
newest few kept, resume bitwise, and a checkpoint of another run refused with one clear line.

Trains test_train's config (the compiled step is shared in-process through build_trainer).
"""

import shutil

import numpy as np
import pytest

from ciera_models.checkpoint import store as ckpt
from ciera_models.checkpoint import meta as checkpoint_meta
from ciera_models.train import TrainConfig, make_mesh, train
from conftest import TINY_PROGRAMS

STEPS = 20
TC = TrainConfig(config="tiny", schedule_steps=STEPS, **TINY_PROGRAMS)  # test_train's


@pytest.fixture(scope="module")
def straight_sha(tiny_run):
    return tiny_run("ciera").sha256  # conftest's: train(TC, steps=STEPS), once per session


@pytest.mark.slow
def test_save_killed_midway_resumes_from_the_previous_one(tmp_path, straight_sha):
    ck = tmp_path / "ck"
    logs: list[str] = []
    first = train(TC, steps=10, mesh=make_mesh(8), checkpoint_dir=str(ck), checkpoint_every=5,
                  log=logs.append)
    assert first.final_step == 10
    assert [line for line in logs if line.startswith("checkpoint:")] == [
        f"checkpoint: step {s} saved to {ck.absolute()} (keeping the newest 3)" for s in (5, 10)]
    # A run killed while saving step 15 leaves orbax's temporary directory, half written.
    partial = ck / "15.orbax-checkpoint-tmp-1234567890"
    shutil.copytree(ck / "10", partial)
    for f in sorted(p for p in partial.rglob("*") if p.is_file())[::2]:
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    logs.clear()
    res = train(TC, steps=STEPS, mesh=make_mesh(8), checkpoint_dir=str(ck), checkpoint_every=5,
                keep_checkpoints=2, resume=True, log=logs.append)
    assert f"resumed from {ck.absolute()} at step 10 (caches re-prime)" in logs
    assert res.sha256 == straight_sha
    assert res.history[0]["step"] == 11 and res.history[0]["priming"]
    assert not partial.exists()  # the partial save was cleaned up
    with ckpt.Checkpointer(str(ck), create=False) as ck_:
        assert ck_.all_steps() == [15, 20]  # --keep-checkpoints 2
        meta = ck_.latest_meta()
    assert meta["step"] == meta["data_position"] == 20
    assert meta["train_config"] == TC.__dict__ and meta["seed"] == 0


def test_checkpoint_of_another_run_is_refused(tmp_path):
    ck = ckpt.Checkpointer(str(tmp_path / "ck"))
    with ck:
        ck.save(3, {"w": np.zeros(4, np.float32)}, {"m": np.zeros(4, np.float32)},
                {"train_config": {**TC.__dict__, "gather": "plain", "seed": 0}})
    this = {**TC.__dict__, "seed": 0}
    meta = ckpt.latest_meta(str(tmp_path / "ck"))
    with pytest.raises(ValueError, match=r"--gather plain \(this run: ciera\)"):
        checkpoint_meta.check_resumable(meta, this, "ck")
    with pytest.raises(ValueError, match=r"--config tiny \(this run: small\).*--seed 0 \(this "
                                         r"run: 1\)"):
        checkpoint_meta.check_resumable(
            meta, {**this, "gather": "plain", "config": "small", "seed": 1}, "ck")
    # what is sent may change; what is computed may too, with a note that the runs now differ
    notes = checkpoint_meta.check_resumable(
        meta, {**this, "gather": "plain", "plan": "all", "lr": 2e-3, "overflow_rungs": 0,
               "max_programs": 2, "program_patience": 0.5}, "ck")
    assert len(notes) == 1 and notes[0].startswith("--lr is 0.002 (the checkpoint's run had 0.001)")
    # a checkpoint written before the config was stored: its top-level keys are checked
    with pytest.raises(ValueError, match="--config small"):
        checkpoint_meta.check_resumable({"config": "small", "seed": 0, "step": 5}, this, "ck")


def test_check_dir(tmp_path):
    ckpt.check_dir(str(tmp_path / "new" / "dir"))  # created
    assert (tmp_path / "new" / "dir").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        ckpt.check_dir(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="is not writable"):
        ckpt.check_dir(str(tmp_path / "file" / "sub"))  # under a file: cannot be created

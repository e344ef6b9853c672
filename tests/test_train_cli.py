"""`ciera train`'s command line: built from the config dataclasses (every field a flag, with help
and its default; choices are the library's own tuples), and every bad input fails before any
work, with one line that names it.
"""

import argparse
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from ciera_jax import fsdp
from ciera_jax.collective import cache
from ciera_jax.cli import main as cli
from ciera_models.checkpoint import store as ckpt
from ciera_models.cli import train as train_cli
from ciera_models.train.data import TOKEN_DTYPES
from ciera_models.train.config import PLANS, RunConfig, TrainConfig, from_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    return p


def test_every_field_is_a_flag_with_help_and_its_default():
    actions = {a.dest: a for a in _parser()._actions if a.dest != "help"}
    fields = [f.name for cls in (TrainConfig, RunConfig, train_cli.LaunchConfig)
              for f in dataclasses.fields(cls)]
    assert sorted(actions) == sorted(fields)
    for a in actions.values():
        assert a.help and "default: " in a.help, a.dest
    assert "(default: 16)" in actions["batch_size"].help
    assert tuple(actions["gather"].choices) == fsdp.GATHER_MODES
    assert tuple(actions["plan"].choices) == PLANS
    assert tuple(actions["cache"].choices) == (*cache.MODES, "auto")
    assert tuple(actions["data_dtype"].choices) == TOKEN_DTYPES
    assert tuple(actions["remat"].choices) == fsdp.REMAT_POLICIES
    assert tuple(actions["attention"].choices) == ("auto", "xla", "cudnn")


def test_flags_build_the_configs():
    p = _parser()
    args = p.parse_args([])
    assert from_args(TrainConfig, args, schedule_steps=200) == TrainConfig()
    assert from_args(RunConfig, args) == RunConfig()
    args = p.parse_args(["--gather", "plain", "--lr", "0.002", "--seq-len", "32", "--resume",
                         "--checkpoint-every", "5", "--coordinator", "h:1"])
    tc, run = from_args(TrainConfig, args), from_args(RunConfig, args)
    assert (tc.gather, tc.lr, tc.seq_len, tc.schedule_steps) == ("plain", 0.002, 32, None)
    assert run.resume and run.checkpoint_every == 5
    assert from_args(train_cli.LaunchConfig, args).coordinator == "h:1"
    with pytest.raises(SystemExit):
        p.parse_args(["--gather", "fp8"])
    tc = from_args(TrainConfig, p.parse_args(["--remat", "none", "--attention", "xla"]))
    assert (tc.remat, tc.attention) == ("none", "xla")
    assert TrainConfig().attention_on("gpu") == "cudnn"
    assert TrainConfig().attention_on("cpu") == "xla"
    assert TrainConfig(attention="xla").attention_on("gpu") == "xla"


def _one_line_error(argv, capsys) -> str:
    assert cli.main(["train", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ciera train: error: ")
    return err


@pytest.mark.parametrize("devices", ["0", "-2"])
def test_devices_must_be_positive(devices, capsys):
    err = _one_line_error(["--devices", devices], capsys)
    assert f"--devices must be a positive number of devices, got {devices}" in err


def test_checkpoint_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "ck").write_text("not a directory")
    err = _one_line_error(["--checkpoint-dir", str(tmp_path / "ck")], capsys)
    assert f"--checkpoint-dir {tmp_path / 'ck'} is a file, not a directory" in err


def test_checkpoint_dir_not_writable(tmp_path, capsys):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere a mode allows nothing; sysfs refuses root too
        target = Path("/sys/kernel")
    err = _one_line_error(["--checkpoint-dir", str(target)], capsys)
    assert f"--checkpoint-dir {target} is not writable" in err


def test_empty_data_file_is_named(tmp_path, capsys):
    empty = tmp_path / "tokens.bin"
    empty.write_bytes(b"")
    err = _one_line_error(["--data", str(empty)], capsys)
    assert f"data file {empty} is empty" in err


def test_steps_and_keep_must_be_sane(capsys):
    assert "--steps must be >= 0, got -1" in _one_line_error(["--steps", "-1"], capsys)
    assert "--keep-checkpoints must be >= 1" in _one_line_error(
        ["--checkpoint-dir", "unused", "--keep-checkpoints", "0"], capsys)


@pytest.mark.parametrize("saved,flag", [
    ({"gather": "plain"}, "--gather plain (this run: ciera)"),
    ({"config": "small"}, "--config small (this run: tiny)"),
])
def test_resume_from_another_runs_checkpoint(saved, flag, tmp_path, capsys):
    ck = tmp_path / "ck"
    with ckpt.Checkpointer(str(ck)) as c:  # the state is never read: the config is checked first
        c.save(4, {"w": np.zeros(4, np.float32)}, {"m": np.zeros(4, np.float32)},
               {"train_config": {**TrainConfig().__dict__, **saved, "seed": 0}})
    err = _one_line_error(["--checkpoint-dir", str(ck), "--resume", "--steps", "8"], capsys)
    assert f"the checkpoint in {ck} (step 4) was trained with {flag}" in err

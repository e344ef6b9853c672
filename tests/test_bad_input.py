"""Every path and number is checked before work: one row per flag -- the bad value, and the
words the one-line message must hold. Each command exits 2 with that line on stderr and no
traceback, before anything compiles (train), plans or simulates."""

import os
from pathlib import Path

import pytest

from ciera_jax.cli import main as cli


@pytest.fixture
def ro(tmp_path) -> Path:
    """A folder this process cannot write to (root writes anywhere a mode allows nothing;
    sysfs refuses root too)."""
    if os.geteuid() == 0:
        return Path("/sys/kernel")
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    return target


ROWS = [
    # (argv, words the message holds); {ro}: a read-only folder, {tmp}: a writable one
    (["train", "--metrics-out", "{ro}/m.jsonl"], "--metrics-out {ro}/m.jsonl is not writable"),
    (["train", "--metrics-out", "{tmp}"], "--metrics-out {tmp} is a directory; pass a file"),
    (["train", "--metrics-out", "{tmp}/no/m.jsonl"], "the folder {tmp}/no does not exist"),
    (["train", "--checkpoint-every", "-5"], "--checkpoint-every must be >= 0 (0: every "
                                            "--checkpoint-minutes), got -5"),
    (["train", "--checkpoint-minutes", "0"], "--checkpoint-minutes must be positive, got 0"),
    (["train", "--memory-gb", "-1"], "--memory-gb must be a positive number of GB, got -1"),
    (["train", "--memory-gb", "0"], "--memory-gb must be a positive number of GB, got 0"),
    (["train", "--batch-size", "0"], "--batch-size must be a positive number of sequences"),
    (["train", "--seq-len", "0"], "--seq-len must be positive, got 0"),
    (["train", "--max-programs", "0"], "--max-programs must be >= 1 (the first step's "
                                       "program is one), got 0"),
    (["train", "--program-patience", "-1"], "--program-patience must be >= 0 compiles' "
                                            "seconds, got -1"),
    (["train", "--overflow-rungs", "-1"], "--overflow-rungs must be >= 0 (0: every overflow "
                                          "a plain gather), got -1"),
    (["train", "--steps", "-1"], "--steps must be >= 0, got -1"),
    (["train", "--log-every", "-1"], "--log-every must be >= 0 (0: never), got -1"),
    (["train", "--trace-every", "-3"], "--trace-every must be >= 0 (0: never), got -3"),
    (["train", "--data", "{tmp}"], "--data {tmp} is a directory; pass a token file"),
    (["train", "--inject-cache-fault", "x"], "e.g. 5 or 5:2 or 5:0:layers/mlp/w_up_ExDxF"),
    (["train", "--inject-crash", "x"], "--inject-crash 'x': expected STEP[:PROCESS], e.g. 5 "
                                       "or 5:1"),
    (["train", "--inject-crash", "0:1"], "--inject-crash '0:1': STEP must be >= 1 and PROCESS "
                                         ">= 0"),
    (["train", "--steps", "20", "--inject-crash", "21"],
     "--inject-crash step 21 is not trained by this run; pick a step from 1 to 20"),
    (["train", "--steps", "20", "--inject-crash", "5:1"],
     "--inject-crash: process 1 is not among the 1 process(es)"),
    (["train", "--inject-hang", "3:x"], "--inject-hang '3:x': expected STEP[:PROCESS], e.g. 5 "
                                        "or 5:1"),
    (["train", "--steps", "20", "--inject-hang", "5:1"],
     "--inject-hang: process 1 is not among the 1 process(es)"),
    (["train", "--hang-timeout", "-1"], "--hang-timeout must be >= 0 seconds (0: never), got -1"),
    (["train", "--steps", "20", "--inject-cache-fault", "50"],
     "--inject-cache-fault step 50 is past the end (--steps 20); pick a step from 2 to 20"),
    (["train", "--steps", "20", "--inject-cache-fault", "1"],
     "--inject-cache-fault step 1 cannot be checked: it is the first step, whose priming "
     "gather overwrites every cache"),
    (["plan", "--json", "{ro}/plan.json"], "--json {ro}/plan.json is not writable"),
    (["plan", "--json", "{tmp}"], "--json {tmp} is a directory"),
    (["plan", "--memory-gb", "-1"], "--memory-gb must be a positive number of GB (or 'inf'), "
                                    "got -1"),
    (["simulate", "--mfu", "0"], "--mfu must be a fraction in (0, 1], got 0"),
    (["simulate", "--mfu", "-1"], "--mfu must be a fraction in (0, 1], got -1"),
    (["simulate", "--mfu", "1.5"], "--mfu must be a fraction in (0, 1], got 1.5"),
    (["simulate", "--json", "{tmp}"], "--json {tmp} is a directory"),
    (["simulate", "--png", "{ro}/speedup.png"], "--png {ro}/speedup.png is not writable"),
    (["aot", "--gpus", "12"], "--gpus 12: use 1 to 8 GPUs or a multiple of 8 (hosts of 8)"),
    (["aot", "--gpus", "0"], "--gpus 0: use 1 to 8 GPUs"),
    (["aot", "--gpu", "h101"], "unknown GPU 'h101'; choose one of: h100-80gb, h200-141gb"),
    (["aot", "--config", "tiny", "--tokens-per-gpu", "100"],
     "--tokens-per-gpu 100 must be a multiple of the sequence length 64"),
    (["aot", "--repeat", "0"], "--repeat 0: compile each program at least once"),
    (["aot", "--temporaries", "-1"], "--temporaries -1: list none (0) or more"),
    (["aot", "--json", "{tmp}"], "--json {tmp} is a directory"),
    (["aot", "--gather-shape", "8,255,128", "--axis", "1", "--gpus", "8"],
     "--gather-shape (8, 255, 128): axis 1 (255) must divide among 8 GPUs"),
    (["aot", "--gather-shape", "8,x"], "--gather-shape '8,x': give integers separated by commas"),
    (["aot", "--gather-shape", "8,256", "--axis", "2"],
     "--axis 2: the shape (8, 256) has axes 0..1"),
]


@pytest.mark.parametrize("argv, words", ROWS, ids=[" ".join(a) for a, _ in ROWS])
def test_bad_input_is_one_line_and_exit_2(argv, words, ro, tmp_path, capsys):
    fill = lambda s: s.format(ro=ro, tmp=tmp_path)  # noqa: E731
    argv = [fill(a) for a in argv]
    before = sorted(os.listdir(tmp_path))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ciera {argv[0]}: error: "), err
    assert fill(words) in err, err
    assert sorted(os.listdir(tmp_path)) == before  # the check left nothing behind

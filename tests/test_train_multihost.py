"""`ciera train` across 2 real processes (gloo sockets, 4 CPU devices each): ciera == plain,
also where a program compiled beside the steps is done on one process before the other."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ciera_harness.launch import free_port
from processes import child_env, finish, log_tails  # tests/processes.py

pytestmark = pytest.mark.slow  # 2 processes x 2 trainings


def _train_two_processes(gather: str, tmp_path, *extra: str, steps: int = 3,
                         env: dict | None = None) -> str:
    port = free_port()
    env = child_env(**(env or {}))
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "ciera_jax.cli.main", "train", "--steps", str(steps),
         "--devices", "4", "--gather", gather, "--log-every", "1", "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        for i in range(2)]
    outs = [text for _, text, _ in finish(procs, 400)]
    assert all(p.returncode == 0 for p in procs), "".join(
        f"\n--- process {i} (exit {p.returncode}):\n{out[-3000:]}"
        for i, (p, out) in enumerate(zip(procs, outs))) + log_tails(sorted(tmp_path.glob("*.log")))
    assert "2 process(es)" in outs[0], outs[0][-2000:]
    return re.search(r"params_sha256=([0-9a-f]{64})", outs[0]).group(1)


@pytest.mark.slow
def test_multihost_ciera_training_is_bitwise_plain(tmp_path):
    assert _train_two_processes("ciera", tmp_path) == _train_two_processes("plain", tmp_path)


@pytest.mark.slow
def test_a_program_compiled_beside_is_taken_at_one_step_on_every_process(tmp_path):
    """``--compile-beside on``, where process 1's compiles say they are done 3 steps after process
    0's (``tests/compile_done_late``): process 0 keeps priming until process 1 has them too,
    then both run the compressed program, and the run is bitwise plain's."""
    steps, late_steps = 30, 3
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_done_late")
    env = {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "CIERA_TEST_COMPILE_DONE_LATE": f"1:{late_steps}"}
    metrics = tmp_path / "beside.jsonl"
    sha = _train_two_processes("ciera", tmp_path, "--compile-beside", "on", "--metrics-out",
                               str(metrics), steps=steps, env=env)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    taken = [r for r in rows if r["beside_compile_s"]]
    assert len(taken) == 1, [(r["step"], r["program"], r["stand_in"]) for r in rows]
    # compiled in step 1; done on process 0 for step 2, on process 1 for step 2 + 3
    assert taken[0]["step"] == 2 + late_steps
    assert all(r["stand_in"] for r in rows[:taken[0]["step"] - 1])
    assert not rows[-1]["stand_in"] and rows[-1]["sent_bytes"] < rows[-1]["plain_bytes"]
    assert sha == _train_two_processes("plain", tmp_path, steps=steps)

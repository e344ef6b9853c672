"""`ciera train` across 2 real processes (gloo sockets, 4 CPU devices each): ciera == plain."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ciera_jax.runtime.launch import free_port
from processes import finish  # tests/processes.py

pytestmark = pytest.mark.slow  # 2 processes x 2 trainings


def _train_two_processes(gather: str, tmp_path) -> str:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "ciera_jax.cli.main", "train", "--steps", "3", "--devices", "4",
         "--gather", gather, "--log-every", "1", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        for i in range(2)]
    outs = [text for _, text, _ in finish(procs, 400)]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    assert "2 process(es)" in outs[0], outs[0][-2000:]
    return re.search(r"params_sha256=([0-9a-f]{64})", outs[0]).group(1)


@pytest.mark.slow
def test_multihost_ciera_training_is_bitwise_plain(tmp_path):
    assert _train_two_processes("ciera", tmp_path) == _train_two_processes("plain", tmp_path)

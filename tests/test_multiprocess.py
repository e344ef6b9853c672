"""Two real processes over gloo sockets (4 CPU devices each): the gather stays bitwise exact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ciera_harness.launch import run_local


@pytest.mark.slow  # two processes on real sockets: the slow lane's
def test_two_processes_over_sockets_are_bitwise_exact():
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    outs = run_local("mp_gather_worker", ["5"], num_processes=2, local_devices=4,
                     timeout_s=240, env=env)
    for pid, out in enumerate(outs):
        assert f"process {pid} OK" in out, out
        assert out.count("exact") == 10, out
        assert "fallback=False" in out


@pytest.mark.slow
def test_two_processes_word_mode_bitwise_exact():
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    outs = run_local("mp_gather_worker", ["5", "word"], num_processes=2, local_devices=4,
                     timeout_s=400, env=env)
    for pid, out in enumerate(outs):
        assert f"process {pid} OK" in out, out
        assert out.count("exact") == 10, out
        assert out.count("mode=2") == 6, out  # steps 1, 2, 4 of both dtypes: word mode

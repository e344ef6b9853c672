"""A lost process is one line: a peer killed mid-run (2 processes over gloo) and a peer that never
starts both end the survivor within --peer-timeout with exit 69 and one line on stderr, naming
the lost process, the last step and the newest checkpoint -- not JAX's C++ abort dump."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ciera_jax.runtime.launch import free_port
from ciera_models import peers
from ciera_models.failures import EXIT_PEER_LOST

TRAIN = [sys.executable, "-m", "ciera_jax.cli.main", "train", "--schedule-steps", "40",
         "--log-every", "1", "--devices", "4", "--num-processes", "2"]
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def test_the_line_names_the_lost_process_and_the_newest_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "5").mkdir()
    (tmp_path / "10").mkdir()
    (tmp_path / "damaged").mkdir()
    monkeypatch.setitem(peers.progress, "step", 12)
    monkeypatch.setitem(peers.progress, "checkpoint_dir", str(tmp_path))
    assert peers.lost_line(0, 2, "unhealthy (stopped sending heartbeats): 1") == (
        f"ciera train (process 0): lost process 1 of 2 after step 12; the newest checkpoint "
        f"is step 10 in {tmp_path}: restart all 2 processes with --resume")
    assert "lost process 0 (the coordinator) of 2" in peers.lost_line(
        1, 2, "coordination service unavailable: UNAVAILABLE")
    monkeypatch.setitem(peers.progress, "checkpoint_dir", None)
    assert peers.lost_line(0, 3, "Gloo AllGather failed").endswith(
        "lost a peer process of 3 after step 12; nothing was saved (no --checkpoint-dir): "
        "restart all processes")


def test_a_peer_that_never_starts_is_one_line_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([*TRAIN, "--steps", "5", "--coordinator", f"127.0.0.1:{free_port()}",
                        "--process-id", "0", "--peer-timeout", "3"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_PEER_LOST == 69, p.stderr[-2000:]
    assert p.stderr.strip().count("\n") == 0, p.stderr[-2000:]
    assert p.stderr.startswith("ciera train (process 0): the process group at 127.0.0.1:")
    assert "did not form within --peer-timeout 3s" in p.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_killed_peer_ends_the_survivor_in_one_line(tmp_path):
    ck, port, timeout_s = tmp_path / "ck", free_port(), 10
    procs = [subprocess.Popen(
        [*TRAIN, "--steps", "40", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
         "--coordinator", f"127.0.0.1:{port}", "--process-id", str(i), "--peer-timeout",
         str(timeout_s)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        for line in procs[0].stdout:
            if re.search(r"step +5/40\b", line):
                procs[1].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                break
        out, err = procs[0].communicate(timeout=300)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == EXIT_PEER_LOST, err[-3000:]
    assert err.strip().count("\n") == 0, err[-3000:]  # one line, no C++ abort dump
    m = re.fullmatch(rf"ciera train \(process 0\): lost process 1 of 2 after step (\d+); the "
                     rf"newest checkpoint is step (\d+) in {re.escape(str(ck))}: restart all 2 "
                     r"processes with --resume", err.strip())
    assert m, err
    assert int(m.group(2)) <= int(m.group(1)) and (ck / m.group(2)).is_dir()  # intact, there
    assert waited < timeout_s + 60

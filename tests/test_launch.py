"""launch.py: child environments, collecting children's output, and reporting failures."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ciera_harness import launch


def test_free_port_is_bindable():
    import socket

    port = launch.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_child_env_describes_the_process_group(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env = launch.child_env("127.0.0.1:1234", 3, 2, 4, {"EXTRA": "1"}, MORE="x")
    assert env["CIERA_COORDINATOR"] == "127.0.0.1:1234"
    assert (env["CIERA_NUM_PROCESSES"], env["CIERA_PROCESS_ID"],
            env["CIERA_LOCAL_DEVICES"]) == ("3", "2", "4")
    assert env["JAX_PLATFORMS"] == "cpu" and env["EXTRA"] == "1" and env["MORE"] == "x"
    assert "XLA_FLAGS" not in env  # the child sets its own device count


def test_collect_returns_outputs_and_kills_on_timeout():
    fast = subprocess.Popen([sys.executable, "-c", "print('done')"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs, codes = launch.collect([fast, slow], timeout_s=5)
    assert outs[0].strip() == "done" and codes[0] == 0
    assert "[timed out after 5s]" in outs[1] and codes[1] != 0


def test_run_local_returns_each_output_or_raises_with_all_of_them():
    outs = launch.run_local("this", [], num_processes=2, local_devices=1, timeout_s=60)
    assert len(outs) == 2 and all("Beautiful is better than ugly" in o for o in outs)
    with pytest.raises(RuntimeError) as e:
        launch.run_local("json.tool", ["/no/such/file.json"], num_processes=2, local_devices=1,
                         timeout_s=60)
    msg = str(e.value)
    assert "json.tool failed" in msg and "--- process 0 (exit" in msg and "--- process 1" in msg

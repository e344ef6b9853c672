"""The README's test command itself: a worker that dies ends the run with a failure, not a hang
(tests/conftest.py: ``pytest_cmdline_main``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from processes import child_env  # tests/processes.py

TESTS = Path(__file__).parent

CRASHES = """
import os


def test_before():
    pass


def test_dies():
    os._exit(3)  # as a native crash ends a worker: no report, no teardown


def test_after():
    pass
"""


@pytest.mark.slow
def test_a_crashed_worker_fails_the_run_instead_of_hanging(tmp_path):
    crashes = tmp_path / "test_crashes.py"
    crashes.write_text(CRASHES)
    # beside a file of this suite, so that its conftest runs the session (a session of its
    # own: none of this one's PYTEST_ variables)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         str(TESTS / "test_cli.py"), str(crashes)],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in child_env().items() if not k.startswith("PYTEST_")})
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert "crashed while running" in p.stdout and "test_dies" in p.stdout, p.stdout[-3000:]
    assert "1 failed" in p.stdout, p.stdout[-3000:]

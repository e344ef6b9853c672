"""The install adds our own top-level names only: a user's ``models`` module must never be shadowed
by ours (the trainer lives in ``ciera_models``)."""

import importlib.metadata
import subprocess
import sys


def test_installed_top_level_names_are_our_own():
    top_level = importlib.metadata.distribution("ciera-jax").read_text("top_level.txt")
    assert set(top_level.split()) == {"ciera_jax", "ciera_models", "ciera_harness"}


def test_no_models_package_importable_outside_the_repository(tmp_path):
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('models') is not None)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=tmp_path).returncode == 0
    ours = "import ciera_models.cli.train"
    assert subprocess.run([sys.executable, "-c", ours], cwd=tmp_path).returncode == 0

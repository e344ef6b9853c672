"""The `ciera` command finds its subcommands through entry points, without starting JAX."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ciera_jax.cli.main import main

COMMANDS = ("aot", "calibrate", "demo", "plan", "simulate", "train")


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out, name


def test_building_the_whole_parser_imports_no_jax():
    code = ("import sys\n"
            "from ciera_jax.cli import main as cli\n"
            "cli.build_parser(cli.commands())\n"
            "assert 'jax' not in sys.modules and 'flax' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name", COMMANDS)
def test_command_module_imports_no_jax(name):
    """Building the parser imports every command module, so each must stay light."""
    code = ("import argparse, importlib.metadata, sys\n"
            "from ciera_jax.cli.main import GROUP\n"
            "mod = importlib.metadata.entry_points(group=GROUP)[%r].load()\n"
            "mod.add_arguments(argparse.ArgumentParser())\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'flax', 'optax', 'orbax'))\n"
            "assert not heavy, heavy[:10]\n" % (name,))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_library_package_names_load_on_first_use():
    import ciera_jax

    assert callable(ciera_jax.all_gather) and "all_gather" in dir(ciera_jax)
    with pytest.raises(AttributeError, match="no_such_name"):
        ciera_jax.no_such_name  # noqa: B018


def test_demo_is_bitwise_exact(capsys):
    assert main(["demo", "--devices", "4", "--steps", "3", "--shape", "8,32,16"]) == 0
    out = capsys.readouterr().out
    assert "bitwise exact on every rank: True" in out and "DIFFERS" not in out


@pytest.mark.parametrize("argv, says", [
    (["demo", "--devices", "0"], "--devices 0"),
    (["demo", "--devices", "4", "--shape", "6,32"], "first dimension must divide"),
    (["demo", "--shape", "8,x"], "--shape 8,x"),
])
def test_demo_bad_input_is_one_clear_line(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err

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


def test_train_help_shows_the_common_flags_before_the_advanced_ones(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    first_advanced = next(i for i, line in enumerate(lines) if line.startswith("advanced"))
    flags = [line.split()[0] for line in lines[:first_advanced]
             if line.startswith("  -")]
    assert 5 <= len(flags) <= 15, flags
    assert {"--config", "--gather", "--steps", "--resume", "--verbose"} <= {
        f.rstrip(",") for f in flags}
    later = [line.split()[0] for line in lines[first_advanced:] if line.startswith("  --")]
    assert {"--max-programs", "--program-patience", "--overflow-rungs", "--compile-beside",
            "--memory-limit", "--inject-crash", "--peer-timeout"} <= set(later)


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


def test_demo_shows_word_mode_by_default_and_exponent_mode_on_request(capsys):
    small = ["demo", "--devices", "4", "--steps", "3", "--shape", "8,32,16"]
    assert main(small) == 0
    out = capsys.readouterr().out
    assert out.startswith("word mode:") and "bitwise exact on every rank: True" in out
    assert "DIFFERS" not in out and "rung" not in out and "tier" not in out
    rows = out.splitlines()[2:-1]
    assert rows[0].split()[1:4] == ["plain", "(fills", "the"]  # the first gather fills it
    assert all(r.split()[1] == "words" for r in rows[1:]), rows
    assert main([*small, "--mode", "exponent"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("exponent mode:") and "bitwise exact on every rank: True" in out
    assert all(r.split()[1] == "exponents" for r in out.splitlines()[3:-1])


@pytest.mark.parametrize("argv, meant", [
    (["train", "--stpes", "5"], "--steps"),
    (["train", "--gather", "plain", "--batchsize", "8"], "--batch-size"),
    (["simulate", "--clsuter", "h100-ib400"], "--cluster"),
    (["plan", "--gpu", "8"], "--gpus"),
    (["plan", "--model", "tiny"], "--config"),
    (["demo", "--mdoe", "word"], "--mode"),
    (["aot", "--gpu-count", "3"], "--gpus"),
    (["calibrate", "--devcies=2"], "--devices"),
])
def test_a_mistyped_flag_gets_its_commands_usage_and_the_closest_flag(argv, meant, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: ciera {argv[0]} "), err[:200]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ciera {argv[0]}: error: unrecognized arguments: ")
    assert last.endswith(f"did you mean {meant}?"), last


def test_every_subcommand_suggests_a_flag_for_a_near_miss(capsys):
    """Each subcommand's parser is the one that answers: its first long flag, one letter off."""
    from ciera_jax.cli.main import build_parser, commands

    parser = build_parser(commands())
    subs = parser._subparsers._group_actions[0].choices
    assert set(subs) == set(COMMANDS)
    for name, sub in subs.items():
        flag = next(f for f in sub._option_string_actions if f.startswith("--")
                    and f != "--help")
        with pytest.raises(SystemExit):
            main([name, flag[:-1] + "q" + flag[-1]])
        err = capsys.readouterr().err
        assert err.startswith(f"usage: ciera {name} ") and f"did you mean {flag}?" in err, err


@pytest.mark.parametrize("argv, says", [
    (["demo", "--devices", "0"], "--devices 0"),
    (["demo", "--devices", "4", "--shape", "6,32"], "first dimension must divide"),
    (["demo", "--shape", "8,x"], "--shape 8,x"),
])
def test_demo_bad_input_is_one_clear_line(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err

"""The `ciera` command: one subcommand per module, found through package entry points.

A subcommand ``X`` lives in a module ``X_cli.py`` exposing ``add_arguments(parser)`` and
``run(args) -> int``; its docstring's first line is its help. It stays light to import (heavy
imports inside ``run``), because building this parser imports every subcommand module. Modules
register in ``pyproject.toml`` under ``[project.entry-points."ciera.commands"]``, so this
file names no implementation and the library never imports ``ciera_models/``. After adding one,
reinstall (``pip install -e .``) so the entry point is recorded.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import sys
from types import ModuleType

GROUP = "ciera.commands"
# Bad input from the user: a subcommand raising one of these ends in one line, exit 2.
BAD_INPUT = (ValueError, KeyError, FileNotFoundError, TypeError)
EXIT_BAD_INPUT = 2


def bad_input_line(command: str, e: BaseException, who: str = "") -> str:
    """The one line for bad input ``e`` to ``ciera <command>`` (``who``: " (process N)")."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    return f"ciera {command}{who}: error: {msg}"


# Flags another command (or a common tool) spells differently: suggested where the closest
# spelling is not close enough, and only when this command has the flag.
ALIASES = {"--model": "--config", "--gpu-count": "--gpus",
           "--num-gpus": "--gpus", "--n-gpus": "--gpus", "--num-devices": "--devices",
           "--device-count": "--devices", "--num-steps": "--steps", "--iters": "--steps",
           "--output": "--out", "--verbosity": "--verbose"}


def closest_flag(word: str, flags: list[str]) -> str | None:
    """The flag of ``flags`` that ``word`` (a mistyped flag) most likely meant, if any."""
    name = word.split("=", 1)[0]
    if ALIASES.get(name) in flags:
        return ALIASES[name]
    longs = [f for f in flags if f.startswith("--")]
    close = difflib.get_close_matches(name, longs, n=1, cutoff=0.6)
    return close[0] if close else None


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: what it does not know is an error of this command (its usage,
    exit 2) naming the closest flag it has, not of ``ciera``'s. No abbreviations: a flag is
    spelled out, so a mistyped one is never taken for another."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            flags = list(self._option_string_actions)
            hints = [f"did you mean {hint}?" for w in extras if w.startswith("-")
                     if (hint := closest_flag(w, flags))]
            self.error(f"unrecognized arguments: {' '.join(extras)}"
                       + ("; " + "; ".join(dict.fromkeys(hints)) if hints else ""))
        return ns, extras


def commands() -> dict[str, ModuleType]:
    """The installed subcommand modules by name, in name order."""
    eps = sorted(importlib.metadata.entry_points(group=GROUP), key=lambda ep: ep.name)
    if not eps:
        raise SystemExit(f"ciera: no subcommands registered under the {GROUP!r} entry points; "
                         "reinstall the package (pip install -e .)")
    return {ep.name: ep.load() for ep in eps}


def build_parser(mods: dict[str, ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ciera", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, mod in mods.items():
        p = sub.add_parser(name, help=(mod.__doc__ or name).strip().splitlines()[0])
        mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    mods = commands()
    args = build_parser(mods).parse_args(argv)
    try:
        return int(mods[args.command].run(args) or 0)
    except BAD_INPUT as e:  # one clear line, no traceback wall
        print(bad_input_line(args.command, e), file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

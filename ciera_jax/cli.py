"""The `ciera` command: one subcommand per module, imported only when it runs.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; its docstring's
first line is its help. Adding a command means adding one line to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": "ciera_jax.demo",
    "train": "models.train_cli",
    "plan": "ciera_jax.plan_cli",
    "calibrate": "ciera_jax.calibrate",
    "simulate": "ciera_jax.sim.cli",
}


def _available() -> dict[str, object]:
    mods = {}
    for name, path in SUBCOMMANDS.items():
        try:
            mods[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name and path.startswith(e.name):
                continue  # not built yet
            raise
    return mods


def main(argv: list[str] | None = None) -> int:
    mods = _available()
    parser = argparse.ArgumentParser(prog="ciera", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in mods.items():
        p = sub.add_parser(name, help=(mod.__doc__ or name).strip().splitlines()[0])
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(mods[args.command].run(args) or 0)
    except (ValueError, KeyError, FileNotFoundError, TypeError) as e:
        # Bad input from the user: one clear line, no traceback wall.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ciera {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Package names that load their module on first use, so importing a package (or building the
`ciera` parser) pulls in no JAX. Stdlib only."""

from __future__ import annotations

import importlib


def exports(package: str, table: dict[str, str], namespace: dict, old: dict[str, str] = None):
    """``(__getattr__, __dir__)`` for ``package`` whose names ``table`` maps to the modules
    defining them; a loaded name is cached in ``namespace`` (the package's globals). ``old``:
    names renamed, each to its new one (:func:`renamed`)."""
    missing = renamed(package, old or {})

    def __getattr__(name: str):
        if name not in table:
            return missing(name)
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__


def renamed(package: str, table: dict[str, str]):
    """A ``__getattr__`` for ``package`` whose old names ``table`` maps to their new ones: an
    old name raises ImportError naming the new one in one line (an AttributeError would reach
    ``from package import old`` as Python's own message, without the new name)."""

    def __getattr__(name: str):
        if name in table:
            raise ImportError(f"{package}.{name} is renamed: use {package}.{table[name]}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

"""Package names that load their module on first use, so importing a package (or building the
`ciera` parser) pulls in no JAX. Stdlib only."""

from __future__ import annotations

import importlib


def exports(package: str, table: dict[str, str], namespace: dict):
    """``(__getattr__, __dir__)`` for ``package`` whose names ``table`` maps to the modules
    defining them; a loaded name is cached in ``namespace`` (the package's globals)."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__

"""The engine decorated modules gather through, held in a context variable so their
signatures stay those of plain NNX modules."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

GATHER_MODES = ("ciera", "plain", "int8")

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("ciera_engine", default=None)


def check_mode(mode: str) -> str:
    if mode not in GATHER_MODES:
        raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
    return mode


def active_engine():
    """The :class:`~ciera_jax.fsdp.Engine` decorated calls use now (None: each call builds a
    default ``ciera`` one)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activate(engine):
    token = _ACTIVE.set(engine)
    try:
        yield engine
    finally:
        _ACTIVE.reset(token)

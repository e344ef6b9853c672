"""The engine gathering modules gather through, held in a context variable so their
signatures stay those of plain NNX modules.

A jitted step reads the engine while it is traced, so the engine's mode is also set in a JAX
user context (``jax.make_user_context``), which is part of ``jit``'s cache key: a step traced
under one gather mode and called under another is traced again, never silently run in the
mode it was first traced with."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax

GATHER_MODES = ("ciera", "plain", "int8")

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("ciera_engine", default=None)

# Part of jit's cache key (JAX >= 0.4.36 has make_user_context; both 0.10 and 0.11 do).
_JIT_KEY = jax.make_user_context(default_value=None)


def check_mode(mode: str) -> str:
    if mode not in GATHER_MODES:
        raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
    return mode


def active_engine():
    """The :class:`~ciera_jax.fsdp.Engine` gathering calls use now (None: each call builds a
    default ``ciera`` one)."""
    return _ACTIVE.get()


def jit_key():
    """The gather settings a step traced now depends on (what ``jit`` keys on)."""
    return _JIT_KEY.value


@contextlib.contextmanager
def activate(engine):
    token = _ACTIVE.set(engine)
    try:
        with _JIT_KEY(engine.jit_key()):
            yield engine
    finally:
        _ACTIVE.reset(token)

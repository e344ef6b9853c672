"""The ambient state decorated modules consult at call time: the gather mode (with its stats),
the pregathered flag and the active :class:`~ciera_jax.fsdp.Engine`. Context variables, so
the modules' signatures stay those of plain NNX modules."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from ciera_jax.fsdp.engine import Engine


GATHER_MODES = ("ciera", "plain", "int8")


@dataclasses.dataclass
class GatherContext:
    mode: str = "ciera"
    stats: dict[str, dict[str, jax.Array]] = dataclasses.field(default_factory=dict)


_CTX: contextvars.ContextVar[GatherContext | None] = contextvars.ContextVar("ciera_gather", default=None)


@contextlib.contextmanager
def gather_mode(mode: str = "ciera"):
    """Select the gather used by decorated modules and collect per-tensor stats.

    ``ciera``: exponent-reuse gather (lossless, compressed); ``plain``: all-gather of the bits
    (lossless baseline); ``int8``: blockwise absmax int8 gather (lossy baseline, ZeRO++ qwZ).
    Yields a :class:`GatherContext` whose ``stats`` maps parameter paths to stats dicts.
    """
    if mode not in GATHER_MODES:
        raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
    ctx = GatherContext(mode)
    token = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(token)


PREGATHERED = "pregathered"


@contextlib.contextmanager
def pregathered():
    """Decorated modules use the values they hold (already gathered by an :class:`Engine`):
    they cast them to the compute dtype and gather nothing."""
    token = _CTX.set(GatherContext(PREGATHERED))
    try:
        yield
    finally:
        _CTX.reset(token)


_ENGINE: contextvars.ContextVar["Engine | None"] = contextvars.ContextVar("ciera_engine",
                                                                         default=None)

"""Exponent-change and word-mode traces: moved to :mod:`ciera_jax.traces`, which the planner
reads too (the planner does not import the simulator). Every name stays importable from here."""

from ciera_jax.traces import (DATA, DEFAULT_TRACE, PHASES, WORD_DEFAULT, WORD_TRACE, Trace,
                              WordTrace, default_trace, default_word_trace, load_trace,
                              load_word_trace)

__all__ = ["DATA", "DEFAULT_TRACE", "PHASES", "WORD_DEFAULT", "WORD_TRACE", "Trace", "WordTrace",
           "default_trace", "default_word_trace", "load_trace", "load_word_trace"]

"""Trace-driven cluster simulator: one FSDP training step per GPU count and gather method.

cluster.py  the machine (GPUs per node, links, HBM, FLOP/s, MFU) and built-in H100/H200 clusters
step.py     per-layer compute and collectives, replayed as a two-stream (compute, comm) schedule

The traces it replays (exponent-change rates per tensor kind, word-mode bytes per weight per
phase) are :mod:`ciera_jax.planning.traces`, which the planner reads too; their names are
exported here as well, for the simulator's users.
(`ciera simulate` lives in ciera_jax/cli/simulate.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciera_jax.runtime import lazy

if TYPE_CHECKING:
    from ciera_jax.sim.cluster import Cluster, get_cluster
    from ciera_jax.sim.step import StepResult, simulate_gather, simulate_step, sweep
    from ciera_jax.planning.traces import (Trace, WordTrace, default_trace, default_word_trace,
                                           load_trace, load_word_trace)

# Loaded on first use: step.py pulls in the planner (JAX), and `ciera plan`'s parser only needs
# trace.py's phase names.
_EXPORTS = {
    "Cluster": "ciera_jax.sim.cluster", "get_cluster": "ciera_jax.sim.cluster",
    "StepResult": "ciera_jax.sim.step", "simulate_gather": "ciera_jax.sim.step",
    "simulate_step": "ciera_jax.sim.step", "sweep": "ciera_jax.sim.step",
    "Trace": "ciera_jax.planning.traces", "WordTrace": "ciera_jax.planning.traces",
    "default_trace": "ciera_jax.planning.traces", "default_word_trace": "ciera_jax.planning.traces",
    "load_trace": "ciera_jax.planning.traces", "load_word_trace": "ciera_jax.planning.traces",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS, globals())

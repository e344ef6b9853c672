"""Trace-driven cluster simulator: one FSDP training step per GPU count and gather method.

cluster.py  the machine (GPUs per node, links, HBM, FLOP/s, MFU) and built-in H100/H200 clusters
trace.py    re-exports ciera_jax.traces (exponent-change rates per tensor kind, word-mode bytes
            per weight per phase), which lives below the planner so the planner needs no sim
step.py     per-layer compute and collectives, replayed as a two-stream (compute, comm) schedule
(`ciera simulate` lives in ciera_jax/simulate_cli.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciera_jax import lazy

if TYPE_CHECKING:
    from ciera_jax.sim.cluster import Cluster, get_cluster
    from ciera_jax.sim.step import StepResult, simulate_gather, simulate_step, sweep
    from ciera_jax.sim.trace import (Trace, WordTrace, default_trace, default_word_trace,
                                     load_trace, load_word_trace)

# Loaded on first use: step.py pulls in the planner (JAX), and `ciera plan`'s parser only needs
# trace.py's phase names.
_EXPORTS = {
    "Cluster": "ciera_jax.sim.cluster", "get_cluster": "ciera_jax.sim.cluster",
    "StepResult": "ciera_jax.sim.step", "simulate_gather": "ciera_jax.sim.step",
    "simulate_step": "ciera_jax.sim.step", "sweep": "ciera_jax.sim.step",
    "Trace": "ciera_jax.sim.trace", "WordTrace": "ciera_jax.sim.trace",
    "default_trace": "ciera_jax.sim.trace", "default_word_trace": "ciera_jax.sim.trace",
    "load_trace": "ciera_jax.sim.trace", "load_word_trace": "ciera_jax.sim.trace",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS, globals())

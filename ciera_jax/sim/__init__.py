"""Trace-driven cluster simulator: one FSDP training step per GPU count and gather method.

cluster.py  the machine (GPUs per node, links, HBM, FLOP/s, MFU) and built-in H100/H200 clusters
trace.py    exponent-change rates per tensor kind (default trace, stability-study JSON, train JSONL)
            and word-mode bytes per weight per phase (word trace)
step.py     per-layer compute and collectives, replayed as a two-stream (compute, comm) schedule
(`ciera simulate` lives in ciera_jax/simulate_cli.py)
"""

from ciera_jax.sim.cluster import Cluster, get_cluster
from ciera_jax.sim.step import StepResult, simulate_gather, simulate_step, sweep
from ciera_jax.sim.trace import (Trace, WordTrace, default_trace, default_word_trace, load_trace,
                                 load_word_trace)

__all__ = ["Cluster", "get_cluster", "StepResult", "simulate_gather", "simulate_step", "sweep",
           "Trace", "default_trace", "load_trace", "WordTrace", "default_word_trace",
           "load_word_trace"]

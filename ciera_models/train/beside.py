"""Step programs compiled beside the steps (``--compile-beside``), taken once every process has one.

A compressed step's program compiles for seconds (CPU) to minutes (a GPU pod) longer than
plain's. With programs compiled beside, the trainer runs a program it already has while the
one the rung policy asked for compiles in a thread: the first step runs the priming program
(every gather plain, caches filled from it: about plain's compile), later ones the cheapest
compiled program for their demand. All programs compute the same step, bit for bit; only the
bytes sent differ.

Every process must run the same program each step, and each finishes its compiles at its own
time: a program is taken at the first step where it has compiled on every process (one tiny
agreement per step while a compile is pending, none otherwise).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

import jax

from ciera_models.resilience.preemption import agree


def abstract_like(tree):
    """``tree``'s arrays as shapes, dtypes and shardings: what a compile needs of a step's
    arguments, kept after the step has donated the arrays themselves."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type)
        if isinstance(a, jax.Array) else a, tree)


def in_thread(compile_fn: Callable[[], object], name: str) -> concurrent.futures.Future:
    """``compile_fn()`` in a thread of its own: a Future of ``(its result, its seconds)``.
    XLA lets go of Python while it compiles, so what the caller does meanwhile runs beside
    it; a process that ends first waits for it at exit (Python joins the thread)."""
    def timed():
        t0 = time.perf_counter()
        return compile_fn(), time.perf_counter() - t0

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
    future = pool.submit(timed)
    pool.shutdown(wait=False)
    return future


class CompilesBeside:
    """The programs compiling in threads: ``{key: Future[(compiled, seconds)]}``, in the order
    they were started (the same on every process: the rung policy is deterministic)."""

    def __init__(self):
        self.pending: dict = {}

    def __contains__(self, key) -> bool:
        return key in self.pending

    def start(self, key, compile_fn: Callable[[], object]) -> None:
        """Compile ``key``'s program (``compile_fn`` lowers and compiles) :func:`in_thread`,
        beside the steps."""
        self.pending[key] = in_thread(compile_fn, "ciera-step-compile")

    def still_compiling(self) -> int:
        """How many are still compiling on this process (a process ends only after them)."""
        return sum(not f.done() for f in self.pending.values())

    def take_ready(self) -> dict:
        """``{key: (compiled, seconds)}`` of the programs compiled on every process, no longer
        pending. A compile that failed raises here, on the process it failed on."""
        if not self.pending:
            return {}
        waiting = agree(*(not f.done() for f in self.pending.values()))
        ready = [k for k, w in zip(list(self.pending), waiting) if not w]
        return {k: self.pending.pop(k).result() for k in ready}

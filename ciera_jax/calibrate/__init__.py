"""Measure alpha, beta, codec rate and agreement on this mesh and build a cost-model profile.

``ciera calibrate`` (:mod:`ciera_jax.cli.calibrate`) runs it. The modules, one concern each:

defaults.py  what is measured when the caller does not say (sizes per platform)
kit.py       the gather timing kit: weight pairs with controlled exponent churn, jitted gathers,
             interleaved timing (also used by the gather benchmarks and the simulator tests)
measure.py   calibration's measurements: plain gathers, the codec, CIERA's overhead beyond the
             wire, the agreement, the memory rate
fit.py       the fits: ring model ``t = (N-1)*alpha + (N-1)/N * bytes/beta``, host rates, lines
host.py      the host's last-level cache and cores (sysfs, affinity)
profile.py   :func:`calibrate`: measure, fit, return a :class:`~ciera_jax.planning.links.Profile`

What is measured (every figure a median of interleaved repetitions of one jitted call):

* ``alpha_s``, ``beta_Bps``: plain all-gathers of the bits (the lossless baseline, uint16 view
  of bf16) on sub-meshes of 2, 4, ... devices and several sizes, fitted to the ring model by
  least squares on relative error. The fit has no intercept, so the fixed cost of one call
  (dispatch, rendezvous) lands in ``alpha``, which is what a planner comparing whole gathers
  needs.
* ``codec_Bps``, ``codec_launch_s``: what the compressed path costs beyond moving its bytes,
  end to end: CIERA gathers (churn 0, primed cache) at two or more sizes, less the ring model's
  time for their wire bytes and the agreement; the rate is the slope, the launch the intercept.
  The kernels alone (encode of each rank's shard + decode of the full tensor on every rank at
  once) are timed too and reported in the source. On one device (no gather) the kernels' rate
  is the value.
* ``fault_Bps``, ``fresh_from_bytes``, ``fresh_per_byte``, ``spill_Bps`` (CPU only): plain
  gathers on the full mesh at sizes across glibc's mmap threshold and the last-level cache
  (:data:`.defaults.CPU_FAULT_SIZES`), each with the fresh memory it faulted in per call (minor
  faults x page size, ``getrusage``) and its bytes copied from memory once its working set
  exceeds the cache (``llc_bytes`` from sysfs, ``host_cores`` from the affinity: the cost
  model's ``spill_bytes``). alpha and beta come from
  the gathers that did neither; one least-squares fit of ``t - ring(alpha, beta) = fresh_bytes /
  fault_Bps + spill_bytes / spill_Bps`` over every plain gather gives the two host rates, and a
  hinge of fresh bytes against size the fresh rule. On a GPU all of them stay 0 (pooled device
  buffers, no host copies).
* ``agreement_s``: one ``pmax`` of an int32 vector (one count per layer), less an empty call.
* ``hbm_Bps``: ``w ^ salt`` over a full-tensor-sized buffer on every rank at once.

``entropy_Bps`` is not measured: it is carried over from the built-in profile of this platform,
and its source says so.

The names below load on first use, so ``ciera --help`` can read :mod:`.defaults` without
starting JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciera_jax.runtime import lazy

if TYPE_CHECKING:
    from ciera_jax.calibrate.kit import (CieraStepper, gather_fns, measure_gathers,
                                         time_interleaved, weight_pair)
    from ciera_jax.calibrate.profile import calibrate, profile_table
    from ciera_jax.runtime.devices import make_mesh

_EXPORTS = {
    "calibrate": "ciera_jax.calibrate.profile",
    "profile_table": "ciera_jax.calibrate.profile",
    "CieraStepper": "ciera_jax.calibrate.kit",
    "gather_fns": "ciera_jax.calibrate.kit",
    "measure_gathers": "ciera_jax.calibrate.kit",
    "time_interleaved": "ciera_jax.calibrate.kit",
    "weight_pair": "ciera_jax.calibrate.kit",
    "make_mesh": "ciera_jax.runtime.devices",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS, globals())

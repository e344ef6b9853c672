"""Calibration's measurements on the current devices, each a median of jitted calls.

Each function returns raw timings (rows of bytes and seconds); :mod:`.fit` turns them into
profile values.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax import kernels
from ciera_jax.codec import bitfields
from ciera_jax.planning import costmodel as cm
from ciera_jax.calibrate.kit import (CieraStepper, gather_fns, jit_shard_map, measure_gathers,
                                     median, median_call, replicated_cache, time_interleaved,
                                     weight_pair, word_pair)
from ciera_jax.runtime.devices import make_mesh
from ciera_jax.runtime.partition import AXIS
from ciera_jax.runtime.units import fmt_bytes


def n_elements(size: int, N: int) -> int:
    """bf16 elements of a ``size``-byte tensor, rounded to a multiple of ``N`` (at least N)."""
    return max(N, (size // 2) // N * N)


def empty_call_s(mesh, reps: int = 15) -> float:
    """One jitted shard_map call that does (almost) nothing: the fixed cost of any call."""
    N = mesh.devices.size
    x = jax.device_put(jnp.zeros((N,), jnp.int32), NamedSharding(mesh, P(AXIS)))
    f = jit_shard_map(lambda v: v + 1, mesh, (P(AXIS),), P(AXIS))
    return median_call(f, x, reps=reps)


def measure_plain_gathers(mesh_sizes: Sequence[int], sizes: Sequence[int], reps: int,
                          log=None) -> list[dict]:
    """Plain (bits) gathers of 1-D bf16 tensors of ``sizes`` full bytes on each sub-mesh."""
    recs = []
    for N in mesh_sizes:
        mesh = make_mesh(N)
        fns = gather_fns(mesh, 1, 0)
        for size in sizes:
            r = measure_gathers(mesh, (n_elements(size, N),), 0, 0.0, ("plain",), reps=reps,
                                dtype=jnp.bfloat16, fns=fns)[0]
            recs.append(r)
            if log:
                log(f"  gather N={N} {fmt_bytes(r['n_bytes']):>9}: {r['seconds'] * 1e3:8.3f} ms"
                    f" (fresh memory {fmt_bytes(int(r['fresh_bytes']))} per call)")
    return recs


def measure_codec(mesh, sizes: Sequence[int], reps: int, log=None) -> list[dict]:
    """Encode of the local shard + decode of the full tensor on every rank at once: one row of
    ``n_bytes`` (full bf16 tensor) and ``seconds`` per size."""
    N = mesh.devices.size
    rows = []
    for size in sizes:
        n = n_elements(size, N)
        xa, xb = weight_pair(mesh, (n,), 0, 0.01)
        rep = NamedSharding(mesh, P())
        exp_full = jax.jit(bitfields.exponent, out_shardings=rep)(xa)
        payload_full = jax.jit(lambda x: bitfields.split(x)[1], out_shardings=rep)(xa)

        def body(x, exp_full, payload_full):
            s = x.shape[0]
            cached = lax.dynamic_slice_in_dim(exp_full, lax.axis_index(AXIS) * s, s)
            exp, payload, changed = kernels.encode(x, cached)
            full = kernels.decode(exp_full, payload_full, x.dtype)
            return full[None], exp[None], payload[None], jnp.sum(changed)[None]

        f = jit_shard_map(body, mesh, (P(AXIS), P(), P()), (P(AXIS),) * 4)
        t = median_call(f, xb, exp_full, payload_full, reps=reps)
        rows.append(dict(n_bytes=2 * n, seconds=t))
        if log:
            log(f"  codec N={N} {fmt_bytes(2 * n):>9}: {t * 1e3:8.3f} ms "
                f"({2 * n / t / 1e9:.3g} GB/s)")
    return rows


def measure_ciera_overhead(mesh, sizes: Sequence[int], reps: int, alpha: float, beta: float,
                           agreement: float, log=None) -> list[dict]:
    """CIERA gathers at churn 0, and ``extra_s``: their time less the ring model's time for
    their wire bytes and the agreement, i.e. what the compressed path costs beyond moving
    bytes."""
    N = mesh.devices.size
    rows = []
    for size in sizes:
        r = measure_gathers(mesh, (n_elements(size, N),), 0, 0.0, ("ciera",), reps=reps)[0]
        wire = r["stats"]["sent_bytes"] * N
        extra = r["seconds"] - cm.ring_allgather_time(wire, N, alpha, beta) - agreement
        rows.append(dict(n_bytes=r["n_bytes"], seconds=r["seconds"], extra_s=extra))
        if log:
            log(f"  ciera N={N} {fmt_bytes(r['n_bytes']):>9}: {r['seconds'] * 1e3:8.3f} ms "
                f"(beyond the wire: {extra * 1e3:.3f} ms)")
    return rows


def measure_escape_cost(mesh, size: int, churn: float, reps: int, alpha: float, beta: float,
                        agreement: float, base_extra_s: float, log=None) -> dict:
    """Exponent-mode gathers at ``churn`` of ``size`` bytes: ``escape_s``, what each escaped
    exponent of the full tensor adds beyond the wire (``base_extra_s``: the same size at churn
    0), i.e. the sender's pack and every receiver's fill walking the escapes."""
    N = mesh.devices.size
    r = measure_gathers(mesh, (n_elements(size, N),), 0, churn, ("ciera",), reps=reps)[0]
    wire = r["stats"]["sent_bytes"] * N
    extra = r["seconds"] - cm.ring_allgather_time(wire, N, alpha, beta) - agreement
    escapes = N * r["stats"]["changed"]
    escape_s = max(extra - base_extra_s, 0.0) / max(escapes, 1)
    if log:
        log(f"  escapes N={N} {fmt_bytes(r['n_bytes']):>9} at {churn:.0%}: "
            f"{r['seconds'] * 1e3:8.3f} ms ({escape_s * 1e9:.2f} ns per escape)")
    return dict(n_bytes=r["n_bytes"], seconds=r["seconds"], extra_s=extra, escapes=escapes,
                escape_s=escape_s, rung=r["stats"]["rung"], fallback=bool(r["stats"]["fallback"]))


def measure_word_overhead(mesh, sizes: Sequence[int], reps: int, alpha: float, beta: float,
                          agreement: float, log=None) -> list[dict]:
    """Word-mode gathers in steady state (:func:`~ciera_jax.calibrate.kit.word_pair`: the
    measured word moves, escapes included) and their time beyond the wire and agreement."""
    N = mesh.devices.size
    fn = gather_fns(mesh, 1, 0)["ciera"]
    rows = []
    for size in sizes:
        shape = (n_elements(size, N),)
        xa, xb = word_pair(mesh, shape, 0)
        step = CieraStepper(fn, xa, xb, replicated_cache(mesh, shape, jnp.bfloat16, "word"))
        t = median(time_interleaved({"word": step}, reps=reps)["word"])
        stats = step.stats()
        wire = stats["sent_bytes"] * N
        extra = t - cm.ring_allgather_time(wire, N, alpha, beta) - agreement
        rows.append(dict(n_bytes=2 * shape[0], seconds=t, extra_s=extra,
                         fallback=bool(stats["fallback"]),
                         wire_ratio=stats["sent_bytes"] / stats["plain_bytes"]))
        if log:
            log(f"  word N={N} {fmt_bytes(2 * shape[0]):>9}: {t * 1e3:8.3f} ms "
                f"(beyond the wire: {extra * 1e3:.3f} ms)")
    return rows


def measure_agreement(mesh, reps: int, empty_s: float, layers: int = 64) -> float:
    """One ``pmax`` of ``layers`` int32 counts per rank, less one empty call."""
    N = mesh.devices.size
    x = jax.device_put(jnp.arange(N * layers, dtype=jnp.int32), NamedSharding(mesh, P(AXIS)))
    f = jit_shard_map(lambda v: lax.pmax(v, AXIS), mesh, (P(AXIS),), P(AXIS))
    return max(median_call(f, x, reps=reps) - empty_s, 1e-6)


def measure_hbm(mesh, size: int, reps: int, empty_s: float) -> float:
    """Bytes/s of ``w ^ salt`` over ``size`` bytes on every rank at once."""
    N = mesh.devices.size
    n = max(1, size // 2)
    w = jax.device_put(jnp.zeros((N, n), jnp.uint16), NamedSharding(mesh, P(AXIS)))
    f = jit_shard_map(lambda w, s: w ^ s, mesh, (P(AXIS), P()), P(AXIS))
    t = median_call(f, w, jnp.uint16(1), reps=reps)
    return 2 * n / max(t - empty_s, t * 0.1)

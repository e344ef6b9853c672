"""One process of benchmarks/gather_multiprocess.py: times plain-bits and CIERA gathers.

Started by the launcher (``ciera_jax.runtime.launch.run_local`` or ``ciera_jax.runtime.netns.run_in_namespaces``)
as ``python -m mp_gather_bench_worker SPEC_JSON`` with ``benchmarks/`` on PYTHONPATH. SPEC_JSON:
``{"shapes": [[E, 2048, 1024], ...], "axis": 1, "churn": [0.0, 0.01], "reps": 5, "warmup": 2,
"methods": ["plain", "ciera", "checksum", "ciera_checked"], "word_shapes": [[4, 2048, 1024]]}``
(methods as in gather_bench.py). ``word_shapes``: tensors timed as plain bits, exponent mode
and word mode on a weight pair whose words differ by moves drawn from the measured steady-state
distribution (:func:`word_pair`). Prints one line ``RESULT <json>`` with this process's records.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
import time

# P(|d| <= k) at steady state, small 1e-3 (shared/studies/word_delta/report.md): |d| in ulps.
STEADY_CDF = ((0, 0.43), (1, 0.74), (3, 0.88), (7, 0.94), (127, 0.997))
RAW_MAX = 4096  # |d| of the remaining 0.3%: up to 32 binades of bf16 ulps


def word_pair(mesh, shape, axis: int, seed: int = 0):
    """``(xa, xb)`` bf16 on the devices: xa ~ normal(0, 0.02), xb = xa with every word moved
    by d ulps (in the monotone order), |d| drawn from :data:`STEADY_CDF` (uniform inside each
    band), random sign. Alternating them is word mode's steady state."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from ciera_jax.codec import bitfields, wordcodec
    from ciera_jax.fsdp import spec_for

    sharding = NamedSharding(mesh, spec_for(axis, len(shape)))
    edges = [0] + [k for k, _ in STEADY_CDF] + [RAW_MAX]
    cdf = [p for _, p in STEADY_CDF] + [1.0]

    @functools.partial(jax.jit, out_shardings=(sharding, sharding))
    def gen():
        k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
        xa = (0.02 * jax.random.normal(k1, shape, jnp.float32)).astype(jnp.bfloat16)
        band = jnp.searchsorted(jnp.asarray(cdf), jax.random.uniform(k2, shape))
        lo = jnp.asarray([0] + [e + 1 for e in edges[1:-1]])[band]
        hi = jnp.asarray([0] + edges[2:])[band]
        mag = lo + jnp.floor(jax.random.uniform(k3, shape) * (hi - lo + 1)).astype(jnp.int32)
        d = jnp.where(jax.random.bernoulli(k4, 0.5, shape), mag, -mag)
        bits = wordcodec.apply_delta(bitfields.to_bits(xa), d)
        return xa, bitfields.from_bits(bits, jnp.bfloat16)

    return gen()


def measure_modes(mesh, shape, axis: int, reps: int, warmup: int) -> list[dict]:
    """Plain bits, exponent mode and word mode on :func:`word_pair`, timed interleaved."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ciera_jax
    from ciera_jax.calibrate.kit import (AXIS, CieraStepper, gather_fns, jit_shard_map,
                                         time_interleaved)
    from ciera_jax.fsdp import spec_for

    keys = ("sent_bytes", "plain_bytes", "agreed_changed", "tier", "mode", "code_bits")
    spec = spec_for(axis, len(shape))

    def ciera(x, c):
        full, c, s = ciera_jax.all_gather(x, c, AXIS, axis=axis)
        return full[None], c, {k: s[k][None] for k in keys}

    fns = {"plain": gather_fns(mesh, len(shape), axis)["plain"],
           "ciera": jit_shard_map(ciera, mesh, (spec, P()), (P(AXIS), P(), P(AXIS)))}
    xa, xb = word_pair(mesh, shape, axis)
    cache = {m: jax.jit(functools.partial(ciera_jax.init_cache, shape, jnp.bfloat16, m),
                        out_shardings=NamedSharding(mesh, P()))() for m in ("exponent", "word")}
    calls = {"plain": functools.partial(fns["plain"], xa),
             "exponent": CieraStepper(fns["ciera"], xa, xb, cache["exponent"]),
             "word": CieraStepper(fns["ciera"], xa, xb, cache["word"])}
    times = time_interleaved(calls, reps=reps, warmup=warmup)
    N, n_bytes = mesh.devices.size, math.prod(shape) * 2
    recs = []
    for m, ts in times.items():
        rec = dict(series="word_delta", method=m, n_bytes=n_bytes, N=N, shape=list(shape),
                   axis=axis, seconds=statistics.median(ts), times=ts, wire_ratio=1.0)
        if m != "plain":
            st = calls[m].stats()
            rec.update(stats=st, wire_ratio=st["sent_bytes"] / st["plain_bytes"])
        recs.append(rec)
    return recs


def main(spec: dict) -> None:
    from ciera_jax.runtime.netns import apply_gloo_hostname

    apply_gloo_hostname()  # only in a namespace run; before the CPU backend starts
    from ciera_jax.runtime.launch import init_from_env

    t0 = time.perf_counter()
    pid = init_from_env()
    import jax

    from ciera_jax.calibrate.kit import gather_fns
    from ciera_jax.runtime.devices import make_mesh
    from gather_bench import checksum_fns, measure_all  # benchmarks/, on PYTHONPATH

    mesh = make_mesh(None)
    axis = spec["axis"]
    methods = spec.get("methods", ("plain", "ciera"))
    recs = []
    for shape in spec["shapes"]:
        shape = tuple(shape)
        fns = {**gather_fns(mesh, len(shape), axis), **checksum_fns(mesh, len(shape), axis)}
        for churn in spec["churn"]:
            for r in measure_all(mesh, shape, axis, churn, fns, methods, spec["reps"],
                                 spec["warmup"]):
                recs.append(r)
                print(f"process {pid} {shape} churn {churn} {r['method']} "
                      f"{r['seconds'] * 1e3:.2f} ms", flush=True)
    for shape in spec.get("word_shapes", []):
        for r in measure_modes(mesh, tuple(shape), axis, spec["reps"], spec["warmup"]):
            recs.append(r)
            print(f"process {pid} {tuple(shape)} word deltas {r['method']} "
                  f"{r['seconds'] * 1e3:.2f} ms wire {r['wire_ratio']:.3f}", flush=True)
    print("RESULT " + json.dumps(dict(process=pid, devices=jax.device_count(),
                                      local_devices=jax.local_device_count(),
                                      seconds=time.perf_counter() - t0, records=recs)),
          flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

"""One process of benchmarks/gather_multiprocess.py: times plain-bits and CIERA gathers.

Started by the launcher (``ciera_harness.launch.run_local`` or ``ciera_harness.netns.run_in_namespaces``)
as ``python -m mp_gather_bench_worker SPEC_JSON`` with ``benchmarks/`` on PYTHONPATH. SPEC_JSON:
``{"shapes": [[E, 2048, 1024], ...], "axis": 1, "churn": [0.0, 0.01], "reps": 5, "warmup": 2,
"methods": ["plain", "ciera", "checksum", "ciera_checked"], "word_shapes": [[4, 2048, 1024]],
"links": ["1gbit", ...], "link_sizes": ["256K", "1M", "4M"], "calibrate": true,
"passes_mb": 16}`` (methods as in gather_bench.py). ``word_shapes``: tensors timed as plain
bits, exponent mode and word mode on a weight pair whose words differ by moves drawn from the
measured steady-state distribution (:func:`ciera_jax.calibrate.kit.word_pair`).

In a namespace run every process first (``calibrate``) unshapes its link and runs
``ciera_jax.calibrate.calibrate`` on the whole mesh (what ``ciera calibrate`` measures, over
these sockets), then times each codec pass alone at ``passes_mb`` (``kernel_throughput``),
then for each of ``links`` reshapes its own link to that rate (``netns.set_own_rate``), waits
for the others, fits the link's alpha and beta from plain gathers of ``link_sizes`` (the
calibration's own fit) and times the series; every record carries its link. One launch (one
compile) serves every rate. Prints one line ``RESULT <json>`` with this process's records.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import time


LINK_FIT_REPS = 3  # plain gathers per fit size (the largest is 2x the series' tensor)
CALIBRATE_SIZES = ("64K", "1M", "8M")  # the calibration's own gather fit (unshaped sockets)


@functools.lru_cache(maxsize=None)
def mode_fns(mesh, ndim: int, axis: int) -> dict:
    """The word series' jitted gathers (plain bits; CIERA, whose cache picks the mode), built
    once per launch so every rate reuses their compilations."""
    from jax.sharding import PartitionSpec as P

    import ciera_jax
    from ciera_jax.calibrate.kit import AXIS, gather_fns, jit_shard_map
    from ciera_jax.fsdp import spec_for

    keys = ("sent_bytes", "plain_bytes", "agreed_changed", "rung", "mode", "code_bits")
    spec = spec_for(axis, ndim)

    def ciera(x, c):
        full, c, s = ciera_jax.all_gather(x, c, AXIS, axis=axis)
        return full[None], c, {k: s[k][None] for k in keys}

    return {"plain": gather_fns(mesh, ndim, axis)["plain"],
            "ciera": jit_shard_map(ciera, mesh, (spec, P()), (P(AXIS), P(), P(AXIS)))}


@functools.lru_cache(maxsize=None)
def churn_fns(mesh, ndim: int, axis: int) -> dict:
    """The churn series' jitted gathers and checksums, built once per launch."""
    from ciera_jax.calibrate.kit import gather_fns
    from gather_bench import checksum_fns  # benchmarks/, on PYTHONPATH

    return {**gather_fns(mesh, ndim, axis), **checksum_fns(mesh, ndim, axis)}


def barrier(spec: dict):
    """What runs untimed before each timed gather of a series (``"sync": true``): a barrier
    of every process, so no gather's time holds its peers still finishing the one before
    (another mode's codec); None: no barrier."""
    if not spec.get("sync"):
        return None
    from jax.experimental import multihost_utils

    return functools.partial(multihost_utils.sync_global_devices, "timed call")


def measure_modes(mesh, shape, axis: int, reps: int, warmup: int, sync=None) -> list[dict]:
    """Plain bits, exponent mode and word mode on :func:`word_pair`, timed interleaved."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ciera_jax
    from ciera_jax.calibrate.kit import CieraStepper, time_interleaved, word_pair

    fns = mode_fns(mesh, len(shape), axis)
    xa, xb = word_pair(mesh, shape, axis)
    cache = {m: jax.jit(functools.partial(ciera_jax.init_cache, shape, jnp.bfloat16, m),
                        out_shardings=NamedSharding(mesh, P()))() for m in ("exponent", "word")}
    calls = {"plain": functools.partial(fns["plain"], xa),
             "exponent": CieraStepper(fns["ciera"], xa, xb, cache["exponent"]),
             "word": CieraStepper(fns["ciera"], xa, xb, cache["word"])}
    fresh: dict = {}
    times = time_interleaved(calls, reps=reps, warmup=warmup, fresh=fresh, sync=sync)
    N, n_bytes = mesh.devices.size, math.prod(shape) * 2
    recs = []
    for m, ts in times.items():
        rec = dict(series="word_delta", method=m, n_bytes=n_bytes, N=N, shape=list(shape),
                   axis=axis, seconds=statistics.median(ts), times=ts, wire_ratio=1.0,
                   fresh_bytes=statistics.median(fresh[m]))
        if m != "plain":
            st = calls[m].stats()
            rec.update(stats=st, wire_ratio=st["sent_bytes"] / st["plain_bytes"])
        recs.append(rec)
    return recs


def series(mesh, spec: dict, pid: int, link: str) -> list[dict]:
    """The churn series and the word-delta series at the current link, records tagged."""
    from gather_bench import measure_all  # benchmarks/, on PYTHONPATH

    axis = spec["axis"]
    methods = spec.get("methods", ("plain", "ciera"))
    recs = []
    for shape in spec["shapes"]:
        shape = tuple(shape)
        fns = churn_fns(mesh, len(shape), axis)
        for churn in spec["churn"]:
            for r in measure_all(mesh, shape, axis, churn, fns, methods, spec["reps"],
                                 spec["warmup"], sync=barrier(spec)):
                recs.append(dict(r, link=link))
                print(f"process {pid} {link} {shape} churn {churn} {r['method']} "
                      f"{r['seconds'] * 1e3:.2f} ms", flush=True)
    for shape in spec.get("word_shapes", []):
        for r in measure_modes(mesh, tuple(shape), axis, spec["reps"], spec["warmup"],
                               sync=barrier(spec)):
            recs.append(dict(r, link=link))
            print(f"process {pid} {link} {tuple(shape)} word deltas {r['method']} "
                  f"{r['seconds'] * 1e3:.2f} ms wire {r['wire_ratio']:.3f}", flush=True)
    return recs


def link_fit(mesh, sizes, reps: int) -> dict:
    """alpha and beta of the current link: plain gathers of ``sizes``, the calibration's fit
    (here without the host's faults; ``sweep_report`` refits with the calibrated fault rate
    from every process's gathers, their fresh bytes included)."""
    from ciera_jax.calibrate.fit import fit_alpha_beta
    from ciera_jax.calibrate.measure import measure_plain_gathers
    from ciera_jax.runtime.units import parse_size

    recs = measure_plain_gathers([mesh.devices.size], [parse_size(s) for s in sizes],
                                 min(reps, LINK_FIT_REPS))
    alpha, beta = fit_alpha_beta(recs)
    return dict(alpha_s=alpha, beta_Bps=beta,
                gathers=[dict(n_bytes=r["n_bytes"], seconds=r["seconds"],
                              fresh_bytes=r["fresh_bytes"]) for r in recs])


def passes(mb: float, reps: int) -> list[dict]:
    """Each codec pass alone on this process's device (kernel_throughput's rows, xla)."""
    from kernel_throughput import bench_one  # benchmarks/, on PYTHONPATH

    return bench_one("bf16", mb, ["xla"], ("exponent", "word"), reps)


def calibration(mesh, pid: int, reps: int) -> dict:
    """``ciera_jax.calibrate.calibrate`` on the whole mesh (every process's device; no
    sub-mesh, which would leave some processes out): the profile's fields."""
    import dataclasses

    from ciera_jax.calibrate import calibrate

    def log(line):
        if pid == 0:
            print(line, flush=True)

    prof, details = calibrate([mesh.devices.size], CALIBRATE_SIZES, reps=reps, name="sockets",
                              log=log)
    return dict(profile=dataclasses.asdict(prof),
                details={k: v for k, v in details.items() if k != "gathers"})


def main(spec: dict) -> None:
    from ciera_harness import netns

    netns.apply_gloo_hostname()  # only in a namespace run; before the CPU backend starts
    from ciera_harness.launch import init_from_env

    t0 = time.perf_counter()
    pid = init_from_env()
    import jax
    from jax.experimental import multihost_utils

    from ciera_jax.runtime.devices import make_mesh

    mesh = make_mesh(None)
    shaped = "CIERA_NETNS_HUB" in os.environ
    out = dict(process=pid, devices=jax.device_count(), local_devices=jax.local_device_count())
    if spec.get("calibrate"):
        if shaped:
            netns.set_own_rate(None)
        multihost_utils.sync_global_devices("calibrate")
        out["calibration"] = calibration(mesh, pid, spec.get("calibrate_reps", 5))
        if spec.get("passes_mb"):
            out["passes"] = passes(spec["passes_mb"], spec.get("calibrate_reps", 5))
    recs, links = [], {}
    for link in spec.get("links", ["loopback"]):
        if shaped:
            netns.set_own_rate(None if link == "veth" else link)
        multihost_utils.sync_global_devices(f"link {link}")
        t_link = time.perf_counter()
        if spec.get("link_sizes"):
            links[link] = link_fit(mesh, spec["link_sizes"], spec["reps"])
        recs += series(mesh, spec, pid, link)
        links.setdefault(link, {})["seconds"] = time.perf_counter() - t_link
    print("RESULT " + json.dumps(dict(out, seconds=time.perf_counter() - t0, links=links,
                                      records=recs)), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

"""Where a gather's time goes on one device: its kernels, from JAX's profiler.

The one-GPU gather's codec takes several times a copy on an H100 and an H200 (docs/results.md,
section 4, "The GPU runs") while its kernels, timed alone, add to well under that. This traces a
few steady gathers (exponent and word caches, and plain's) under ``jax.profiler.trace`` and
reads the trace's device events: the kernels each call launches, their summed time, and the
wall time per call that no kernel covers (launch gaps, host work, synchronization).

    python benchmarks/gather_profile.py                      # on a GPU: its device events
    python benchmarks/gather_profile.py --devices 1 --events host   # a CPU dry run (XLA ops)
"""

from __future__ import annotations

import collections
import gzip
import json
import tempfile
import time
from pathlib import Path

from common import parser, write_results  # benchmarks/common.py, beside this script

SHAPE = (16, 2048, 1024)  # 64 MB of bf16: an OLMoE-like expert tensor, gathered on axis 1
AXIS_GATHERED = 1


def parse_args(argv=None):
    p = parser(__doc__, "gather_profile")
    p.add_argument("--shape", type=int, nargs="+", default=list(SHAPE))
    p.add_argument("--churn", type=float, default=0.01, help="exponent changes per step")
    p.add_argument("--reps", type=int, default=5, help="gathers traced per method")
    p.add_argument("--devices", type=int, default=None, help="emulated CPU devices (CPU only)")
    p.add_argument("--events", choices=("device", "host"), default="device",
                   help="device: the accelerator's kernels (a GPU's); host: the host's XLA "
                        "ops (a CPU dry run: there are no device events)")
    p.add_argument("--top", type=int, default=15, help="kernels listed per method")
    return p.parse_args(argv)


def kernel_times(trace: dict, events: str) -> dict:
    """``{name: [count, microseconds]}`` of the complete events ("X") on the trace's device
    processes (``events="device"``: process names with ``/device:``), or on its host ones."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    wanted = {pid for pid, name in names.items() if ("/device:" in name) == (events == "device")}
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("pid") in wanted:
            out[e["name"]][0] += 1
            out[e["name"]][1] += e.get("dur", 0.0)
    return dict(out)


def traced(fn, reps: int, events: str) -> tuple[dict, float]:
    """``fn`` called ``reps`` times under the profiler: its kernels' times and the wall
    seconds per call (each call waited for)."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t = time.perf_counter()
            for _ in range(reps):
                jax.block_until_ready(fn())
            wall = (time.perf_counter() - t) / reps
        (path,) = Path(d).rglob("perfetto_trace.json.gz")
        return kernel_times(json.loads(gzip.decompress(path.read_bytes())), events), wall


def summary(times: dict, wall_s: float, reps: int, top: int) -> dict:
    busy_us = sum(us for _, us in times.values())
    ranked = sorted(times.items(), key=lambda kv: -kv[1][1])
    return {"wall_ms_per_call": 1e3 * wall_s,
            "kernel_ms_per_call": busy_us / 1e3 / reps,
            "kernels_per_call": sum(n for n, _ in times.values()) / reps,
            "uncovered_share": max(0.0, 1 - busy_us / 1e6 / reps / wall_s) if wall_s else None,
            "top": [{"name": name, "per_call": n / reps, "ms_per_call": us / 1e3 / reps}
                    for name, (n, us) in ranked[:top]]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(args.devices)
    import jax

    from ciera_jax.calibrate.kit import gather_fns, replicated_cache, weight_pair
    from ciera_jax.runtime.devices import make_mesh

    on_cpu = jax.devices()[0].platform == "cpu"
    mesh = make_mesh(args.devices if on_cpu else None)
    shape, axis = tuple(args.shape), AXIS_GATHERED if len(args.shape) > 1 else 0
    fns = gather_fns(mesh, len(shape), axis)
    xa, xb = weight_pair(mesh, shape, axis, args.churn)
    print(f"gather_profile: {mesh.devices.size} x {jax.devices()[0].device_kind}, jax "
          f"{jax.__version__}, {shape} bf16, churn {args.churn}, {args.reps} traced calls "
          f"each, {args.events} events", flush=True)
    results = {}
    for mode in ("exponent", "word"):
        state = {"cache": replicated_cache(mesh, shape, xa.dtype, mode), "i": 0}

        def step(state=state):  # alternate the pair, carrying the cache: the steady state
            x = (xa, xb)[state["i"] % 2]
            full, state["cache"], _ = fns["ciera"](x, state["cache"])
            state["i"] += 1
            return full
        for _ in range(4):  # compile, prime, two steady gathers
            jax.block_until_ready(step())
        results[mode] = summary(*traced(step, args.reps, args.events), args.reps, args.top)
    jax.block_until_ready(fns["plain"](xa))
    results["plain"] = summary(*traced(lambda: fns["plain"](xa), args.reps, args.events),
                               args.reps, args.top)
    for name, r in results.items():
        print(f"\n{name}: {r['wall_ms_per_call']:.3f} ms a call, kernels "
              f"{r['kernel_ms_per_call']:.3f} ms in {r['kernels_per_call']:.0f} launches "
              f"(uncovered {r['uncovered_share']:.0%})")
        for k in r["top"]:
            print(f"  {k['ms_per_call']:8.3f} ms  x{k['per_call']:<4g} {k['name'][:90]}")
    write_results(args.out, dict(shape=list(shape), axis=axis, churn=args.churn,
                                 reps=args.reps, events=args.events, methods=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

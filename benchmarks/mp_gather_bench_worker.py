"""One process of benchmarks/gather_multiprocess.py: times plain-bits and CIERA gathers.

Started by the launcher (``ciera_jax.launch.run_local`` or ``ciera_jax.netns.run_in_namespaces``)
as ``python -m mp_gather_bench_worker SPEC_JSON`` with ``benchmarks/`` on PYTHONPATH. SPEC_JSON:
``{"shapes": [[E, 2048, 1024], ...], "axis": 1, "churn": [0.0, 0.01], "reps": 5, "warmup": 2}``.
Prints one line ``RESULT <json>`` with this process's records.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec: dict) -> None:
    from ciera_jax.netns import apply_gloo_hostname

    apply_gloo_hostname()  # only in a namespace run; before the CPU backend starts
    from ciera_jax.launch import init_from_env

    t0 = time.perf_counter()
    pid = init_from_env()
    import jax
    import jax.numpy as jnp

    from ciera_jax import calibrate as C

    mesh = C.make_mesh(None)
    axis = spec["axis"]
    recs = []
    for shape in spec["shapes"]:
        shape = tuple(shape)
        fns = C.gather_fns(mesh, len(shape), axis)
        for churn in spec["churn"]:
            for r in C.measure_gathers(mesh, shape, axis, churn, ("plain", "ciera"),
                                       reps=spec["reps"], warmup=spec["warmup"],
                                       dtype=jnp.bfloat16, fns=fns):
                recs.append(r)
                print(f"process {pid} {shape} churn {churn} {r['method']} "
                      f"{r['seconds'] * 1e3:.2f} ms", flush=True)
    print("RESULT " + json.dumps(dict(process=pid, devices=jax.device_count(),
                                      local_devices=jax.local_device_count(),
                                      seconds=time.perf_counter() - t0, records=recs)),
          flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

"""One process of benchmarks/gather_multiprocess.py: times plain-bits and CIERA gathers.

Started by the launcher (``ciera_jax.launch.run_local`` or ``ciera_jax.netns.run_in_namespaces``)
as ``python -m mp_gather_bench_worker SPEC_JSON`` with ``benchmarks/`` on PYTHONPATH. SPEC_JSON:
``{"shapes": [[E, 2048, 1024], ...], "axis": 1, "churn": [0.0, 0.01], "reps": 5, "warmup": 2,
"methods": ["plain", "ciera", "checksum", "ciera_checked"]}`` (methods as in gather_bench.py).
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

    from ciera_jax.calibrate.kit import gather_fns
    from ciera_jax.devices import make_mesh
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
    print("RESULT " + json.dumps(dict(process=pid, devices=jax.device_count(),
                                      local_devices=jax.local_device_count(),
                                      seconds=time.perf_counter() - t0, records=recs)),
          flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

"""How long a checkpoint save blocks the training loop: ``ciera train`` with a save every few
steps, each ``Checkpointer.save`` call timed from the loop's side.

    python benchmarks/save_blocking.py [--config tiny] [--steps 24] [--every 4] [--devices 8]

The loop waits in ``save`` for whatever the save does before it returns (the digests, the
device-to-host copy, and any write that is not left to a background thread), then takes the
next step. That wait is the save's cost on the step's critical path; it is what this times,
per save. It also reports the step times with and without a save in flight (a background save
shares the host's cores with the step on CPU-emulated devices) and the time the run waits at
the end for its last save. Prints one line per config and writes JSON.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from common import parser, write_results  # benchmarks/common.py, beside this script


def measure(config: str, steps: int, every: int, devices: int) -> dict:
    from ciera_models.checkpoint import store as ckpt
    from ciera_models.train.state import bytes_per_device
    from ciera_models.train import TrainConfig, make_mesh, train

    blocked: list[tuple[int, float]] = []
    save = ckpt.Checkpointer.save
    state_bytes: list[int] = []

    def timed(self, step, params, opt_state, meta, *a, **kw):
        if not state_bytes:
            state_bytes.append(bytes_per_device(params) + bytes_per_device(opt_state))
        t0 = time.perf_counter()
        out = save(self, step, params, opt_state, meta, *a, **kw)
        blocked.append((step, time.perf_counter() - t0))
        return out

    ckpt.Checkpointer.save = timed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            res = train(TrainConfig(config=config, schedule_steps=steps), steps=steps,
                        mesh=make_mesh(devices), checkpoint_dir=f"{tmp}/ck",
                        checkpoint_every=every, log=None)
            wall = time.perf_counter() - t0
    finally:
        ckpt.Checkpointer.save = save
    saved = {s for s, _ in blocked}
    # steps 1-2 compile and prime; a step right after a save runs while it may be in flight
    after = [r["step_time_s"] for r in res.history if r["step"] > 2 and r["step"] - 1 in saved]
    quiet = [r["step_time_s"] for r in res.history if r["step"] > 2 and r["step"] - 1 not in saved]
    periodic = [t for s, t in blocked if s != steps]
    return {"config": config, "steps": steps, "every": every, "devices": devices,
            "state_bytes_per_device": state_bytes[0] if state_bytes else None,
            "blocked_s": dict(blocked), "blocked_periodic_mean_s": statistics.mean(periodic),
            "blocked_periodic_max_s": max(periodic), "blocked_final_s": dict(blocked)[steps],
            "step_s_after_save_mean": statistics.mean(after) if after else None,
            "step_s_quiet_mean": statistics.mean(quiet) if quiet else None, "wall_s": wall}


def main(argv=None) -> dict:
    p = parser(__doc__, "save_blocking")
    p.add_argument("--config", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--devices", type=int, default=8)
    args = p.parse_args(argv)
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(args.devices)
    rows = []
    for config in args.config:
        r = measure(config, args.steps, args.every, args.devices)
        rows.append(r)
        print(f"{config}: a periodic save blocks the loop {r['blocked_periodic_mean_s'] * 1e3:.0f}"
              f" ms (max {r['blocked_periodic_max_s'] * 1e3:.0f}); the final one "
              f"{r['blocked_final_s'] * 1e3:.0f} ms; step {r['step_s_quiet_mean'] * 1e3:.0f} ms, "
              f"{r['step_s_after_save_mean'] * 1e3:.0f} ms right after a save "
              f"({r['state_bytes_per_device']} state bytes per device)", flush=True)
    write_results(args.out, rows)
    return {"rows": rows}


if __name__ == "__main__":
    main()

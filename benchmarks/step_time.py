"""Train-step time of the MoE model under FSDP: plain, int8 and CIERA gathers, same run.

For each config (default ``tiny`` and ``small``) on N devices (default 8 emulated CPU devices; on
GPU every local device) it builds one trainer per mode (``ciera_models.train``: stacked layers under
``lax.scan``, the next layer's gather prefetched, one agreement per step, encoding for step t+1
at the end of step t), compiles them, runs ``--warmup`` steps each (the first primes CIERA's
caches), then times ``--steps`` more steps **interleaved** (plain, int8, ciera, plain, ...) on the
same batches, and reports the median step time, the time ratio to plain, and the wire ratio
(bytes one rank sends / a plain gather of the same tensors, forward gathers; the backward
re-gathers send the same again). Compile time is the first call's time.

A mode is a gather (``plain``, ``int8``, ``ciera``), optionally with CIERA's cache mode after a
colon (``ciera:word``, ``ciera:auto``; default ``exponent``).

    python benchmarks/step_time.py [--configs tiny small] [--modes plain int8 ciera]
                                   [--steps 10] [--warmup 3] [--devices 8] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import time

from common import parser, write_results  # benchmarks/common.py, beside this script

MODES = ("plain", "int8", "ciera")


def parse_args(argv=None):
    p = parser(__doc__, "step_time")
    p.add_argument("--configs", nargs="+", default=["tiny", "small"], help="model configs")
    p.add_argument("--modes", nargs="+", default=list(MODES),
                   help="gather[:cache] per trainer (default: plain int8 ciera)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the compile")
    p.add_argument("--devices", type=int, default=None,
                   help="emulated CPU devices (default 8; on GPU all local devices are used)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, sequences")
    p.add_argument("--plan", default="auto", help="which tensors compress (ciera train --plan)")
    p.add_argument("--profile", default=None, help="cost-model profile for the plan")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "plain" not in [m.split(":")[0] for m in args.modes]:
        raise SystemExit("--modes must include plain (the ratios are to it)")
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(args.devices)
    # JAX, the library and the model load after the device count is set.
    import jax

    from ciera_jax.runtime.devices import make_mesh

    on_cpu = jax.devices()[0].platform == "cpu"
    mesh = make_mesh(args.devices if on_cpu else None)
    n = mesh.devices.size
    rows = []
    for name in args.configs:
        rows += time_config(name, args, mesh)
    print(f"\nstep time, {n} x {jax.devices()[0].platform} devices, median of {args.steps} "
          f"interleaved steps after {args.warmup} warm-up")
    print(f"{'config':<8}{'mode':<13}{'step ms':>9}{'min ms':>9}{'time/plain':>12}"
          f"{'wire/plain':>12}{'compile+1st s':>15}")
    for r in rows:
        print(f"{r['config']:<8}{r['mode']:<13}{1e3 * r['median_step_s']:>9.1f}"
              f"{1e3 * r['min_step_s']:>9.1f}{r['time_vs_plain']:>12.3f}"
              f"{r['wire_vs_plain']:>12.3f}{r['first_call_s']:>15.1f}")
    for r in rows:
        if r["plan"]:
            print(f"{r['config']} {r['mode']}: {r['plan']}")
    write_results(args.out, dict(rows=rows, devices=n, steps=args.steps, warmup=args.warmup))
    return 0


def time_config(name: str, args, mesh) -> list[dict]:
    """Build, compile and warm one trainer per mode for config ``name``; time interleaved."""
    # Imported here: JAX must start after main() has set the device count.
    import jax

    from ciera_models.train.data import load_dataset
    from ciera_models.train import TrainConfig, build_trainer

    trainers, states = {}, {}
    for mode in args.modes:
        gather, _, cache = mode.partition(":")
        tc = TrainConfig(config=name, gather=gather, cache=cache or "exponent",
                         batch_size=args.batch_size, plan=args.plan, profile=args.profile,
                         schedule_steps=args.warmup + args.steps + 1)
        trainers[mode] = build_trainer(tc, mesh)
        states[mode] = trainers[mode].init_state(0)
    plain = next(m for m in args.modes if m.split(":")[0] == "plain")
    data = load_dataset(None, trainers[plain].tc.model.vocab_size, trainers[plain].tc.length)

    def step(mode: str, i: int) -> tuple[float, float, float, float]:
        tr = trainers[mode]
        batch = jax.block_until_ready(tr.batch(data, 0, i))
        t0 = time.perf_counter()
        states[mode], m = tr.step(states[mode], batch)  # metrics come back on the host
        dt = time.perf_counter() - t0
        g = m["gather"].values()
        return (dt, sum(float(s["sent_bytes"]) for s in g),
                sum(float(s["plain_bytes"]) for s in g), float(m["loss"]))

    first = {}
    for mode in args.modes:  # compile + priming step
        first[mode] = step(mode, 0)[0]
        print(f"{name}: {mode} compiled + first step in {first[mode]:.1f} s", flush=True)
    for i in range(1, args.warmup + 1):
        for mode in args.modes:
            step(mode, i)
    records = {m: [] for m in args.modes}
    for i in range(args.warmup + 1, args.warmup + 1 + args.steps):
        for mode in args.modes:  # interleaved: every mode sees the same machine state
            records[mode].append(step(mode, i))
    base = statistics.median(r[0] for r in records[plain])
    rows = []
    for mode, recs in records.items():
        times = [r[0] for r in recs]
        med = statistics.median(times)
        tc = trainers[mode].tc
        rows.append(dict(
            config=name, mode=mode, devices=mesh.devices.size, batch=tc.batch_size,
            seq_len=tc.length, steps=len(times), median_step_s=med, min_step_s=min(times),
            time_vs_plain=med / base,
            wire_vs_plain=sum(r[1] for r in recs) / sum(r[2] for r in recs),
            first_call_s=first[mode], final_loss=recs[-1][3], times=times,
            plan=trainers[mode].plan_summary if tc.gather == "ciera" else ""))
    return rows


if __name__ == "__main__":
    sys.exit(main())

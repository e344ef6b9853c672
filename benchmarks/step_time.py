"""Train-step time of the MoE model under FSDP: plain, int8 and CIERA gathers, same run.

For each config (default ``tiny`` and ``small``) on N devices (default 8 emulated CPU devices; on
GPU every local device) it builds the three trainers (``models.train``: stacked layers under
``lax.scan``, the next layer's gather prefetched, one agreement per step, encoding for step t+1
at the end of step t), compiles them, runs ``--warmup`` steps each (the first primes CIERA's
caches), then times ``--steps`` more steps **interleaved** (plain, int8, ciera, plain, ...) on the
same batches, and reports the median step time, the time ratio to plain, and the wire ratio
(bytes one rank sends / a plain gather of the same tensors, forward gathers; the backward
re-gathers send the same again). Compile time is the first call's time.

    python benchmarks/step_time.py [--configs tiny small] [--steps 10] [--warmup 3]
                                   [--devices 8] [--plan auto] [--out results/step_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

MODES = ("plain", "int8", "ciera")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the compile")
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--plan", default="auto", choices=("auto", "cost", "all"))
    p.add_argument("--profile", default=None)
    p.add_argument("--out", default="results/step_time.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ciera_jax.devices import setup_devices

    setup_devices(args.devices)
    import jax

    from models.data import load_dataset
    from models.train import TrainConfig, TrainState, build_trainer, make_mesh

    n = args.devices or len(jax.devices())
    mesh = make_mesh(n)
    rows = []
    for name in args.configs:
        trainers, states, first, records = {}, {}, {}, {m: [] for m in MODES}
        for mode in MODES:
            tc = TrainConfig(config=name, gather=mode, batch_size=args.batch_size,
                             plan=args.plan, profile=args.profile,
                             schedule_steps=args.warmup + args.steps + 1)
            trainers[mode] = build_trainer(tc, mesh)
            states[mode] = trainers[mode].prepare(trainers[mode].init_state(0))
        data = load_dataset(None, trainers["plain"].tc.model.vocab_size,
                            trainers["plain"].tc.length)

        def step(mode, i):
            tr, st = trainers[mode], states[mode]
            batch = tr.batch(data, 0, i)
            jax.block_until_ready(batch)
            t0 = time.perf_counter()
            params, caches, opt, ahead, m = tr.step_fn(st.params, st.caches, st.opt_state,
                                                       st.ahead, batch)
            m = jax.device_get(m)
            dt = time.perf_counter() - t0
            states[mode] = TrainState(st.step + 1, params, caches, opt, ahead)
            g = m["gather"].values()
            return dt, sum(float(s["sent_bytes"]) for s in g), \
                sum(float(s["plain_bytes"]) for s in g), float(m["loss"])

        for mode in MODES:  # compile + priming step
            first[mode] = step(mode, 0)[0]
            print(f"{name}: {mode} compiled + first step in {first[mode]:.1f} s", flush=True)
        for i in range(1, args.warmup + 1):
            for mode in MODES:
                step(mode, i)
        for i in range(args.warmup + 1, args.warmup + 1 + args.steps):
            for mode in MODES:  # interleaved: every mode sees the same machine state
                records[mode].append(step(mode, i))
        base = statistics.median(r[0] for r in records["plain"])
        for mode in MODES:
            times = [r[0] for r in records[mode]]
            med = statistics.median(times)
            rows.append(dict(
                config=name, mode=mode, devices=n, batch=trainers[mode].tc.batch_size,
                seq_len=trainers[mode].tc.length, steps=len(times), median_step_s=med,
                min_step_s=min(times), time_vs_plain=med / base,
                wire_vs_plain=sum(r[1] for r in records[mode]) / sum(r[2] for r in records[mode]),
                first_call_s=first[mode], final_loss=records[mode][-1][3],
                plan=trainers[mode].plan_summary if mode == "ciera" else ""))

    hdr = (f"{'config':<8}{'mode':<7}{'step ms':>9}{'min ms':>9}{'time/plain':>12}"
           f"{'wire/plain':>12}{'compile+1st s':>15}")
    print(f"\nstep time, {n} x {jax.devices()[0].platform} devices, median of {args.steps} "
          f"interleaved steps after {args.warmup} warm-up")
    print(hdr)
    for r in rows:
        print(f"{r['config']:<8}{r['mode']:<7}{1e3 * r['median_step_s']:>9.1f}"
              f"{1e3 * r['min_step_s']:>9.1f}{r['time_vs_plain']:>12.3f}"
              f"{r['wire_vs_plain']:>12.3f}{r['first_call_s']:>15.1f}")
    for r in rows:
        if r["plan"]:
            print(f"{r['config']}: {r['plan']}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "devices": n, "platform": jax.devices()[0].platform,
                       "host": platform.node(), "jax": jax.__version__,
                       "steps": args.steps, "warmup": args.warmup}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

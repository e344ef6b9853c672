"""Train the MoE transformer under FSDP with the CIERA gather (or the plain / int8 baselines).

With no flags: config ``tiny`` on 8 emulated CPU devices (all local devices on an accelerator),
the built-in byte-level corpus, 200 steps, ``--gather ciera``. Prints a progress line every few
steps, a per-phase summary table, and ends with ``params_sha256=<hex>``.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from models.configs import CONFIGS

    p.add_argument("--config", default="tiny", help=f"model config ({', '.join(CONFIGS)})")
    p.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    p.add_argument("--gather", default="ciera", choices=("ciera", "plain", "int8"),
                   help="ciera (lossless, compressed), plain (lossless baseline), int8 (lossy)")
    p.add_argument("--profile", default=None,
                   help="cost-model profile for the compress-or-plain plan: a built-in name "
                        "(cpu-emulated, h100-nvlink, ...) or a JSON file from `ciera calibrate` "
                        "(default: cpu-emulated on CPU, h100-nvlink on GPU)")
    p.add_argument("--plan", default="auto", choices=("auto", "cost", "all"),
                   help="auto: the cost model plus the expert weights always; cost: the cost "
                        "model alone; all: every gathered tensor (ciera only)")
    p.add_argument("--devices", type=int, default=None,
                   help="fsdp mesh size (default: 8 emulated CPU devices, or all accelerators)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, sequences")
    p.add_argument("--seq-len", type=int, default=None, help="default: the config's")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="cosine horizon (default: --steps, or the checkpoint's on --resume)")
    p.add_argument("--data", default=None, help="flat uint16/uint32 token file (default: built-in)")
    p.add_argument("--data-dtype", default=None, choices=("uint16", "uint32"))
    p.add_argument("--metrics-out", default=None, help="per-step JSONL metrics")
    p.add_argument("--trace-every", type=int, default=10,
                   help="per-tensor exponent change rates in the JSONL every N steps")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: only at the end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--coordinator", default=None,
                   help="multi-host: coordinator address host:port (with --num-processes, "
                        "--process-id); also picked up from the usual cluster env vars")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)


def _init_distributed(args) -> None:
    import jax

    if args.coordinator or "JAX_COORDINATOR_ADDRESS" in os.environ:
        # CPU processes exchange collectives over gloo sockets (GPUs use NCCL regardless).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator:
        if args.num_processes is None or args.process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    elif any(k in os.environ for k in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS",
                                       "OMPI_COMM_WORLD_SIZE")) and \
            int(os.environ.get("SLURM_NTASKS", os.environ.get("OMPI_COMM_WORLD_SIZE", "2"))) > 1:
        jax.distributed.initialize()


def _schedule_steps(args) -> int:
    if args.schedule_steps is not None:
        return args.schedule_steps
    if args.resume and args.checkpoint_dir:
        from models import checkpoint

        meta = checkpoint.latest_meta(args.checkpoint_dir)
        if meta and "schedule_steps" in meta:
            return int(meta["schedule_steps"])
    return args.steps


def run(args) -> int:
    from ciera_jax.devices import setup_devices

    if args.steps < 0:
        raise ValueError("--steps must be >= 0")
    setup_devices(args.devices)  # before JAX creates its backends
    _init_distributed(args)

    import jax

    from models import configs
    from models.train import TrainConfig, make_mesh, train

    configs.get_config(args.config)  # unknown config -> KeyError with the choices
    multi = jax.process_count() > 1
    n = args.devices if args.devices and not multi else len(jax.devices())
    mesh = make_mesh(n)
    tc = TrainConfig(config=args.config, gather=args.gather, batch_size=args.batch_size,
                     seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                     schedule_steps=_schedule_steps(args), profile=args.profile,
                     plan=args.plan)
    is_main = jax.process_index() == 0
    log = (lambda s: print(s, flush=True)) if is_main else None
    if is_main:
        cfg = tc.model
        print(f"ciera train: config={cfg.name} gather={tc.gather} mesh fsdp={n} "
              f"({jax.devices()[0].platform}, {jax.process_count()} process(es)) "
              f"batch={tc.batch_size}x{tc.length} steps={args.steps}", flush=True)
    res = train(tc, steps=args.steps, seed=args.seed, mesh=mesh, data=args.data,
                data_dtype=args.data_dtype, metrics_out=args.metrics_out if is_main else None,
                checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                resume=args.resume, log_every=args.log_every, trace_every=args.trace_every,
                log=log)
    if is_main:
        print(res.summary)
        print(f"params_sha256={res.sha256}", flush=True)
    return 0


if __name__ == "__main__":
    from ciera_jax.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))

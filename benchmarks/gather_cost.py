"""What one gather costs a GPU, from its XLA:GPU compile (no GPU needed): kernels, HBM bytes,
launch floor and roofline per mode.

    python benchmarks/gather_cost.py                          # 64 MB bf16, axis 1, 8 and 16 H100s
    python benchmarks/gather_cost.py --shape 8 256 128 --gpus 8 --kernels

Each gather is compiled as ``ciera train`` runs it (``ciera_models.aot.gather_cost``: plain; or
the encode and the exchange at the steady program's fixed rung, self-check on) for compile-only
GPUs with the FSDP flags, and its steady path read off the scheduled program: every kernel
(fusions, custom calls such as Mosaic GPU kernels, copies, collectives) with the bytes its
operands and result hold. The roofline is the sum over kernels of max(bytes / HBM rate, 4 us).

    python benchmarks/gather_cost.py --table ciera_jax/planning/data/codec_cost.json \
        [--from benchmarks/results/gather_cost_<...>.json] [--measured <1-GPU gather_bench>.json]

also writes the codec cost table the step model reads (``ciera_jax.planning.codec_costs``),
from this compile or a recorded one (``--from``), with a one-GPU measurement where there is one.
"""

from __future__ import annotations

import datetime
import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from common import parser, write_results  # noqa: E402  benchmarks/common.py
from ciera_models.train.config import FALLBACKS  # noqa: E402

SHAPE = (16, 2048, 1024)  # 64 MB of bf16: an OLMoE-like expert tensor, gathered on axis 1


def parse_args(argv=None):
    p = parser(__doc__, f"gather_cost_{datetime.date.today().isoformat()}")
    p.add_argument("--shape", type=int, nargs="+", default=list(SHAPE))
    p.add_argument("--axis", type=int, default=1)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 16])
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--modes", nargs="+", default=["plain", "exponent", "word"])
    p.add_argument("--fallback", nargs="+", default=["auto"], choices=FALLBACKS,
                   help="as ciera train --fallback (auto: program, on GPUs); several: each")
    p.add_argument("--kernels", action="store_true", help="also list every kernel")
    p.add_argument("--table", default=None, help="also write the step model's codec table here")
    p.add_argument("--from", dest="recorded", default=None,
                   help="read the reports from this recorded run instead of compiling")
    p.add_argument("--measured", default=None,
                   help="a one-GPU gather_bench.py result to add to the table as measurements")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.recorded:
        import codec_table  # benchmarks/codec_table.py

        codec_table.write(args.table, args.recorded, args.measured)
        return
    from ciera_jax.runtime import gpu_targets

    gpu_targets.prepare_environment()
    from ciera_models.aot import gather_cost

    target = gpu_targets.get_target(args.gpu)
    for gpus in args.gpus:
        gpu_targets.check_cluster(gpus)
        for mode in args.modes:
            gather_cost.check_gather(tuple(args.shape), args.axis, gpus, mode)
    results = []
    for fallback in args.fallback:
        for gpus in args.gpus:
            reports = [gather_cost.gather_cost(m, args.shape, args.axis, gpus, target,
                                               fallback=fallback) for m in args.modes]
            print(f"--fallback {fallback}")
            print(gather_cost.render(reports, kernels=args.kernels), end="\n\n", flush=True)
            results += reports
    doc = write_results(args.out, results)
    if args.table:
        import codec_table

        codec_table.write(args.table, doc, args.measured)


if __name__ == "__main__":
    main()

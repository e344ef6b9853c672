"""Throughput of the codec hot path per implementation, next to a plain copy of the same bytes.

For every dtype, size and impl it times jitted ``encode`` (x + cached exponents -> exponents,
payload planes, changed flags) and ``decode`` (exponents + payload -> weights), and in the same
run a copy baseline: ``w ^ salt`` on the same-width unsigned view, with ``salt`` a runtime
argument so XLA cannot fold it away (it reads and writes every byte once, like a copy).

Figures are GB/s of *tensor* bytes (``x.nbytes`` / time; 1 GB = 1e9 B). Decode moves as many
bytes as the copy (bf16: read 1+1, write 2 per element), so decode/copy is the kernel's
bandwidth efficiency; encode moves more (bf16: read 2+1, write 1+1+1).

Pallas on CPU only runs interpreted, which is not a throughput figure: it is skipped there.

    python benchmarks/kernel_throughput.py [--sizes-mb 1 16 64 256] [--out results/x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax import codec
from ciera_jax import kernels as K

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def median_seconds(fn, *args, warmup: int = 2, reps: int = 7) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_weights(dtype, n: int, seed: int = 0) -> jax.Array:
    """Weight-like data (normal, std 0.02), built on device to keep host memory low."""
    x = 0.02 * jax.random.normal(jax.random.key(seed), (n,), jnp.float32)
    return x.astype(dtype)


def _pallas_variant(block: int, warps: int):
    """encode/decode with an explicit Triton block size and warp count (GPU tuning sweep)."""
    enc = lambda x, c: K.encode_pallas(x, c, block=block, num_warps=warps)  # noqa: E731
    dec = lambda e, p, dtype: K.decode_pallas(e, p, dtype, block=block, num_warps=warps)  # noqa: E731
    return enc, dec


def bench_one(dtype_name: str, mb: float, impls, reps: int, variants=()) -> list[dict]:
    dtype = DTYPES[dtype_name]
    itemsize = np.dtype(dtype).itemsize
    n = int(mb * 2**20) // itemsize
    x = make_weights(dtype, n)
    cache = codec.exponent(x)
    nbytes = n * itemsize

    copy = jax.jit(lambda w, s: w ^ s)
    bits = codec.to_bits(x)
    salt = jnp.asarray(1, bits.dtype)
    t_copy = median_seconds(copy, bits, salt, reps=reps)
    copy_gbps = nbytes / t_copy / 1e9
    rows = [dict(dtype=dtype_name, mb=mb, n=n, impl="-", op="copy", seconds=t_copy,
                 gbps=copy_gbps, copy_gbps=copy_gbps, ratio=1.0)]
    cases = [(impl, lambda x, c, impl=impl: K.encode(x, c, impl=impl),
              lambda e, p, dtype, impl=impl: K.decode(e, p, dtype, impl=impl)) for impl in impls]
    cases += [(f"pallas:{b}x{w}", *_pallas_variant(b, w)) for b, w in variants]
    for impl, enc_fn, dec_fn in cases:
        enc = jax.jit(enc_fn)
        exp, payload, _ = jax.block_until_ready(enc(x, cache))
        dec = jax.jit(lambda e, p, dec_fn=dec_fn: dec_fn(e, p, dtype))
        for op, fn, args in (("encode", enc, (x, cache)), ("decode", dec, (exp, payload))):
            t = median_seconds(fn, *args, reps=reps)
            gbps = nbytes / t / 1e9
            rows.append(dict(dtype=dtype_name, mb=mb, n=n, impl=impl, op=op, seconds=t,
                             gbps=gbps, copy_gbps=copy_gbps, ratio=gbps / copy_gbps))
        del exp, payload
    return rows


def environment() -> dict:
    dev = jax.devices()[0]
    return dict(backend=jax.default_backend(), device=getattr(dev, "device_kind", str(dev)),
                jax=jax.__version__, python=platform.python_version(),
                host=platform.node(), cpus=os.cpu_count())


def print_table(rows: list[dict], env: dict) -> None:
    print(f"# backend={env['backend']} device={env['device']} jax={env['jax']}")
    print(f"{'dtype':>5} {'MB':>6} {'impl':>14} {'op':>6} {'ms':>9} {'GB/s':>8} {'copy GB/s':>9} "
          f"{'vs copy':>7}")
    for r in rows:
        print(f"{r['dtype']:>5} {r['mb']:>6g} {r['impl']:>14} {r['op']:>6} {r['seconds'] * 1e3:>9.3f} "
              f"{r['gbps']:>8.2f} {r['copy_gbps']:>9.2f} {r['ratio']:>7.2f}")


def run(argv=None, *, default_out: str, default_impls, description: str = __doc__) -> dict:
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=description.splitlines()[0])
    p.add_argument("--sizes-mb", type=float, nargs="+",
                   default=[1, 16, 64, 256] if on_gpu else [1, 16, 64])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--impls", nargs="+", default=list(default_impls), choices=["xla", "pallas"])
    p.add_argument("--reps", type=int, default=20 if on_gpu else 5)
    p.add_argument("--variants", nargs="*", default=[], metavar="BLOCKxWARPS",
                   help="extra pallas block-size/warp-count variants to time on GPU, e.g. 1024x4 16384x8")
    p.add_argument("--out", default=default_out)
    args = p.parse_args(argv)

    impls = list(args.impls)
    notes = []
    if "pallas" in impls and not on_gpu:
        impls.remove("pallas")
        notes.append("pallas skipped: no GPU here, and interpret mode is not a throughput figure")
    sizes = args.sizes_mb if on_gpu else [s for s in args.sizes_mb if s <= 64]
    if len(sizes) < len(args.sizes_mb):
        notes.append("sizes above 64 MB skipped on CPU")

    variants = [tuple(int(v) for v in s.split("x")) for s in args.variants] if on_gpu else []
    if args.variants and not on_gpu:
        notes.append("pallas variants skipped: no GPU here")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    env = environment()
    rows = []
    for dtype_name in args.dtypes:
        for mb in sizes:
            rows.extend(bench_one(dtype_name, mb, impls, args.reps, variants))
    print_table(rows, env)
    result = dict(env=env, notes=notes, reps=args.reps, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    run(default_out="results/kernel_throughput.json", default_impls=("xla", "pallas"))

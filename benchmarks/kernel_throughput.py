"""Throughput of the codec hot path per implementation, next to a plain copy of the same bytes.

For every dtype, size and impl it times jitted

* exponent mode: ``encode`` (x + cached exponents -> exponents, payload planes, changed flags)
  and ``decode`` (exponents + payload -> weights);
* word mode: ``word_encode`` (x + cached words -> word deltas + demand counts), ``word_decode``
  (cached words + 4-bit codes -> words, the dense part of the rebuild), and, xla only, the
  whole one-rank ``word_wire`` (deltas -> packed codes + escape lists at the steady-state rung)
  and ``word_unwire`` (wire -> words: unpack, dense decode, escape positions and scatter);

and in the same run a copy baseline: ``w ^ salt`` on the same-width unsigned view, with ``salt``
a runtime argument so XLA cannot fold it away (it reads and writes every byte once). Weights are
normal(0, 0.02); the cache is the same tensor moved by a few ulps per word.

Figures are GB/s of *tensor* bytes (``x.nbytes`` / time; 1 GB = 1e9 B). The xla decode rate is
the planner's ``codec_rate`` off-GPU. Pallas on CPU only runs interpreted, which is not a
throughput figure: it is skipped there. Target on H200: Pallas decode >= 70% of copy bandwidth
from 16 MB up.

    python benchmarks/kernel_throughput.py [--sizes-mb 1 16 64 256] [--impls xla pallas]
        [--variants 1024x4 16384x8] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax import codec, wordcodec
from ciera_jax import kernels as K
from ciera_jax.word_ladder import WORD_LADDER
from common import parser, write_results  # benchmarks/common.py, beside this script

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
STEADY_RUNG = WORD_LADDER[4]  # 4-bit codes, n/16 level 1, n/256 level 2


def parse_args(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = parser(__doc__, "kernel_throughput")
    p.add_argument("--sizes-mb", type=float, nargs="+",
                   default=[1, 16, 64, 256] if on_gpu else [1, 16, 64])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--impls", nargs="+", default=["xla", "pallas"], choices=["xla", "pallas"])
    p.add_argument("--modes", nargs="+", default=["exponent", "word"],
                   choices=["exponent", "word"])
    p.add_argument("--reps", type=int, default=20 if on_gpu else 5)
    p.add_argument("--variants", nargs="*", default=[], metavar="BLOCKxWARPS",
                   help="extra pallas block-size/warp-count variants (exponent mode) to time "
                        "on GPU, e.g. 1024x4 16384x8")
    return p.parse_args(argv)


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


@jax.jit
def _cached_words(x):
    """The cache a step ago: every word moved by -3..3 ulps."""
    d = jax.random.randint(jax.random.key(1), x.shape, -3, 4)
    return wordcodec.apply_delta(codec.to_bits(x), d)


def _exponent_cases(impls, variants):
    cases = [(impl, lambda x, c, impl=impl: K.encode(x, c, impl=impl),
              lambda e, p, dtype, impl=impl: K.decode(e, p, dtype, impl=impl)) for impl in impls]
    for block, warps in variants:  # GPU tuning sweep of the Triton block and warp count
        cases.append((f"pallas:{block}x{warps}",
                      lambda x, c, b=block, w=warps: K.encode_pallas(x, c, block=b, num_warps=w),
                      lambda e, p, dtype, b=block, w=warps: K.decode_pallas(
                          e, p, dtype, block=b, num_warps=w)))
    return cases


def _row(dtype_name, mb, n, impl, op, t, nbytes, copy_gbps):
    gbps = nbytes / t / 1e9
    return dict(dtype=dtype_name, mb=mb, n=n, impl=impl, op=op, seconds=t, gbps=gbps,
                copy_gbps=copy_gbps, ratio=gbps / copy_gbps)


def bench_one(dtype_name: str, mb: float, impls, modes, reps: int, variants=()) -> list[dict]:
    dtype = DTYPES[dtype_name]
    itemsize = np.dtype(dtype).itemsize
    n = int(mb * 2**20) // itemsize
    x = make_weights(dtype, n)
    nbytes = n * itemsize
    bits = codec.to_bits(x)
    t_copy = median_seconds(jax.jit(lambda w, s: w ^ s), bits, jnp.asarray(1, bits.dtype),
                            reps=reps)
    copy_gbps = nbytes / t_copy / 1e9
    rows = [_row(dtype_name, mb, n, "-", "copy", t_copy, nbytes, copy_gbps)]
    if "exponent" in modes:
        cache = codec.exponent(x)
        for impl, enc_fn, dec_fn in _exponent_cases(impls, variants):
            enc = jax.jit(enc_fn)
            exp, payload, _ = jax.block_until_ready(enc(x, cache))
            dec = jax.jit(lambda e, p, dec_fn=dec_fn: dec_fn(e, p, dtype))
            for op, fn, args in (("encode", enc, (x, cache)), ("decode", dec, (exp, payload))):
                rows.append(_row(dtype_name, mb, n, impl, op, median_seconds(fn, *args,
                                                                             reps=reps),
                                 nbytes, copy_gbps))
            del exp, payload
    if "word" in modes:
        rows += _word_rows(dtype_name, mb, x, impls, reps, copy_gbps)
    return rows


def _word_rows(dtype_name, mb, x, impls, reps, copy_gbps) -> list[dict]:
    n, nbytes = x.size, x.nbytes
    cached = _cached_words(x)
    b, c1, c2 = (STEADY_RUNG.code_bits, STEADY_RUNG.level1_capacity(n),
                 STEADY_RUNG.level2_capacity(n))
    rows = []
    for impl in impls:
        enc = jax.jit(lambda x, c, impl=impl: K.word_encode(x, c, impl=impl))
        d, _ = jax.block_until_ready(enc(x, cached))
        codes = jax.jit(lambda d: wordcodec.codes_of(d, b))(d)
        dec = jax.jit(lambda c, k, impl=impl: K.word_decode(c, k, b, impl=impl))
        for op, fn, args in (("word_encode", enc, (x, cached)),
                             ("word_decode", dec, (cached, codes))):
            rows.append(_row(dtype_name, mb, n, impl, op, median_seconds(fn, *args, reps=reps),
                             nbytes, copy_gbps))
    if "xla" in impls:
        d, _ = K.word_encode(x, cached, impl="xla")
        wire = jax.jit(lambda d, w: wordcodec.encode_wire(d, w, b, c1, c2))
        buf = jax.block_until_ready(wire(d, codec.to_bits(x)))

        @jax.jit
        def unwire(buf, cached):
            codes, l1, l2 = wordcodec.split_wire(buf[None], n, b, c1, c2, cached.dtype)
            dense = wordcodec.dense_decode(cached, codes[0], b)
            pos = wordcodec.escape_positions_rows(codes, b, c1)
            new = wordcodec.escape_words(cached[jnp.minimum(pos, n - 1)], l1, l2)
            return dense.at[pos[0]].set(new[0], mode="drop")

        got = jax.block_until_ready(unwire(buf, cached))
        if not bool(jnp.all(got == codec.to_bits(x))):
            raise AssertionError("word_unwire did not rebuild the words bit for bit")
        for op, fn, args in (("word_wire", wire, (d, codec.to_bits(x))),
                             ("word_unwire", unwire, (buf, cached))):
            rows.append(_row(dtype_name, mb, n, "xla", op, median_seconds(fn, *args, reps=reps),
                             nbytes, copy_gbps))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'dtype':>5} {'MB':>6} {'impl':>14} {'op':>11} {'ms':>9} {'GB/s':>8} "
          f"{'copy GB/s':>9} {'vs copy':>7}")
    for r in rows:
        print(f"{r['dtype']:>5} {r['mb']:>6g} {r['impl']:>14} {r['op']:>11} "
              f"{r['seconds'] * 1e3:>9.3f} {r['gbps']:>8.2f} {r['copy_gbps']:>9.2f} "
              f"{r['ratio']:>7.2f}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    impls, notes = list(args.impls), []
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
    dev = jax.devices()[0]
    print(f"# backend={jax.default_backend()} device={dev.device_kind} jax={jax.__version__}")
    rows = []
    for dtype_name in args.dtypes:
        for mb in sizes:
            new = bench_one(dtype_name, mb, impls, args.modes, args.reps, variants)
            print_table(new)
            rows += new
    write_results(args.out, dict(notes=notes, reps=args.reps, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

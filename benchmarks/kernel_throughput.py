"""Throughput of the codec hot path per implementation, next to a plain copy of the same bytes.

For every dtype, size and impl (``xla``; the Pallas backends ``mosaic`` and ``triton``, GPU
only) it times jitted

* exponent mode: ``encode`` (x + cached exponents -> exponents, payload planes, changed flags)
  and ``decode`` (exponents + payload -> weights); and the receiver's decode with the per-rank
  checksum of 8 ranks' shards, ``decode+chk`` unfused (the decode, then ``checksum_shards`` in
  jnp) next to ``decode+chk fused`` (``kernels.decode_checksum_pallas``: one pass);
* word mode: ``word_encode`` (x + cached words -> word deltas + demand counts) and
  ``word_decode`` (cached words + 4-bit codes -> words, the dense part of the rebuild);
* the escapes of the wire: the sender's ``escape pack`` (flags packed 32 to a word, the flagged
  values into a capacity buffer in position order) and the receiver's ``escape expand`` (every
  flagged element's value back), at exponent mode's steady churn (1% of elements) and word
  mode's (10%): ``xla`` is :mod:`ciera_jax.codec.escapes` (loops over the escapes only, each found by
  running count and popcount), ``triton`` the dense blockwise kernels of ``kernels/escape.py``
  (where an asked impl resolves to Triton: ``triton``, or ``pallas`` below Hopper; Mosaic GPU
  has none), checked against the loops; and the receiver's ``checksum`` of 8 ranks' shards
  alone (the self-check);

and in the same run a copy baseline: ``w ^ salt`` on the same-width unsigned view, with ``salt``
a runtime argument so XLA cannot fold it away (it reads and writes every byte once). Weights are
normal(0, 0.02); the cache is the same tensor moved by a few ulps per word.

Figures are GB/s of *tensor* bytes (``x.nbytes`` / time; 1 GB = 1e9 B). The xla decode rate is
the planner's ``codec_rate`` off-GPU. Pallas on CPU only runs interpreted, which is not a
throughput figure: it is skipped there. Targets on H200: Pallas decode >= 70% and encode
>= 50% of copy bandwidth from 16 MB up.

    python benchmarks/kernel_throughput.py [--sizes-mb 1 16 64 256] [--impls xla mosaic triton]
        [--blocks 1024 16384] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ciera_jax.codec import checksum, bitfields, escapes, wordcodec
from ciera_jax import kernels as K
from common import parser, print_table, write_results  # benchmarks/common.py, beside this script

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
PALLAS = ("mosaic", "triton")  # kernel backends, timed on GPU only
CHECK_RANKS = 8  # the receiver's checksum covers this many ranks' shards


def parse_args(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = parser(__doc__, "kernel_throughput")
    p.add_argument("--sizes-mb", type=float, nargs="+",
                   default=[1, 16, 64, 256] if on_gpu else [1, 16, 64])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--impls", nargs="+", default=["xla", *K.available_backends()],
                   choices=["xla", "pallas", *PALLAS],
                   help="xla, and Pallas backends (pallas = the one impl='pallas' picks)")
    p.add_argument("--modes", nargs="+", default=["exponent", "word"],
                   choices=["exponent", "word"])
    p.add_argument("--reps", type=int, default=20 if on_gpu else 5)
    p.add_argument("--blocks", nargs="*", type=int, default=[], metavar="BLOCK",
                   help="extra Pallas block sizes (exponent mode, every Pallas backend) to "
                        "time on GPU, e.g. 1024 16384")
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
    return wordcodec.apply_delta(bitfields.to_bits(x), d)


def _exponent_cases(impls, blocks):
    cases = [(impl, lambda x, c, impl=impl: K.encode(x, c, impl=impl),
              lambda e, p, dtype, impl=impl: K.decode(e, p, dtype, impl=impl)) for impl in impls]
    for backend in [i for i in impls if i in PALLAS]:
        for block in blocks:  # GPU tuning sweep of the block size
            cases.append((f"{backend}:{block}",
                          lambda x, c, b=block, k=backend: K.encode_pallas(x, c, block=b,
                                                                           backend=k),
                          lambda e, p, dtype, b=block, k=backend: K.decode_pallas(
                              e, p, dtype, block=b, backend=k)))
    return cases


def _checked_decode_rows(dtype_name, mb, x, impls, reps, copy_gbps) -> list[dict]:
    """The receiver's decode + per-rank checksums: unfused per impl, fused per Pallas backend."""
    dtype, n = x.dtype, x.size
    full = x.reshape(n // 1024, 1024)  # 8 ranks' shards of a (rows, 1024) matrix, axis 0
    exp, payload = jax.jit(bitfields.split)(full)
    rows = []
    for impl in impls:
        unfused = jax.jit(lambda e, p, impl=impl: (
            lambda w: (w, checksum.checksum_shards(w, 0, CHECK_RANKS)))(
                K.decode(e, p, dtype, impl=impl)))
        cases = [(impl, "decode+chk", unfused)]
        if impl in PALLAS or impl == "pallas":
            c = K.resolve(impl)
            cases.append((impl, "decode+chk fused", jax.jit(
                lambda e, p, c=c: K.decode_checksum_pallas(e, p, dtype, CHECK_RANKS,
                                                           backend=c.backend,
                                                           interpret=c.interpret))))
        want = None
        for name, op, fn in cases:
            got = jax.block_until_ready(fn(exp, payload))
            if want is None:
                want = got
            elif not (bool(jnp.all(bitfields.to_bits(got[0]) == bitfields.to_bits(want[0])))
                      and bool(jnp.all(got[1] == want[1]))):
                raise AssertionError(f"{op} ({name}) differs from the unfused decode")
            rows.append(_row(dtype_name, mb, n, name, op,
                             median_seconds(fn, exp, payload, reps=reps), x.nbytes, copy_gbps))
    return rows


def _row(dtype_name, mb, n, impl, op, t, nbytes, copy_gbps):
    gbps = nbytes / t / 1e9
    return dict(dtype=dtype_name, mb=mb, n=n, impl=impl, op=op, seconds=t, gbps=gbps,
                copy_gbps=copy_gbps, ratio=gbps / copy_gbps)


def bench_one(dtype_name: str, mb: float, impls, modes, reps: int, blocks=()) -> list[dict]:
    dtype = DTYPES[dtype_name]
    itemsize = np.dtype(dtype).itemsize
    n = int(mb * 2**20) // itemsize
    x = make_weights(dtype, n)
    nbytes = n * itemsize
    bits = bitfields.to_bits(x)
    t_copy = median_seconds(jax.jit(lambda w, s: w ^ s), bits, jnp.asarray(1, bits.dtype),
                            reps=reps)
    copy_gbps = nbytes / t_copy / 1e9
    rows = [_row(dtype_name, mb, n, "-", "copy", t_copy, nbytes, copy_gbps)]
    if "exponent" in modes:
        cache = bitfields.exponent(x)
        for impl, enc_fn, dec_fn in _exponent_cases(impls, blocks):
            enc = jax.jit(enc_fn)
            exp, payload, _ = jax.block_until_ready(enc(x, cache))
            dec = jax.jit(lambda e, p, dec_fn=dec_fn: dec_fn(e, p, dtype))
            for op, fn, args in (("encode", enc, (x, cache)), ("decode", dec, (exp, payload))):
                rows.append(_row(dtype_name, mb, n, impl, op, median_seconds(fn, *args,
                                                                             reps=reps),
                                 nbytes, copy_gbps))
            del exp, payload
        rows += _checked_decode_rows(dtype_name, mb, x, impls, reps, copy_gbps)
    if "word" in modes:
        rows += _word_rows(dtype_name, mb, x, impls, reps, copy_gbps)
    return rows + _escape_rows(dtype_name, mb, x, impls, reps, copy_gbps)


def _escape_rows(dtype_name, mb, x, impls, reps, copy_gbps) -> list[dict]:
    """Packing and filling the escapes at two densities (exponent mode's steady churn, word
    mode's), per what runs them (``kernels.escape_impl``: the jnp loops over the escapes, whose
    time follows their count, and the dense Triton kernels where an impl resolves to Triton),
    each kernel checked against the loops; and the receiver's checksum."""
    n, nbytes = x.size, x.nbytes
    bits = bitfields.to_bits(x)
    rows = []
    escape_impls = ["xla"] + sorted({K.escape_impl(i) for i in impls} - {"xla"})
    for share in (0.01, 0.1):
        words = escapes.pack_flags((jax.random.uniform(jax.random.key(2), (n,)) < share)[None])
        cap = int(n * share * 1.25)
        want = None
        for impl in escape_impls:
            pack = jax.jit(lambda v, w, cap=cap, impl=impl: K.escape_pack(v, w[0], cap,
                                                                          impl=impl))
            expand = jax.jit(lambda s, w, cap=cap, impl=impl: K.escape_fill_exponents(
                jnp.zeros((1, n), s.dtype), w, s[None], jnp.full((1,), cap), impl=impl))
            try:
                section = jax.block_until_ready(pack(bits, words))
                got = (section, jax.block_until_ready(expand(section, words)))
            except jax.errors.JaxRuntimeError as e:  # one kernel that fails here: the rest
                FAILED.append(f"escape kernels ({impl}): {str(e).splitlines()[0]}")  # still run
                print(f"note: {FAILED[-1]}", file=sys.stderr)
                continue
            if want is None:
                want = got
            elif not all(bool(jnp.all(a == b)) for a, b in zip(got, want)):
                raise AssertionError(f"escape kernels ({impl}) differ from the jnp loops")
            for op, fn, args in ((f"escape pack {share:.0%}", pack, (bits, words)),
                                 (f"escape expand {share:.0%}", expand, (section, words))):
                rows.append(_row(dtype_name, mb, n, impl, op,
                                 median_seconds(fn, *args, reps=reps), nbytes, copy_gbps))
    full = x.reshape(n // 1024, 1024)
    chk = jax.jit(lambda w: checksum.checksum_shards(w, 0, CHECK_RANKS))
    rows.append(_row(dtype_name, mb, n, "xla", "checksum", median_seconds(chk, full, reps=reps),
                     nbytes, copy_gbps))
    return rows


def _word_rows(dtype_name, mb, x, impls, reps, copy_gbps) -> list[dict]:
    n, nbytes = x.size, x.nbytes
    cached = _cached_words(x)
    b = 4  # the widest code: the decode reads the most code bits
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
    return rows


FAILED: list[str] = []  # kernels that failed to compile or run here (named in the notes)

COLUMNS = [
    ("dtype", 5, "dtype"), ("MB", 6, ("mb", "g")), ("impl", 14, "impl"), ("op", 16, "op"),
    ("ms", 9, lambda r: f"{r['seconds'] * 1e3:.3f}"), ("GB/s", 8, ("gbps", ".2f")),
    ("copy GB/s", 9, ("copy_gbps", ".2f")), ("vs copy", 7, ("ratio", ".2f")),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    FAILED.clear()  # this call's failures only
    on_gpu = jax.default_backend() == "gpu"
    impls, notes = list(args.impls), []
    skipped = [i for i in impls if i != "xla" and not on_gpu]
    if skipped:
        impls = [i for i in impls if i not in skipped]
        notes.append(f"{' '.join(skipped)} skipped: no GPU here, and interpret mode is not a "
                     "throughput figure")
    sizes = args.sizes_mb if on_gpu else [s for s in args.sizes_mb if s <= 64]
    if len(sizes) < len(args.sizes_mb):
        notes.append("sizes above 64 MB skipped on CPU")
    blocks = list(args.blocks) if on_gpu else []
    if args.blocks and not on_gpu:
        notes.append("Pallas block sizes skipped: no GPU here")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    dev = jax.devices()[0]
    print(f"# backend={jax.default_backend()} device={dev.device_kind} jax={jax.__version__}")
    rows = []
    for dtype_name in args.dtypes:
        for mb in sizes:
            new = bench_one(dtype_name, mb, impls, args.modes, args.reps, blocks)
            print_table(new, COLUMNS)
            rows += new
    write_results(args.out, dict(notes=notes + FAILED, reps=args.reps, rows=rows))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

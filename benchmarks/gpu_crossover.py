"""Where CIERA pays on GPUs, from counted bytes: the cost model's crossover bandwidth per mode for
H100 and H200, and which named interconnects fall below it.

Nothing here runs a GPU: it prices one gather of an OLMoE expert slab (16 MB bf16, the socket
sweep's tensor) with the planner's functions (``ciera_jax.planning.crossover``) on the built-in
H100 / H200 device profiles (HBM rate, launch cost, agreement), the codec's bytes per pass
(``costmodel.CODEC_PASS_BYTES``) at ``--fractions`` of that HBM rate, the planner's default
steady state of an expert weight (exponent changes from ``default_trace``, word bytes per weight
from ``default_word_trace``), and each interconnect's bus bandwidth (vendor rate x an
efficiency, stated per row). ``--kernels`` reads a ``kernel_throughput.py`` JSON from a GPU
(``benchmarks/gpu_check.sh``) and adds each mode's measured fraction of a copy.

    python benchmarks/gpu_crossover.py [--fractions 0.8 0.3] [--kernels results/gpu/kernel_throughput.json]
"""

from __future__ import annotations

import dataclasses
import json
import sys

from common import parser, print_table, write_results  # benchmarks/common.py, beside this script

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import crossover as xo
from ciera_jax.planning.traces import default_trace, default_word_trace

N_ELEMENTS = 4 * 2048 * 1024  # (4, 2048, 1024) bf16: 16 MB
DEVICES = {"H100": "h100-nvlink", "H200": "h200-nvlink"}  # device side of each profile
# name: (ranks in the ring, vendor GB/s per direction per GPU, bus efficiency, alpha, source)
LINKS = {
    "NVLink 4 (in a node)": (8, 450.0, 0.8, 3e-6,
                             "900 GB/s bidirectional; NCCL all-gather bus bw ~360 GB/s on 8 GPUs"),
    "InfiniBand NDR 400": (16, 50.0, 0.84, 8e-6, "one 400G NIC per GPU; NCCL ~42 GB/s"),
    "InfiniBand NDR 200": (16, 25.0, 0.84, 8e-6, "one 200G NIC per GPU; same efficiency"),
    "RoCE 100": (16, 12.5, 0.84, 10e-6, "100 GbE RDMA per GPU; same efficiency"),
    "25 GbE": (16, 3.125, 0.84, 30e-6, "TCP, 25 Gbit/s per GPU; same efficiency"),
}
MODE_OPS = {"exponent": ("encode", "decode"), "word": ("word_encode", "word_decode")}
PRICED = {"exponent": "ciera", "word": "word"}


def parse_args(argv=None):
    p = parser(__doc__, "gpu_crossover")
    p.add_argument("--fractions", type=float, nargs="+", default=[cm.CODEC_HBM_FRACTION, 0.3],
                   help="codec's achieved fraction of the HBM rate (default %(default)s)")
    p.add_argument("--kernels", default=None,
                   help="kernel_throughput.py JSON from a GPU: adds the measured fractions")
    return p.parse_args(argv)


def at_fraction(prof: links.Profile, fraction: float) -> links.Profile:
    """``prof`` whose codec streams at ``fraction`` of its HBM rate (the model's constant is
    CODEC_HBM_FRACTION: scale the rate it multiplies)."""
    return dataclasses.replace(prof, hbm_Bps=prof.hbm_Bps * fraction / cm.CODEC_HBM_FRACTION)


def measured_fractions(path: str) -> dict:
    """Each mode's codec as a fraction of a copy on the GPU: its counted bytes per element over
    the encode + decode time of the largest bf16 size, against the copy rate of that run."""
    rows = [r for r in json.load(open(path))["results"]["rows"] if r["dtype"] == "bf16"]
    mb = max(r["mb"] for r in rows)
    rows = [r for r in rows if r["mb"] == mb]
    out = {}
    for mode, (enc_op, dec_op) in MODE_OPS.items():
        best = {}
        for r in rows:
            if r["op"] in (enc_op, dec_op):
                best[r["op"]] = min(best.get(r["op"], r), r, key=lambda x: x["seconds"])
        if len(best) == 2:
            enc, dec = cm.CODEC_PASS_BYTES[PRICED[mode]]
            n, copy_Bps = best[enc_op]["n"], best[enc_op]["copy_gbps"] * 1e9
            t = best[enc_op]["seconds"] + best[dec_op]["seconds"]
            out[mode] = (enc + dec) * n / t / copy_Bps
    return out


def rows_for(fraction: float, label: str) -> list[dict]:
    rate = default_trace().rate("expert_up")
    bpw = default_word_trace().bpw("expert")
    rows = []
    for dev, prof_name in DEVICES.items():
        prof = at_fraction(links.Profile.load(prof_name), fraction)
        for link, (N, vendor, eff, alpha, src) in LINKS.items():
            p = xo.link_profile(prof, alpha, vendor * eff * 1e9)
            kw = {"exponent": dict(change_rate=rate), "word": dict(word_bpw=bpw)}
            t_plain = xo.predict("plain", N_ELEMENTS, N, p)
            row = dict(gpu=dev, fraction=fraction, fraction_source=label, link=link, ranks=N,
                       beta_GBps=vendor * eff, link_source=src, plain_us=t_plain * 1e6)
            for mode in ("exponent", "word"):
                t = xo.predict(mode, N_ELEMENTS, N, p, **kw[mode])
                row[f"{mode}_ratio"] = t / t_plain
                row[f"{mode}_crossover_GBps"] = xo.crossover_beta(
                    mode, N_ELEMENTS, N, p, **kw[mode]) / 1e9
            rows.append(row)
    return rows


def _verdict(mode):
    return lambda r: (f"{r[f'{mode}_ratio']:.2f} " +
                      ("yes" if r[f"{mode}_ratio"] < 1 else "no"))


COLUMNS = [("gpu", 4, "gpu"), ("HBM frac", 8, ("fraction", ".2f")), ("link", 20, "link"),
           ("N", 3, "ranks"), ("bus GB/s", 8, ("beta_GBps", ".1f")),
           ("plain us", 8, ("plain_us", ".0f")),
           ("exp x", 8, _verdict("exponent")), ("exp pays <", 10,
                                                 ("exponent_crossover_GBps", ".0f")),
           ("word x", 8, _verdict("word")), ("word pays <", 11, ("word_crossover_GBps", ".0f"))]


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for f in args.fractions:
        rows += rows_for(f, "stated")
    measured = measured_fractions(args.kernels) if args.kernels else {}
    for mode, f in measured.items():
        print(f"measured ({args.kernels}): {mode} codec at {f:.2f} of a copy")
        rows += [dict(r, measured_mode=mode) for r in rows_for(f, f"measured ({mode})")]
    print(f"one gather of {N_ELEMENTS * 2 / 2**20:.0f} MB bf16; exponent at "
          f"{default_trace().rate('expert_up'):.2%} changed exponents, word at "
          f"{default_word_trace().bpw('expert'):.3f} B/weight (the planner's expert defaults); "
          "'x' = time / plain, 'pays <' = the bus GB/s below which the mode beats plain")
    print_table(rows, COLUMNS)
    write_results(args.out, dict(n_elements=N_ELEMENTS, rows=rows, measured_fractions=measured,
                                 notes=["priced by ciera_jax.planning.crossover.predict on the "
                                        "built-in device profiles; interconnect bus bandwidth "
                                        "= vendor rate x efficiency (link_source)",
                                        "per gather: word mode's step also skips the backward "
                                        "re-gather, which this table does not count"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

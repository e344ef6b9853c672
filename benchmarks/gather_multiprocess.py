"""Plain-bits vs CIERA all-gather across real processes over sockets (gloo), optionally through
a bandwidth-limited link between network namespaces.

For 2 and 4 processes (each with ``--local-devices`` CPU devices, default 1) it gathers OLMoE
expert up-projections ``(E, 2048, 1024)`` bf16 on the d_model axis, at each churn level, with
the plain bits gather and CIERA (steady state: primed cache carried, two weight versions that
differ in ``churn`` of their exponents alternate) timed interleaved in the same run. Links:

* ``loopback``  processes on 127.0.0.1 (``ciera_jax.runtime.launch.run_local``): gloo over the kernel's
                loopback, no bandwidth limit;
* ``10gbit``, ``1gbit`` (any tc rate): every process in its own network namespace, joined by
                veth links to a bridge, each link shaped with ``tc tbf`` in both directions
                (``ciera_jax.runtime.netns``), standing in for an inter-node network. Needs root,
                iproute2 and tc; where they are missing it says why and skips those links.

A second series (``--word-experts``, default 4 experts = 16 MB) gathers a weight pair whose
words differ by moves drawn from the measured steady-state distribution of word deltas
(``shared/studies/word_delta``) three ways, interleaved: plain bits, exponent mode and word mode
(``mp_gather_bench_worker.word_pair``). Targets: word <= 0.55x plain, exponent <= 0.75x plain.

Per row: median seconds per gather (the slowest process's median), ``time ciera/plain`` next to
``wire ciera/plain`` (bytes one rank sends, from CIERA's stats), and the plain gather's achieved
rate (bytes each rank receives per second). The self-checking gather's cost is timed as in
``gather_bench.py``: ``chk/ciera`` (the sender's and receiver's checksums as a separate call, over
the CIERA gather's time) and ``fused +`` (the gather with both checksums in one jit, over the
gather alone, less one).

    python benchmarks/gather_multiprocess.py [--procs 2 4] [--links loopback 10gbit 1gbit]
        [--experts 1 4] [--churn 0 0.01] [--word-experts 4] [--series churn word]
        [--reps 5] [--out PATH]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from common import parser, print_table, write_results  # benchmarks/common.py, beside this script

HERE = Path(__file__).resolve().parent
WORKER = "mp_gather_bench_worker"
D_MODEL, D_FF = 2048, 1024
METHODS = ("plain", "ciera", "checksum", "ciera_checked")


def parse_args(argv=None):
    p = parser(__doc__, "gather_multiprocess")
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--local-devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--links", nargs="+", default=["loopback", "10gbit", "1gbit"],
                   help="loopback and/or tc rates (e.g. 10gbit 1gbit); 'veth' = namespaces "
                        "without shaping")
    p.add_argument("--experts", type=int, nargs="+", default=[1, 4],
                   help=f"experts per tensor: (E, {D_MODEL}, {D_FF}) bf16 = 4 MB per expert")
    p.add_argument("--churn", type=float, nargs="+", default=[0.0, 0.01])
    p.add_argument("--word-experts", type=int, nargs="+", default=[4],
                   help="experts per tensor of the word-delta series (4 = 16 MB)")
    p.add_argument("--series", nargs="+", choices=("churn", "word"), default=["churn", "word"],
                   help="churn: plain vs CIERA at exponent churn levels; word: plain vs "
                        "exponent vs word mode on word deltas")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    return p.parse_args(argv)


def aggregate(results: list[dict], link: str, procs: int) -> list[dict]:
    """One row per (shape, churn): the slowest process's median for each method."""
    by_key: dict[tuple, dict] = {}
    for res in results:
        for r in res["records"]:
            if r.get("series") == "word_delta":
                continue
            key = (tuple(r["shape"]), r["target_change_rate"])
            row = by_key.setdefault(key, dict(link=link, procs=procs, devices=r["N"],
                                              shape=list(r["shape"]),
                                              mb=r["n_bytes"] / 2**20,
                                              churn=r["target_change_rate"], per_process={}))
            row[f"{r['method']}_s"] = max(row.get(f"{r['method']}_s", 0.0), r["seconds"])
            row["per_process"].setdefault(r["method"], []).append(r["seconds"])
            if r["method"] == "ciera":
                row.update(wire_ratio=r["wire_ratio"], measured_churn=r["change_rate"],
                           tier=r["stats"]["tier"], fallback=bool(r["stats"]["fallback"]))
    rows = []
    for row in by_key.values():
        row["time_ratio"] = row["ciera_s"] / row["plain_s"]
        row["checksum_vs_ciera"] = row["checksum_s"] / row["ciera_s"]
        row["checked_vs_ciera"] = row["ciera_checked_s"] / row["ciera_s"] - 1
        N = row["devices"]
        row["plain_recv_GBps"] = (N - 1) / N * row["mb"] * 2**20 / row["plain_s"] / 1e9
        rows.append(row)
    return rows


def aggregate_word(results: list[dict], link: str, procs: int) -> list[dict]:
    """One row per shape of the word-delta series: slowest process's median per mode."""
    by_shape: dict[tuple, dict] = {}
    for res in results:
        for r in res["records"]:
            if r.get("series") != "word_delta":
                continue
            row = by_shape.setdefault(tuple(r["shape"]), dict(
                series="word_delta", link=link, procs=procs, devices=r["N"],
                shape=list(r["shape"]), mb=r["n_bytes"] / 2**20))
            m = r["method"]
            row[f"{m}_s"] = max(row.get(f"{m}_s", 0.0), r["seconds"])
            if m != "plain":
                row[f"{m}_wire_ratio"] = r["wire_ratio"]
                row[f"{m}_stats"] = r["stats"]
    rows = list(by_shape.values())
    for row in rows:
        for m in ("exponent", "word"):
            row[f"{m}_time_ratio"] = row[f"{m}_s"] / row["plain_s"]
    return rows


def _ms(key):
    return lambda r: f"{r[key] * 1e3:.2f}"


WORD_COLUMNS = [
    ("link", 9, "link"), ("procs", 5, "procs"), ("MB", 4, ("mb", ".0f")),
    ("plain ms", 9, _ms("plain_s")), ("exp ms", 8, _ms("exponent_s")),
    ("word ms", 8, _ms("word_s")), ("t exp/p", 8, ("exponent_time_ratio", ".2f")),
    ("t word/p", 8, ("word_time_ratio", ".2f")), ("wire exp", 8, ("exponent_wire_ratio", ".3f")),
    ("wire word", 9, ("word_wire_ratio", ".3f")),
    ("bits", 4, lambda r: r["word_stats"]["code_bits"]),
]

COLUMNS = [
    ("link", 9, "link"), ("procs", 5, "procs"), ("dev", 3, "devices"), ("MB", 4, ("mb", ".0f")),
    ("churn", 6, ("churn", ".2%")), ("plain ms", 9, _ms("plain_s")),
    ("ciera ms", 9, _ms("ciera_s")), ("t ciera/plain", 13, ("time_ratio", ".2f")),
    ("wire c/p", 8, ("wire_ratio", ".3f")), ("plain GB/s", 10, ("plain_recv_GBps", ".3f")),
    ("chk/ciera", 9, ("checksum_vs_ciera", ".1%")), ("fused +", 8, ("checked_vs_ciera", ".1%")),
    ("fb", 2, lambda r: "y" if r["fallback"] else "-"),
]


def parse_results(outs: list[str]) -> list[dict]:
    res = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"a worker printed no RESULT line:\n{out[-2000:]}")
        res.append(json.loads(lines[-1][len("RESULT "):]))
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the workers are killed and the namespaces torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from ciera_jax.runtime import netns
    from ciera_jax.runtime.launch import run_local

    churn = "churn" in args.series
    spec = json.dumps(dict(shapes=[[e, D_MODEL, D_FF] for e in args.experts] if churn else [],
                           axis=1, churn=args.churn, reps=args.reps, warmup=args.warmup,
                           methods=METHODS,
                           word_shapes=([[e, D_MODEL, D_FF] for e in args.word_experts]
                                        if "word" in args.series else [])))
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    shaped = [lk for lk in args.links if lk != "loopback"]
    ns_ok, ns_why = (netns.available() if shaped else (False, "no namespace links asked for"))
    if shaped and not ns_ok:
        print(f"bandwidth-limited links skipped ({', '.join(shaped)}): {ns_why}", flush=True)
    print(f"gather_multiprocess: {args.local_devices} CPU device(s) per process, bf16 "
          f"(E, {D_MODEL}, {D_FF}) on axis 1, median of {args.reps}, slowest process",
          flush=True)

    rows, word_rows, skipped, failures = [], [], [], []
    t0 = time.perf_counter()
    for link in args.links:
        if link != "loopback" and not ns_ok:
            skipped.append(dict(link=link, reason=ns_why))
            continue
        for procs in args.procs:
            t_launch = time.perf_counter()
            try:
                if link == "loopback":
                    outs = run_local(WORKER, [spec], num_processes=procs,
                                     local_devices=args.local_devices, timeout_s=args.timeout,
                                     env=env)
                else:
                    rate = None if link == "veth" else link
                    with netns.LimitedLink(procs, rate) as lk:
                        outs = netns.run_in_namespaces(lk, WORKER, [spec],
                                                       local_devices=args.local_devices,
                                                       timeout_s=args.timeout, env=env)
                results = parse_results(outs)
                new = aggregate(results, link, procs)
                new_word = aggregate_word(results, link, procs)
            except (RuntimeError, OSError) as e:
                print(f"{link} x {procs} processes failed: {str(e)[:1500]}", flush=True)
                failures.append(dict(link=link, procs=procs, error=str(e)[-3000:]))
                continue
            for r in new:
                r["launch_s"] = time.perf_counter() - t_launch
            if new:
                print_table(new, COLUMNS, header=not rows)
            if new_word:
                print_table(new_word, WORD_COLUMNS)
            rows += new
            word_rows += new_word
    elapsed = time.perf_counter() - t0
    write_results(args.out, dict(
        local_devices=args.local_devices, reps=args.reps, seconds=elapsed,
        rows=rows, word_rows=word_rows, skipped=skipped, failures=failures,
        notes=["time_ratio = ciera / plain bits; wire_ratio = bytes one rank sends, "
               "ciera / plain",
               "shaped links: per-process namespace, veth to a bridge, tc tbf at the "
               "rate in both directions (ciera_jax.runtime.netns)",
               "times are the slowest process's median per method",
               "checksum_vs_ciera = checksum_s / ciera_s; checked_vs_ciera = "
               "ciera_checked_s / ciera_s - 1 (see gather_bench.py)",
               "word_rows: plain bits, exponent mode, word mode on a pair of weights whose "
               "words differ by steady-state word deltas; targets word <= 0.55x, exponent "
               "<= 0.75x plain time"]))
    return 1 if failures and not (rows or word_rows) else 0


if __name__ == "__main__":
    sys.exit(main())

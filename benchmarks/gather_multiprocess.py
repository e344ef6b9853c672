"""Where CIERA pays: plain-bits vs CIERA all-gathers across real processes over sockets (gloo),
through bandwidth-limited links between network namespaces, swept over link rates, each point
next to the cost model's prediction.

For 2 and 4 processes (each with ``--local-devices`` CPU devices, default 1) it gathers OLMoE
expert up-projections ``(E, 2048, 1024)`` bf16 on the d_model axis. Two series, every mode
timed interleaved in the same run:

* churn: plain bits and CIERA exponent mode (steady state: primed cache carried, two weight
  versions that differ in ``churn`` of their exponents alternate);
* word (``--word-experts``, default 4 experts = 16 MB): plain bits, exponent mode and word mode
  on a weight pair whose words differ by moves drawn from the measured steady-state
  distribution of word deltas (``ciera_jax.calibrate.kit.word_pair``).

Links: ``loopback`` (processes on 127.0.0.1, no limit), or tc rates (default the sweep
50mbit..10gbit): every process in its own network namespace, joined by veth links to a bridge,
each link shaped with ``tc tbf`` in both directions (``ciera_harness.netns``). One launch per
process count serves every rate: each process reshapes its own link, all wait for each other,
then time. Needs root, iproute2 and tc; where they are missing it says why and skips them.

The prediction: each launch first calibrates (``ciera_jax.calibrate.calibrate``, what ``ciera
calibrate`` measures, over the unshaped sockets: codec rates, escape cost, agreement), times
each codec pass alone (``--passes-mb``: where the codec's time goes), and at each rate fits the
link's alpha and beta from plain gathers of ``--link-sizes`` (the calibration's own fit, at
sizes other than the series', through the gathers that faulted in no fresh host memory and
whose working set fit the last-level cache: the calibration prices both apart, its
``fault_Bps`` and ``spill_Bps`` over this host's ``llc_bytes`` and ``host_cores``, and every
gather counts the fresh bytes its process faulted in per call). ``--reprice`` prices a sweep's
JSON again with the current model, measuring nothing (a calibration from before the spill term
gets this host's cache and cores and its host rates fitted again from its fault gathers). Every
measured point is then priced by the step model that ``ciera plan``, ``simulate`` and ``aot``
end with (``ciera_jax.sim.step.simulate_gather``: a step whose only work is that gather, its
codec term this host's calibration) and printed as measured, predicted and their ratio; then
how many plain gathers the model predicts within 25% (the model's CPU check) and, per series,
mode and process count, the crossover rate below which the mode beats plain, measured and
predicted (``sweep_report.py``). ``--png`` draws it (``crossover_plot.py``).

Per rate row: median seconds per gather (the slowest process's median), time and wire ratios
to plain. Every timed gather of a series starts after a barrier of all processes (``--no-sync``:
none), so its time does not hold its peers still decoding the mode timed before it. ``--checks`` also times the self-check as in ``gather_bench.py``.

    python benchmarks/gather_multiprocess.py [--procs 2 4] [--links 50mbit ... 10gbit]
        [--experts 4] [--churn 0.01] [--word-experts 4] [--series churn word]
        [--reps 5] [--out PATH] [--png PATH]
    python benchmarks/gather_multiprocess.py --out benchmarks/results/crossover.json \
        --png docs/crossover.png                                    # the sweep of docs/results.md
    python benchmarks/gather_multiprocess.py --reprice OLD.json --out NEW.json --png NEW.png
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


SWEEP = ["50mbit", "100mbit", "300mbit", "1gbit", "3gbit", "10gbit"]  # log-spaced, ~3.2x


def parse_args(argv=None):
    p = parser(__doc__, "gather_multiprocess", png=True)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--local-devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--links", nargs="+", default=SWEEP,
                   help="tc rates (default the sweep: %(default)s) and/or loopback; 'veth' = "
                        "namespaces without shaping")
    p.add_argument("--experts", type=int, nargs="+", default=[4],
                   help=f"experts per tensor: (E, {D_MODEL}, {D_FF}) bf16 = 4 MB per expert")
    p.add_argument("--churn", type=float, nargs="+", default=[0.01])
    p.add_argument("--word-experts", type=int, nargs="+", default=[4],
                   help="experts per tensor of the word-delta series (4 = 16 MB)")
    p.add_argument("--series", nargs="+", choices=("churn", "word"), default=["churn", "word"],
                   help="churn: plain vs CIERA at exponent churn levels; word: plain vs "
                        "exponent vs word mode on word deltas")
    p.add_argument("--checks", action="store_true",
                   help="also time the self-check (checksum alone, and fused into the gather)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip the calibration (then nothing is predicted)")
    p.add_argument("--link-sizes", nargs="+", default=["1M", "8M", "32M"],
                   help="plain gathers that fit each link's alpha and beta (none: no fit)")
    p.add_argument("--passes-mb", type=float, default=16,
                   help="size at which each codec pass is timed alone (0: not timed)")
    p.add_argument("--reprice", metavar="JSON", default=None,
                   help="measure nothing: price a sweep's JSON again with this code (link fits "
                        "from its gathers, every point), written to --out and --png")
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="time the series without a barrier before each gather (then a gather's "
                        "time holds its peers still finishing the mode before it)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300, help="seconds per link of a launch")
    return p.parse_args(argv)


def aggregate(results: list[dict], link: str, procs: int) -> list[dict]:
    """One row per (shape, churn) at ``link``: the slowest process's median for each method."""
    by_key: dict[tuple, dict] = {}
    for res in results:
        for r in res["records"]:
            if r.get("series") == "word_delta" or r.get("link", link) != link:
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
                           rung=r["stats"]["rung"], fallback=bool(r["stats"]["fallback"]))
    rows = []
    for row in by_key.values():
        row["time_ratio"] = row["ciera_s"] / row["plain_s"]
        if "checksum_s" in row:
            row["checksum_vs_ciera"] = row["checksum_s"] / row["ciera_s"]
            row["checked_vs_ciera"] = row["ciera_checked_s"] / row["ciera_s"] - 1
        N = row["devices"]
        row["plain_recv_GBps"] = (N - 1) / N * row["mb"] * 2**20 / row["plain_s"] / 1e9
        rows.append(row)
    return rows


def aggregate_word(results: list[dict], link: str, procs: int) -> list[dict]:
    """One row per shape of the word-delta series at ``link``: slowest process's median per
    mode."""
    by_shape: dict[tuple, dict] = {}
    for res in results:
        for r in res["records"]:
            if r.get("series") != "word_delta" or r.get("link", link) != link:
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
    ("fb", 2, lambda r: "y" if r["fallback"] else "-"),
]
CHECK_COLUMNS = [("chk/ciera", 9, ("checksum_vs_ciera", ".1%")),
                 ("fused +", 8, ("checked_vs_ciera", ".1%"))]


def parse_results(outs: list[str]) -> list[dict]:
    res = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"a worker printed no RESULT line:\n{out[-2000:]}")
        res.append(json.loads(lines[-1][len("RESULT "):]))
    return res


def launch(link_names: list[str], procs: int, spec: dict, args, env) -> list[dict]:
    """One process group for every link of ``link_names``: shaped ones in namespaces (each
    process reshapes its own link between rates), or loopback."""
    from ciera_harness import netns
    from ciera_harness.launch import run_local

    spec = json.dumps(dict(spec, links=link_names))
    timeout = args.timeout * (len(link_names) + (2 if args.calibrate else 0))
    if link_names == ["loopback"]:
        outs = run_local(WORKER, [spec], num_processes=procs, local_devices=args.local_devices,
                         timeout_s=timeout, env=env)
    else:
        first = None if link_names[0] == "veth" else link_names[0]
        with netns.LimitedLink(procs, first) as lk:
            outs = netns.run_in_namespaces(lk, WORKER, [spec], local_devices=args.local_devices,
                                           timeout_s=timeout, env=env)
    return parse_results(outs)


def reprice_file(args) -> int:
    """``--reprice``: a sweep's measurements priced again by the current model."""
    from sweep_report import reprice  # benchmarks/, beside this script

    old = json.loads(Path(args.reprice).read_text())
    res = reprice(old["results"])
    res["repriced_from"] = dict(command=old.get("command"), date=old.get("date"),
                                machine=old.get("machine"), path=args.reprice)
    doc = write_results(args.out, res)
    if args.png:
        from crossover_plot import draw  # benchmarks/, beside this script

        draw(doc, args.png)
        print(f"wrote {args.png}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reprice:
        return reprice_file(args)
    # SIGTERM unwinds like Ctrl-C: the workers are killed and the namespaces torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from ciera_harness import netns
    from sweep_report import report  # benchmarks/, beside this script

    churn = "churn" in args.series
    methods = METHODS if args.checks else ("plain", "ciera")
    spec = dict(shapes=[[e, D_MODEL, D_FF] for e in args.experts] if churn else [],
                axis=1, churn=args.churn, reps=args.reps, warmup=args.warmup, methods=methods,
                word_shapes=([[e, D_MODEL, D_FF] for e in args.word_experts]
                             if "word" in args.series else []),
                link_sizes=args.link_sizes, calibrate=args.calibrate,
                calibrate_reps=max(3, args.reps), passes_mb=args.passes_mb, sync=args.sync)
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    shaped = [lk for lk in args.links if lk != "loopback"]
    ns_ok, ns_why = (netns.available() if shaped else (False, "no namespace links asked for"))
    if shaped and not ns_ok:
        print(f"bandwidth-limited links skipped ({', '.join(shaped)}): {ns_why}", flush=True)
    print(f"gather_multiprocess: {args.local_devices} CPU device(s) per process, bf16 "
          f"(E, {D_MODEL}, {D_FF}) on axis 1, median of {args.reps}, slowest process; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)

    groups = ([["loopback"]] if "loopback" in args.links else []) + ([shaped] if ns_ok and
                                                                      shaped else [])
    rows, word_rows, launches, failures = [], [], [], []
    skipped = [dict(link=lk, reason=ns_why) for lk in shaped if not ns_ok]
    t0 = time.perf_counter()
    for link_names in groups:
        for procs in args.procs:
            t_launch = time.perf_counter()
            try:
                results = launch(link_names, procs, spec, args, env)
            except (RuntimeError, OSError) as e:
                print(f"{' '.join(link_names)} x {procs} processes failed: {str(e)[:1500]}",
                      flush=True)
                failures.append(dict(links=link_names, procs=procs, error=str(e)[-3000:]))
                continue
            launches.append(dict(links=link_names, procs=procs, results=results,
                                 seconds=time.perf_counter() - t_launch))
            for link in link_names:
                new, new_word = aggregate(results, link, procs), aggregate_word(results, link,
                                                                                  procs)
                if new:
                    print_table(new, COLUMNS + (CHECK_COLUMNS if args.checks else []))
                if new_word:
                    print_table(new_word, WORD_COLUMNS)
                rows += new
                word_rows += new_word
    sweep = report(launches)
    elapsed = time.perf_counter() - t0
    print(f"sweep: {elapsed:.0f} s, load {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
          flush=True)
    doc = write_results(args.out, dict(
        local_devices=args.local_devices, reps=args.reps, seconds=elapsed,
        rows=rows, word_rows=word_rows, **sweep, skipped=skipped, failures=failures,
        notes=["time_ratio = ciera / plain bits; wire_ratio = bytes one rank sends, "
               "ciera / plain",
               "shaped links: per-process namespace, veth to a bridge, tc tbf at the "
               "rate in both directions (ciera_harness.netns); one launch per process "
               "count serves every rate, each process reshaping its own link",
               "times are the slowest process's median per method",
               "points: every (series, link, procs, mode) measured next to the step model's "
               "prediction (ciera_jax.sim.step.simulate_gather: a step whose only work is "
               "that gather) on the calibrated profile of that process count with the "
               "link's alpha and beta fitted from plain gathers of --link-sizes",
               "plain_within_25: the plain gathers the model predicts within 25%, and its "
               "misses",
               "crossovers: the link rate below which a mode beats plain, log-interpolated "
               "(ciera_jax.planning.crossover.log_crossover)",
               "word_rows: plain bits, exponent mode, word mode on a pair of weights whose "
               "words differ by steady-state word deltas"]))
    if args.png and sweep["points"]:
        from crossover_plot import draw  # benchmarks/, beside this script

        draw(doc, args.png)
        print(f"wrote {args.png}")
    return 1 if failures and not (rows or word_rows) else 0


if __name__ == "__main__":
    sys.exit(main())

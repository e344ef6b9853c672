"""The link-rate sweep of gather_multiprocess.py turned into its answer: every measured point
next to the step model's prediction, and the crossover rates, measured and predicted.

:func:`report` takes the launches (each: the links it swept, its process count and every
process's RESULT) and returns ``points``, ``crossovers``, ``calibrations``, ``passes``,
``link_fits``, ``within_25`` (points the model predicts within 25%, per mode) and
``plain_within_25`` (the model's CPU check: the plain gathers within 25%, and the misses) for
the JSON, printing their tables on the way. The prediction is the step model's
(``ciera_jax.sim.step.simulate_gather``: a step whose only work is the point's gather, priced
by the terms every predicted step adds up) on the launch's calibrated profile with the link's
fitted alpha and beta; its codec term is this host's calibration (``ciera calibrate``'s
measured rates), so a miss here is a miss of the model ``ciera plan``, ``simulate`` and ``aot``
end with. ``counted_s`` is the same with every codec priced as its counted bytes. ``host_s`` is
the part of the prediction the host spends faulting in fresh memory (the calibrated
``fault_Bps`` on the profile's fresh bytes for the size, ``fresh_predicted``; ``fresh_bytes``
is what the slowest process counted per call; ``fresh_priced_s`` the prediction with those
instead). ``spill_s`` is the part its copies beyond the last-level cache take (``spill_bytes``
at the calibrated ``spill_Bps``). The link fits run through the gathers that did neither, or
take each gather's host time off.
"""

from __future__ import annotations

import dataclasses
import math

from common import print_table  # benchmarks/common.py, beside this script

from ciera_jax.calibrate import host as host_info
from ciera_jax.calibrate.fit import clean, fit_alpha_beta, fit_host_rates, with_spill
from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.planning import crossover as xo
from ciera_jax.sim.step import simulate_gather
from ciera_harness.netns import rate_bits

MODE_OF = {"plain": "plain", "ciera": "exponent", "exponent": "exponent", "word": "word"}
METHOD_OF = {"plain": "plain", "exponent": "ciera", "word": "word"}  # simulate_gather's names
TOL = 0.25  # the model's CPU check: a point within 25% of its prediction


def link_rate(link: str) -> float | None:
    """Bits per second of a shaped link's name; None for loopback / unshaped veth."""
    return None if link in ("loopback", "veth") else float(rate_bits(link))


def series_name(r: dict) -> str:
    return "word" if r.get("series") == "word_delta" else f"churn {r['target_change_rate']:g}"


def link_recs(results: list[dict], link: str, N: int) -> list[dict] | None:
    """Every process's plain gathers of the fit sizes at ``link``: the slowest process per
    size, as the series take it, with the fresh bytes it counted."""
    fits = [res["links"].get(link, {}).get("gathers") for res in results]
    if not all(fits):
        return None
    recs = []
    for g in zip(*fits):
        slow = max(g, key=lambda x: x["seconds"])
        recs.append(dict(N=N, n_bytes=g[0]["n_bytes"], seconds=slow["seconds"],
                         fresh_bytes=slow.get("fresh_bytes", 0.0)))
    return recs


def fit_link_recs(recs: list[dict] | None, base: links.Profile | None = None) -> dict | None:
    """alpha and beta of a link: the line through the gathers that faulted in no fresh memory
    and spilled nothing beyond the cache (``fit.clean``) where there are two, so the host's
    costs, priced apart, cannot bend it; else every gather less its host time at ``base``'s
    rates."""
    if not recs:
        return None
    fault_Bps = base.fault_Bps if base else 0.0
    spill_Bps = base.spill_Bps if base else 0.0
    recs = with_spill(recs, base)
    use = clean(recs)
    use = use if len(use) >= 2 else recs
    alpha, beta = fit_alpha_beta(use, fault_Bps, spill_Bps)
    return dict(alpha_s=alpha, beta_Bps=beta, fault_Bps=fault_Bps, spill_Bps=spill_Bps,
                gathers=recs, fitted_on=[r["n_bytes"] for r in use])


def fit_link(results: list[dict], link: str, N: int, base: links.Profile | None) -> dict | None:
    """alpha and beta of ``link`` from every process's plain gathers (:func:`fit_link_recs`)."""
    return fit_link_recs(link_recs(results, link, N), base)


def refit_host(calib: dict) -> links.Profile:
    """A calibration's profile; one from before the cache-spill term (no ``llc_bytes``) gets
    this host's cache and cores and both host rates fitted again from its fault gathers
    (``fit.fit_host_rates`` on its alpha and beta), as ``ciera calibrate`` fits them."""
    prof = links.Profile(**calib["profile"])
    recs = (calib.get("details") or {}).get("faults")
    if "llc_bytes" in calib["profile"] or not recs:
        return prof
    prof = dataclasses.replace(prof, llc_bytes=host_info.llc_bytes(),
                               host_cores=host_info.host_cores())
    recs = with_spill(recs, prof)
    fault_Bps, spill_Bps = fit_host_rates(recs, prof.alpha_s, prof.beta_Bps)
    return dataclasses.replace(prof, fault_Bps=fault_Bps, spill_Bps=spill_Bps)


def measured(results: list[dict], link: str) -> dict:
    """``(series, shape) -> {mode: (slowest median seconds, rank-0 stats, the slowest
    process's fresh bytes per call)}`` at ``link``."""
    out: dict = {}
    for res in results:
        for r in res["records"]:
            if r.get("link") != link or r["method"] not in MODE_OF:
                continue
            key = (series_name(r), tuple(r["shape"]))
            m = MODE_OF[r["method"]]
            t, st, fresh = out.setdefault(key, {}).get(m, (0.0, None, None))
            if r["seconds"] >= t:
                t, fresh = r["seconds"], r.get("fresh_bytes")
            out[key][m] = (t, st if st is not None else r.get("stats"), fresh)
    return out


def inputs(mode: str, shape, N: int, stats: dict | None) -> dict:
    """What the planner prices a point from: exponent mode's agreed churn per shard element,
    word mode's bytes per weight sent (the gather's own stats)."""
    n = math.prod(shape)
    if mode == "exponent":
        return dict(change_rate=stats["agreed_changed"] / (n // N))
    if mode == "word":
        return dict(word_bpw=stats["sent_bytes"] * N / n)
    return {}


def model_s(mode: str, n: int, N: int, prof: links.Profile, kw: dict) -> float:
    """The step model's seconds for one gather of ``mode`` on ``n`` bf16 elements."""
    return simulate_gather(2 * n, N, prof, METHOD_OF[mode], **kw)


def make_point(series: str, link: str, N: int, mode: str, shape, t: float, plain_s: float,
               kw: dict, wire_ratio: float, fresh, prof: links.Profile | None) -> dict:
    """One measured point next to the step model's prediction on ``prof`` (None: unpriced)."""
    n = math.prod(shape)
    full_bytes = n * 2
    pred = model_s(mode, n, N, prof, kw) if prof else None
    pred_plain = model_s("plain", n, N, prof, {}) if prof else None
    # every codec priced as its counted bytes instead of the calibration's rates
    counted = dataclasses.replace(prof, codec_pricing="counted") if prof else None
    host = cm.host_fault_time(full_bytes, prof) if prof else None
    spill = cm.host_spill_time(full_bytes, N, prof) if prof else None
    return dict(
        series=series, link=link, rate_bps=link_rate(link), procs=N, mode=mode,
        mb=full_bytes / 2**20, shape=list(shape), inputs=kw, measured_s=t, ratio=t / plain_s,
        wire_ratio=wire_ratio, predicted_s=pred,
        counted_s=model_s(mode, n, N, counted, kw) if prof else None,
        predicted_ratio=(pred / pred_plain if pred is not None else None),
        host_s=host, spill_s=spill, fresh_bytes=fresh,
        fresh_predicted=cm.fresh_bytes(full_bytes, prof) if prof else None,
        # the same prediction with the fresh bytes this point counted
        fresh_priced_s=(pred - host + fresh / prof.fault_Bps if prof and prof.fault_Bps and
                        fresh is not None else pred),
        error=(t / pred - 1 if pred else None))


def launch_points(launch: dict) -> tuple[list[dict], dict]:
    """Every (series, link, mode) of one launch, measured and predicted; and its link fits."""
    results, N = launch["results"], launch["procs"]
    calib = results[0].get("calibration")
    base = links.Profile(**calib["profile"]) if calib else None
    points, fits = [], {}
    for link in launch["links"]:
        fit = fit_link(results, link, N, base)
        fits[link] = fit
        prof = xo.link_profile(base, fit["alpha_s"], fit["beta_Bps"]) if base and fit else None
        for (series, shape), modes in measured(results, link).items():
            plain_s = modes["plain"][0]  # (seconds, stats, fresh bytes)
            for mode, (t, stats, fresh) in modes.items():
                wire = stats["sent_bytes"] / stats["plain_bytes"] if stats else 1.0
                points.append(make_point(series, link, N, mode, shape, t, plain_s,
                                         inputs(mode, shape, N, stats), wire, fresh, prof))
    return points, fits


def reprice(res: dict) -> dict:
    """A sweep's JSON ``results`` priced again by this code: the link fits redone from their
    gathers, every point from its measured time and inputs (older JSONs: taken from the rows'
    stats). The measurements are untouched."""
    stats_of = {}
    for r in res["rows"]:
        stats_of[(f"churn {r['churn']:g}", r["link"], r["procs"], "exponent")] = dict(
            change_rate=r["measured_churn"])
    for r in res["word_rows"]:
        for m in ("exponent", "word"):
            stats_of[("word", r["link"], r["procs"], m)] = inputs(m, r["shape"], r["devices"],
                                                                 r[f"{m}_stats"])
    bases = {c["procs"]: refit_host(c) for c in res["calibrations"]}
    calibrations = [dict(c, profile=dataclasses.asdict(bases[c["procs"]]))
                    for c in res["calibrations"]]
    fits, points = [], []
    for f in res["link_fits"]:
        base = bases.get(f["procs"])
        recs = [dict(g, N=f["procs"]) for g in f.get("gathers") or []]
        fit = fit_link_recs(recs, base)
        fits.append(dict(procs=f["procs"], link=f["link"], **(fit or {})))
        prof = xo.link_profile(base, fit["alpha_s"], fit["beta_Bps"]) if base and fit else None
        for p in res["points"]:
            if (p["procs"], p["link"]) != (f["procs"], f["link"]):
                continue
            kw = p.get("inputs", stats_of.get((p["series"], p["link"], p["procs"], p["mode"]),
                                              {}))
            shape = p.get("shape") or [int(p["mb"] * 2**19)]
            points.append(make_point(p["series"], p["link"], p["procs"], p["mode"], shape,
                                     p["measured_s"], p["measured_s"] / p["ratio"], kw,
                                     p["wire_ratio"], p.get("fresh_bytes"), prof))
    answer = print_answer(points, [bases[c["procs"]] for c in res["calibrations"]])
    return dict(res, points=points, link_fits=fits, calibrations=calibrations, **answer)


def crossovers(points: list[dict]) -> list[dict]:
    """Per series, mode and process count: the rate below which the mode beats plain."""
    out = []
    keys = sorted({(p["series"], p["procs"], p["mode"]) for p in points if p["mode"] != "plain"
                   and p["rate_bps"]})
    for series, procs, mode in keys:
        pts = sorted((p for p in points if (p["series"], p["procs"], p["mode"]) ==
                      (series, procs, mode) and p["rate_bps"]), key=lambda p: p["rate_bps"])
        rates = [p["rate_bps"] for p in pts]
        row = dict(series=series, procs=procs, mode=mode,
                   measured=xo.log_crossover(rates, [p["ratio"] for p in pts]))
        if all(p["predicted_ratio"] for p in pts):
            row["predicted"] = xo.log_crossover(rates, [p["predicted_ratio"] for p in pts])
        out.append(row)
    return out


def within(points: list[dict], tol: float = TOL) -> dict:
    """Per mode: how many points the model predicts within ``tol`` (its prediction, and the
    same at each point's counted fresh bytes)."""
    out = {}
    for mode in sorted({p["mode"] for p in points}):
        pts = [p for p in points if p["mode"] == mode and p.get("predicted_s")]
        out[mode] = dict(points=len(pts),
                         predicted=sum(abs(p["measured_s"] / p["predicted_s"] - 1) <= tol
                                       for p in pts),
                         fresh_priced=sum(abs(p["measured_s"] / p["fresh_priced_s"] - 1) <= tol
                                          for p in pts if p.get("fresh_priced_s")))
    return out


def plain_check(points: list[dict], tol: float = TOL) -> dict:
    """The model's CPU check: of the plain gathers (the link and the host, no codec), how many
    it predicts within ``tol``, and each one it misses with measured / predicted."""
    pts = [p for p in points if p["mode"] == "plain" and p.get("predicted_s")]
    misses = [dict(series=p["series"], link=p["link"], procs=p["procs"],
                   measured_over_predicted=p["measured_s"] / p["predicted_s"])
              for p in pts if abs(p["measured_s"] / p["predicted_s"] - 1) > tol]
    return dict(tol=tol, points=len(pts), within=len(pts) - len(misses), misses=misses)


def plain_line(check: dict) -> str:
    """``plain within 25% of the model: 21 of 24 points (misses, measured / predicted: ...)``."""
    line = (f"plain within {check['tol']:.0%} of the model: {check['within']} of "
            f"{check['points']} points")
    if check["misses"]:
        line += " (misses, measured / predicted: " + "; ".join(
            f"{m['series']} {m['link']} {m['procs']} processes {m['measured_over_predicted']:.2f}"
            for m in check["misses"]) + ")"
    return line


def _ms(key):
    return lambda r: "-" if r.get(key) is None else f"{r[key] * 1e3:.1f}"


def _x(key, fmt=".2f"):
    return lambda r: "-" if r.get(key) is None else format(r[key], fmt)


POINT_COLUMNS = [
    ("series", 10, "series"), ("link", 8, "link"), ("procs", 5, "procs"), ("mode", 8, "mode"),
    ("meas ms", 8, _ms("measured_s")), ("pred ms", 8, _ms("predicted_s")),
    ("meas/pred", 9, lambda r: "-" if r["error"] is None else f"{r['error'] + 1:.2f}"),
    ("counted ms", 10, _ms("counted_s")), ("host ms", 7, _ms("host_s")),
    ("spill ms", 8, _ms("spill_s")),
    ("fresh MB", 8, lambda r: "-" if r.get("fresh_bytes") is None else
     f"{r['fresh_bytes'] / 2**20:.0f}"),
    ("x plain", 7, _x("ratio")), ("pred x", 6, _x("predicted_ratio")),
    ("wire", 5, _x("wire_ratio", ".3f")),
]
CROSS_COLUMNS = [
    ("series", 10, "series"), ("procs", 5, "procs"), ("mode", 8, "mode"),
    ("measured", 16, lambda r: xo.describe(r["measured"])),
    ("predicted", 16, lambda r: xo.describe(r["predicted"]) if "predicted" in r else "-"),
]
PASS_COLUMNS = [("op", 16, "op"), ("ms", 8, _ms("seconds")), ("GB/s", 6, _x("gbps")),
                ("x copy", 6, _x("ratio"))]


def report(launches: list[dict]) -> dict:
    """Points, crossovers, calibrations, per-pass times and link fits of the sweep, printed."""
    points, calibrations, passes, link_fits = [], [], [], []
    for launch in launches:
        pts, fits = launch_points(launch)
        points += pts
        res0 = launch["results"][0]
        if res0.get("calibration"):
            from ciera_jax.calibrate.profile import profile_table

            calibrations.append(dict(procs=launch["procs"], **res0["calibration"]))
            print(f"calibration, {launch['procs']} processes over the unshaped sockets:")
            print(profile_table(links.Profile(**res0["calibration"]["profile"])), flush=True)
        if res0.get("passes"):
            passes.append(dict(procs=launch["procs"], rows=res0["passes"]))
            print(f"each codec pass alone, process 0 of {launch['procs']} (all running it):")
            print_table(res0["passes"], PASS_COLUMNS)
        link_fits += [dict(procs=launch["procs"], link=k, **(v or {})) for k, v in fits.items()]
    answer = print_answer(points, [links.Profile(**c["profile"]) for c in calibrations])
    return dict(points=points, calibrations=calibrations, passes=passes, link_fits=link_fits,
                **answer)


def model_source(profiles: list[links.Profile]) -> str:
    """What priced the points, in words: the step model and its codec term's source."""
    codec = "; ".join(sorted({cm.codec_source(p) for p in profiles})) or "codec: none"
    return ("the step model (ciera_jax.sim.step.simulate_gather) on each launch's calibrated "
            f"host profile and fitted link; {codec}")


def print_answer(points: list[dict], profiles: list[links.Profile]) -> dict:
    """Every point, how many the model predicts within 25% (per mode, and the plain check)
    and the crossovers, printed; returned as ``model`` (:func:`model_source` of the launches'
    ``profiles``), ``within_25``, ``plain_within_25``, ``crossovers``."""
    source = model_source(profiles)
    if points:
        print(f"every point, measured and predicted by {source}:")
        print_table(points, POINT_COLUMNS)
    close, plain = within(points), plain_check(points)
    if close:
        print("within 25% of the model: " + ", ".join(
            f"{m} {c['predicted']} of {c['points']} ({c['fresh_priced']} at counted fresh bytes)"
            for m, c in close.items()))
    if plain["points"]:
        print(plain_line(plain))
    cross = crossovers(points)
    if cross:
        print("crossover: the link rate below which a mode beats plain")
        print_table(cross, CROSS_COLUMNS)
    return dict(model=source, within_25=close, plain_within_25=plain, crossovers=cross)

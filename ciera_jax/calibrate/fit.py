"""The fits that turn timings into profile values: the ring all-gather model (with the host's
fresh-memory faults and its copies beyond the last-level cache), rate lines, and the fresh
bytes a gather of a size faults in."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ciera_jax.planning import costmodel as cm


def host_s(r: dict, fault_Bps: float = 0.0, spill_Bps: float = 0.0) -> float:
    """Seconds of gather ``r`` that are its host's: its measured ``fresh_bytes`` at
    ``fault_Bps`` and its ``spill_bytes`` (beyond the last-level cache) at ``spill_Bps``."""
    return ((r.get("fresh_bytes", 0.0) / fault_Bps if fault_Bps else 0.0) +
            (r.get("spill_bytes", 0.0) / spill_Bps if spill_Bps else 0.0))


def with_spill(recs: Sequence[dict], host) -> list[dict]:
    """Each gather with the bytes of its working set beyond the host's cache (the cost
    model's ``spill_bytes``; 0 where ``host`` names no cache, or is None)."""
    return [dict(r, spill_bytes=cm.spill_bytes(r["n_bytes"], r["N"], host) if host else 0.0)
            for r in recs]


def clean(recs: Sequence[dict]) -> list[dict]:
    """The gathers that neither faulted in fresh memory (under 1% of their bytes) nor spilled
    beyond the cache: the link's own line runs through them."""
    return [r for r in recs if r.get("fresh_bytes", 0.0) <= 0.01 * r["n_bytes"]
            and not r.get("spill_bytes", 0.0)]


def fit_alpha_beta(recs: Sequence[dict], fault_Bps: float = 0.0,
                   spill_Bps: float = 0.0) -> tuple[float, float]:
    """Least squares on relative error of ``t = (N-1)*alpha + (N-1)/N*bytes/beta``, both >= 0.

    ``recs`` hold ``N``, ``n_bytes`` (full tensor) and ``seconds`` per gather. Each gather's
    host time at the given rates (:func:`host_s`) is taken off first, so a gather that faulted
    in fresh memory or spilled beyond the cache does not bend the link's line.
    """
    A = np.array([[r["N"] - 1, (r["N"] - 1) / r["N"] * r["n_bytes"]] for r in recs], float)
    t = np.array([r["seconds"] - host_s(r, fault_Bps, spill_Bps) for r in recs], float)
    t = np.maximum(t, 0.1 * np.array([r["seconds"] for r in recs], float))
    Aw, tw = A / t[:, None], np.ones_like(t)
    coef, *_ = np.linalg.lstsq(Aw, tw, rcond=None)
    if coef[1] <= 0:  # bandwidth term unresolved: take it from the largest gather alone
        coef[1] = 0.0
    if coef[0] <= 0 or coef[1] <= 0:  # refit the other coefficient with one clamped
        j = 1 if coef[0] <= 0 else 0
        coef[1 - j] = 0.0
        coef[j] = max(np.linalg.lstsq(Aw[:, j:j + 1], tw, rcond=None)[0][0], 0.0)
    alpha = max(float(coef[0]), 1e-7)
    if coef[1] <= 0:
        big = max(recs, key=lambda r: r["n_bytes"])
        rest = max(big["seconds"] - (big["N"] - 1) * alpha, big["seconds"] * 0.1)
        return alpha, (big["N"] - 1) / big["N"] * big["n_bytes"] / rest
    return alpha, 1.0 / float(coef[1])


def fit_rate(n_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(bytes/s, fixed seconds)`` of a line through (bytes, seconds): slope and intercept.

    One point, or noise that swamps the size dependence (slope <= 0), gives the largest
    point's plain rate and no fixed cost.
    """
    if len(n_bytes) >= 2:
        slope, icpt = np.polyfit(n_bytes, seconds, 1)
    else:
        slope, icpt = seconds[0] / n_bytes[0], 0.0
    if slope <= 0:
        slope, icpt = max(seconds[-1], 1e-6) / n_bytes[-1], 0.0
    return 1.0 / float(slope), float(icpt)


def fit_host_rates(recs: Sequence[dict], alpha: float, beta: float) -> tuple[float, float]:
    """``(fault_Bps, spill_Bps)``: least squares on relative error of what each gather took
    beyond the link's line, ``fresh_bytes/fault_Bps + spill_bytes/spill_Bps`` (measured fresh
    bytes, the rule's spill bytes). Both rates, then each alone, are tried; the best fit whose
    coefficients are all > 0 is kept, a term it leaves out is 0 (no such cost)."""
    t = np.array([r["seconds"] for r in recs], float)
    extra = np.array([r["seconds"] - (r["N"] - 1) * alpha - (r["N"] - 1) / r["N"] *
                      r["n_bytes"] / beta for r in recs], float) / t
    X = np.array([[r.get("fresh_bytes", 0.0), r.get("spill_bytes", 0.0)] for r in recs],
                 float) / t[:, None]
    best, rates = math.inf, (0.0, 0.0)
    for cols in ([0, 1], [0], [1]):
        if len(recs) < len(cols) or not X[:, cols].any(axis=0).all():
            continue
        coef, *_ = np.linalg.lstsq(X[:, cols], extra, rcond=None)
        err = float(np.sum((X[:, cols] @ coef - extra) ** 2))
        if (coef > 0).all() and err < best:
            got = dict(zip(cols, 1.0 / coef))
            best, rates = err, (float(got.get(0, 0.0)), float(got.get(1, 0.0)))
    return rates


def fit_link_and_host(recs: Sequence[dict]) -> tuple[float, float, float, float]:
    """``(alpha, beta, fault_Bps, spill_Bps)``: the link's line through the :func:`clean`
    gathers (every gather, where fewer than two sizes are clean), then the host's rates
    (:func:`fit_host_rates`) from what every gather took beyond it, and the line again with
    those taken off where it had to run through unclean gathers."""
    use = clean(recs)
    if len({r["n_bytes"] for r in use}) < 2:
        use = list(recs)
    alpha, beta = fit_alpha_beta(use)
    fault_Bps, spill_Bps = fit_host_rates(recs, alpha, beta)
    if len(use) == len(recs) and (fault_Bps or spill_Bps):
        alpha, beta = fit_alpha_beta(recs, fault_Bps, spill_Bps)
    return alpha, beta, fault_Bps, spill_Bps


def fit_fresh_bytes(n_bytes: Sequence[float], fresh: Sequence[float]) -> tuple[float, float]:
    """``(fresh_from_bytes, fresh_per_byte)`` of the hinge ``fresh = per_byte * max(0, bytes -
    from)`` through measured (gather bytes, fresh bytes per gather): the line through the
    sizes from some size up (each split tried, the least squared error over all points kept).
    Nothing fresh anywhere: ``(0, 0)``."""
    pts = sorted(zip(map(float, n_bytes), map(float, fresh)))
    B = np.array([p[0] for p in pts])
    F = np.array([p[1] for p in pts])
    if len(pts) == 0 or F.max() <= 0:
        return 0.0, 0.0
    best = (math.inf, 0.0, 0.0)
    for i in range(len(pts)):
        if len(pts) - i >= 2 and B[i] < B[-1]:
            k, c = np.polyfit(B[i:], F[i:], 1)
            b0 = -c / k if k > 0 else B[i]
        else:  # one point: the line from the size below it
            b0 = B[i - 1] if i else 0.0
            k = F[i] / max(B[i] - b0, 1.0)
        lo = B[i - 1] if i else 0.0
        b0 = float(min(max(b0, lo), B[i]))
        k = float(np.sum(F * np.maximum(B - b0, 0)) / max(np.sum(np.maximum(B - b0, 0) ** 2),
                                                             1e-30))
        err = float(np.sum((F - k * np.maximum(B - b0, 0)) ** 2))
        if k > 0 and err < best[0]:
            best = (err, b0, k)
    return best[1], best[2]

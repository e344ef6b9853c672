"""The fits that turn timings into profile values: the ring all-gather model (with the host's
fresh-memory faults), rate lines, and the fresh bytes a gather of a size faults in."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def fit_alpha_beta(recs: Sequence[dict], fault_Bps: float = 0.0) -> tuple[float, float]:
    """Least squares on relative error of ``t = (N-1)*alpha + (N-1)/N*bytes/beta``, both >= 0.

    ``recs`` hold ``N``, ``n_bytes`` (full tensor) and ``seconds`` per gather. With a
    ``fault_Bps``, each gather's ``fresh_bytes`` (measured) at that rate are taken off its time
    first, so a gather that faulted in fresh memory does not bend the link's line.
    """
    A = np.array([[r["N"] - 1, (r["N"] - 1) / r["N"] * r["n_bytes"]] for r in recs], float)
    t = np.array([r["seconds"] - (r.get("fresh_bytes", 0.0) / fault_Bps if fault_Bps else 0.0)
                  for r in recs], float)
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


def fit_link_and_faults(recs: Sequence[dict]) -> tuple[float, float, float]:
    """``(alpha, beta, fault_Bps)``: least squares on relative error of
    ``t = (N-1)*alpha + (N-1)/N*bytes/beta + fresh_bytes/fault_Bps``, each ``fresh_bytes`` the
    gather's measured fresh host memory. Where the fresh bytes explain nothing (none faulted, or
    a coefficient <= 0), ``fault_Bps`` is 0 (no such term) and alpha and beta are
    :func:`fit_alpha_beta`'s."""
    F = np.array([r.get("fresh_bytes", 0.0) for r in recs], float)
    if len(recs) >= 3 and F.max(initial=0.0) > 0:
        A = np.array([[r["N"] - 1, (r["N"] - 1) / r["N"] * r["n_bytes"], f]
                      for r, f in zip(recs, F)], float)
        t = np.array([r["seconds"] for r in recs], float)
        coef, *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)
        if coef[2] > 0 and coef[1] > 0:
            fault_Bps = 1.0 / float(coef[2])
            return (*fit_alpha_beta(recs, fault_Bps), fault_Bps)
    return (*fit_alpha_beta(recs), 0.0)


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

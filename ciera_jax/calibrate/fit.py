"""The fits that turn timings into profile values: the ring all-gather model and rate lines."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_alpha_beta(recs: Sequence[dict]) -> tuple[float, float]:
    """Least squares on relative error of ``t = (N-1)*alpha + (N-1)/N*bytes/beta``, both >= 0.

    ``recs`` hold ``N``, ``n_bytes`` (full tensor) and ``seconds`` per gather.
    """
    A = np.array([[r["N"] - 1, (r["N"] - 1) / r["N"] * r["n_bytes"]] for r in recs], float)
    t = np.array([r["seconds"] for r in recs], float)
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

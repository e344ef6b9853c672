"""Where a compressed mode pays: the link rate below which it beats a plain gather.

A user's first question is whether CIERA speeds up *their* network. Both answers come from here:
the measured one (:func:`log_crossover` over a sweep's time ratios) and the modelled one
(:func:`predict`, :func:`crossover_beta`), which price a gather with the very functions the
planner calls (``t_plain``, ``t_ciera``, ``t_word``), so a point the model misses is a point the
planner misprices.

Modes: ``plain`` (bits), ``exponent`` (the exponent cache), ``word`` (the word cache). ``n`` is
the full tensor's elements, ``N`` the ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links

MODES = ("plain", "exponent", "word")


def link_profile(profile: links.Profile, alpha_s: float, beta_Bps: float) -> links.Profile:
    """``profile``'s device (codec, agreement) on another link (alpha, beta)."""
    return dataclasses.replace(profile, alpha_s=alpha_s, beta_Bps=beta_Bps)


def predict(mode: str, n: int, N: int, link: links.Link, *, change_rate: float = 0.0,
            word_bpw: float | None = None, bytes_per_elem: int = 2) -> float:
    """Seconds of one gather of ``mode``, as the planner prices it: exponent mode at
    ``change_rate`` (escaped exponents per shard element), word mode at ``word_bpw`` (bytes
    per weight sent), each with the agreement of one gather."""
    b = bytes_per_elem
    if mode == "plain":
        return cm.t_plain(n, N, b, link)
    if mode == "exponent":
        return cm.t_ciera(n, N, b - 1, change_rate, link)
    if mode == "word":
        return cm.t_word(n, N, b, word_bpw, link)
    raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")


def crossover_beta(mode: str, n: int, N: int, profile: links.Profile, **kw) -> float:
    """Link bandwidth (bytes/s, ``beta``) below which ``mode`` beats plain on ``profile``'s
    device: ``inf`` if it beats plain on any link, 0 if on none.

    Both times are linear in ``1/beta`` (alpha and the codec do not depend on it), so the
    difference ``A + W/beta`` is solved from two evaluations of :func:`predict`."""
    def diff(beta):
        p = dataclasses.replace(profile, beta_Bps=beta)
        return predict(mode, n, N, p, **kw) - predict("plain", n, N, p, **kw)

    b1, b2 = 1e9, 2e9
    d1, d2 = diff(b1), diff(b2)
    W = (d1 - d2) / (1 / b1 - 1 / b2)  # seconds x bytes/s: the wire saved, if negative
    A = d1 - W / b1  # what the mode adds whatever the link: codec, agreement
    if W >= 0:
        return 0.0 if A >= 0 else math.inf
    return math.inf if A <= 0 else -W / A


def log_crossover(rates: Sequence[float], ratios: Sequence[float]) -> dict:
    """The rate below which a mode beats plain, from ``ratios`` (mode / plain time) at
    ascending ``rates``: log-interpolated between the highest rate where it still wins
    (ratio < 1) and the next one. ``where`` says ``"between"``, ``"above the range"`` (it wins
    at every rate) or ``"below the range"`` (at none); ``rate`` is None outside the range."""
    pts = sorted(zip(rates, ratios))
    wins = [i for i, (_, q) in enumerate(pts) if q < 1]
    if not wins:
        return dict(rate=None, where="below the range")
    i = wins[-1]
    if i == len(pts) - 1:
        return dict(rate=None, where="above the range")
    (r0, q0), (r1, q1) = pts[i], pts[i + 1]
    f = -math.log(q0) / (math.log(q1) - math.log(q0))
    return dict(rate=math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))),
                where="between")


def describe(c: dict, unit: float = 1e9, suffix: str = "Gbit/s") -> str:
    """A crossover as text: ``0.35 Gbit/s``, ``above the range``, ``below the range``."""
    return f"{c['rate'] / unit:.3g} {suffix}" if c["rate"] is not None else c["where"]

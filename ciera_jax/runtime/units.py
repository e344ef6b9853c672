"""Byte sizes as people write and read them (binary units), for commands and tables."""

from __future__ import annotations

_UNITS = (("GB", 2**30), ("MB", 2**20), ("KB", 2**10))


def parse_size(s: str | int | float) -> int:
    """``"4K"``, ``"1.5M"``, ``"2G"``, ``"4096"`` -> bytes (binary units)."""
    if isinstance(s, (int, float)):
        return int(s)
    s = s.strip().upper().removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    num = s[:-1] if s[-1:] in ("K", "M", "G") else s
    try:
        return int(float(num) * mult)
    except ValueError:
        raise ValueError(f"cannot read size {s!r}; use bytes or a K/M/G suffix, e.g. 64K") from None


def fmt_bytes(n: float) -> str:
    """``1536 -> "1.5 KB"``: four significant digits in the largest unit that fits."""
    for unit, f in _UNITS:
        if abs(n) >= f:
            return f"{n / f:.4g} {unit}"
    return f"{int(n)} B"

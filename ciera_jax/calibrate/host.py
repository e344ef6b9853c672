"""What a host's gathers share: its last-level cache and the cores its ranks run on, read from
the system (``ciera calibrate`` puts them in the profile; the cost model's ``spill_bytes``)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache size: ``16384K``, ``32M``, or plain bytes."""
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def llc_bytes(cache_dir: Path = CACHE_DIR) -> int:
    """The highest-level data or unified cache of CPU 0 (sysfs); 0 where none is listed."""
    best = (0, 0)
    for idx in sorted(cache_dir.glob("index*")):
        try:
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            best = max(best, (int((idx / "level").read_text()),
                              parse_cache_size((idx / "size").read_text())))
        except (OSError, ValueError):
            continue
    return best[1]


def host_cores() -> int:
    """Cores this process may run on (its affinity): the ones the host's ranks share."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

"""The named clusters every command prices: a GPU, hosts of 8 on NVLink, one network across.

A cluster is named ``<gpu>-<network>`` (``h100-ib400``); with its GPU count in front
(``16xh100-ib400``) it is one machine, and its link follows from the count: up to a host's 8
GPUs, NVLink alone; above, NVLink inside each host, then the network across hosts
(:class:`~ciera_jax.planning.links.Topology`). The links are the profiles of
``profiles/``; the GPU is the compile target whose codec table prices the gathers.
"""

from __future__ import annotations

import dataclasses
import re

from ciera_jax.planning import links

GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    name: str
    gpu: str  # the compile target (ciera_jax.runtime.gpu_targets)
    gpu_label: str
    intra: str  # NVLink profile
    inter: str  # network profile
    network: str  # the network across hosts, in words


CLUSTERS = {c.name: c for c in (
    ClusterSpec("h100-ib400", "h100-80gb", "H100", "h100-nvlink", "h100-ib400", "IB NDR 400"),
    ClusterSpec("h100-100gbe", "h100-80gb", "H100", "h100-nvlink", "h100-100gbe", "100 GbE"),
    ClusterSpec("h200-ib400", "h200-141gb", "H200", "h200-nvlink", "h200-ib400", "IB NDR 400"),
)}
# older names, still read: the GPU alone meant its InfiniBand cluster
ALIASES = {"h100": "h100-ib400", "h200": "h200-ib400"}
DEFAULT = "h100-ib400"
_SPEC = re.compile(r"^(?:(\d+)x)?([a-z0-9-]+)$")


def names() -> str:
    """The cluster names, as the commands' help lists them."""
    return ", ".join(CLUSTERS)


def parse(text: str, gpus: int | None = None) -> tuple[ClusterSpec, int | None]:
    """``(cluster, GPU count)`` from ``h100-ib400`` or ``16xh100-ib400``; a count in the name
    must agree with ``gpus`` where both are given."""
    m = _SPEC.match(str(text).strip().lower())
    name = ALIASES.get(m.group(2), m.group(2)) if m else None
    if name not in CLUSTERS:
        raise KeyError(f"unknown cluster {text!r}; choose one of: {names()} (a GPU count may "
                       f"lead, e.g. 16x{DEFAULT})")
    count = int(m.group(1)) if m.group(1) else None
    if count is not None and gpus is not None and count != gpus:
        raise ValueError(f"cluster {text!r} has {count} GPUs but --gpus says {gpus}")
    if count is not None and count < 1:
        raise ValueError(f"cluster {text!r}: the GPU count must be positive")
    return CLUSTERS[name], count if count is not None else gpus


def link(spec: ClusterSpec, calibration: str = "roofline") -> links.Topology:
    """The cluster's NVLink and network links, hosts of :data:`GPUS_PER_HOST`."""
    intra, inter = (dataclasses.replace(links.Profile.load(p), codec_calibration=calibration)
                    for p in (spec.intra, spec.inter))
    return links.Topology(intra, inter, GPUS_PER_HOST)


def describe(spec: ClusterSpec, gpus: int) -> str:
    """``16×H100 (2 hosts, IB NDR 400)``."""
    hosts = -(-gpus // GPUS_PER_HOST)
    how = "NVLink" if hosts == 1 else spec.network
    return f"{gpus}×{spec.gpu_label} ({hosts} host{'s' if hosts > 1 else ''}, {how})"


def get_link(p) -> links.Link:
    """A Profile or Topology as given; ``16xh100-ib400`` as that cluster's link; else a
    profile by name or path (:func:`links.get_link`)."""
    if isinstance(p, str):
        m = _SPEC.match(p.strip().lower())
        if m and m.group(1) and ALIASES.get(m.group(2), m.group(2)) in CLUSTERS:
            return link(parse(p)[0])
    return links.get_link(p)

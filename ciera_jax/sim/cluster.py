"""The simulated machine: a named cluster's links (:mod:`ciera_jax.planning.clusters`), and
what one GPU computes."""

from __future__ import annotations

import dataclasses

from ciera_jax.planning import clusters
from ciera_jax.planning import links

# vendor spec: H100 SXM and H200 SXM dense bf16 tensor-core peak, 989 TFLOP/s (no sparsity)
PEAK_BF16_FLOPS = 989e12
# assumption: MoE training typically reaches 30-45% MFU on H100 (grouped matmuls, routing);
# we take 0.35
DEFAULT_MFU = 0.35


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    intra: links.Profile  # NVLink inside a node
    inter: links.Profile  # one NIC per GPU across nodes
    gpus_per_node: int = 8
    peak_flops: float = PEAK_BF16_FLOPS
    mfu: float = DEFAULT_MFU
    spec: clusters.ClusterSpec | None = None

    @property
    def topology(self) -> links.Topology:
        return links.Topology(self.intra, self.inter, self.gpus_per_node)

    @property
    def flops(self) -> float:
        """Sustained bf16 FLOP/s of one GPU."""
        return self.peak_flops * self.mfu

    def describe(self, gpus: int) -> str:
        """``16×H100 (2 hosts, IB NDR 400)``."""
        return clusters.describe(self.spec, gpus) if self.spec else f"{gpus}x {self.name}"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("intra", "inter"):
            d[k].pop("sources", None)
        d.pop("spec", None)
        return d


def get_cluster(name: str = clusters.DEFAULT, mfu: float | None = None,
                gpus_per_node: int = clusters.GPUS_PER_HOST,
                calibration: str = "roofline") -> Cluster:
    """A named cluster (:data:`ciera_jax.planning.clusters.CLUSTERS`; a leading GPU count, as
    in ``16xh100-ib400``, is allowed and ignored here)."""
    spec, _ = clusters.parse(name)
    topo = clusters.link(spec, calibration)
    return Cluster(spec.name, topo.intra, topo.inter, gpus_per_node, PEAK_BF16_FLOPS,
                   DEFAULT_MFU if mfu is None else mfu, spec)

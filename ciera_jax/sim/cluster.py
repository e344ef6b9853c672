"""The simulated machine: NVLink nodes joined by InfiniBand, and what one GPU computes."""

from __future__ import annotations

import dataclasses

from ciera_jax.planning import costmodel as cm

# vendor spec: H100 SXM and H200 SXM dense bf16 tensor-core peak, 989 TFLOP/s (no sparsity)
PEAK_BF16_FLOPS = 989e12
# assumption: MoE training typically reaches 30-45% MFU on H100 (grouped matmuls, routing);
# we take 0.35
DEFAULT_MFU = 0.35


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    intra: cm.Profile  # NVLink inside a node
    inter: cm.Profile  # one NIC per GPU across nodes
    gpus_per_node: int = 8
    peak_flops: float = PEAK_BF16_FLOPS
    mfu: float = DEFAULT_MFU

    @property
    def topology(self) -> cm.Topology:
        return cm.Topology(self.intra, self.inter, self.gpus_per_node)

    @property
    def flops(self) -> float:
        """Sustained bf16 FLOP/s of one GPU."""
        return self.peak_flops * self.mfu

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("intra", "inter"):
            d[k].pop("sources", None)
        return d


CLUSTERS = {"h100": ("h100-nvlink", "h100-ib400"), "h200": ("h200-nvlink", "h200-ib400")}


def get_cluster(name: str = "h100", mfu: float | None = None,
                gpus_per_node: int = 8) -> Cluster:
    if name not in CLUSTERS:
        raise KeyError(f"unknown cluster {name!r}; choose one of: {', '.join(CLUSTERS)}")
    intra, inter = (cm.Profile.load(p) for p in CLUSTERS[name])
    return Cluster(name, intra, inter, gpus_per_node, PEAK_BF16_FLOPS,
                   DEFAULT_MFU if mfu is None else mfu)

"""The flags every pricing command shares: the model (``--config``), the cluster
(``--cluster``), the codec's calibration (``--codec``), and the one prediction line."""

from __future__ import annotations

import argparse
import sys

from ciera_jax.planning import clusters

CODEC_HELP = ("the codec's cost per gather: 'roofline' (its compiled kernels and bytes, "
              "XLA:GPU's compile) or 'measured' (that, scaled to a recorded GPU measurement) "
              "(default: roofline)")


class DeprecatedAlias(argparse.Action):
    """An old flag name: stores into the new one's place with a one-line note on stderr."""

    def __init__(self, option_strings, dest, new: str = "", **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"note: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_config(p, default: str = "olmoe-1b-7b", *, old: str | None = None) -> None:
    p.add_argument("--config", default=default, help=f"model config name (default: {default})")
    if old:
        p.add_argument(old, dest="config", action=DeprecatedAlias, new="--config",
                       help=argparse.SUPPRESS)


def add_cluster(p, *, default: str | None = clusters.DEFAULT) -> None:
    p.add_argument("--cluster", default=default,
                   help=f"named cluster: {clusters.names()}; hosts of "
                   f"{clusters.GPUS_PER_HOST} GPUs on NVLink, the named network across hosts; "
                   "a GPU count may lead, e.g. 16xh100-ib400"
                   + (f" (default: {default})" if default else ""))
    p.add_argument("--codec", choices=("roofline", "measured"), default="roofline",
                   help=CODEC_HELP)


def prediction(config, gpus: int, cluster_name: str, codec: str = "roofline",
               tokens_per_gpu: int = 4096, mfu: float | None = None, **kw):
    """:func:`ciera_jax.sim.predict.predict` on a named cluster."""
    from ciera_jax.sim.cluster import get_cluster
    from ciera_jax.sim.predict import predict

    cluster = get_cluster(cluster_name, mfu=mfu, calibration=codec)
    return predict(config, gpus, cluster, tokens_per_gpu, **kw)

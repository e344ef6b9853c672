"""Throughput of the jitted pure-jnp (XLA) codec on this machine, next to a plain copy.

Encode and decode GB/s of tensor bytes for bf16 and float32 at 1, 16 and 64 MB, with a copy of
the same bytes timed in the same run, and the ratio codec/copy. This is the ``codec_rate`` the
planner's cost model needs on backends without the Pallas kernels. Same options as
``kernel_throughput.py`` (which it reuses), xla only by default.

    python benchmarks/codec_throughput.py [--sizes-mb 1 16 64] [--out results/codec_throughput.json]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_throughput import run  # noqa: E402

if __name__ == "__main__":
    run(default_out="results/codec_throughput.json", default_impls=("xla",),
        description=__doc__)

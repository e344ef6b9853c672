"""The one prediction every command ends with: a step on a named cluster, plain against CIERA.

``ciera plan``, ``ciera simulate`` and ``ciera aot`` all call :func:`predict`, so they agree:
one step of the model (:func:`ciera_jax.sim.step.simulate_step`: per-layer compute at the
GPU's FLOP/s, prefetch depth one as the trainer's compiled step overlaps gathers with the
previous layer's compute, hierarchical gathers on the cluster's links), each gather's codec
priced from the compiled program (:mod:`ciera_jax.planning.codec_costs`). It compares plain
FSDP, CIERA's word and exponent modes (each where it shortens the step), and plain FSDP that
keeps its gathered weights (word mode's equal-memory baseline).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning.shapes import get_config
from ciera_jax.sim.cluster import Cluster, get_cluster
from ciera_jax.sim.step import simulate_step

METHODS = ("plain", "word", "ciera", "plain-noreshard")


@dataclasses.dataclass(frozen=True)
class Prediction:
    config: str
    cluster: str  # 16xh100-ib400
    machine: str  # 16×H100 (2 hosts, IB NDR 400)
    steps: dict  # method -> StepResult
    source: str

    def step_s(self, method: str) -> float:
        return self.steps[method].step_s

    def speedup(self, method: str) -> float:
        return self.step_s("plain") / self.step_s(method)

    def line(self) -> str:
        ms = lambda m: f"{self.step_s(m) * 1e3:.{0 if self.step_s(m) >= 0.01 else 3}f} ms"  # noqa: E731
        fits = lambda m: "" if self.steps[m].fits else ", does not fit"  # noqa: E731
        word = self.steps["word"]
        return (f"predicted step of {self.config} on {self.machine}: plain {ms('plain')}, "
                f"CIERA word {ms('word')} ({self.speedup('word'):.2f}x{fits('word')}), "
                f"exponent {ms('ciera')} ({self.speedup('ciera'):.2f}x); equal-memory plain "
                f"FSDP {ms('plain-noreshard')} ({self.speedup('plain-noreshard'):.2f}x"
                f"{fits('plain-noreshard')}); word caches "
                f"{word.extra_memory_bytes / 1e9:.1f} GB/GPU; {self.source}")

    def to_json(self) -> dict:
        return {"config": self.config, "cluster": self.cluster, "machine": self.machine,
                "source": self.source, "line": self.line(),
                "step_s": {m: r.step_s for m, r in self.steps.items()},
                "speedup": {m: self.speedup(m) for m in self.steps},
                "extra_memory_bytes": {m: r.extra_memory_bytes for m, r in self.steps.items()},
                "fits": {m: r.fits for m, r in self.steps.items()}}


def predict(cfg: Any, gpus: int, cluster: Cluster | str = "h100-ib400",
            tokens_per_gpu: int = 4096, **kw) -> Prediction:
    """The step of ``cfg`` on ``gpus`` GPUs of ``cluster`` under each of :data:`METHODS`
    (``kw``: :func:`simulate_step`'s trace, word_trace, phase, codec_stream, remat)."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    cluster = get_cluster(cluster) if isinstance(cluster, str) else cluster
    steps = {m: simulate_step(cfg, gpus, cluster, m, tokens_per_gpu, **kw) for m in METHODS}
    return Prediction(cfg.name, f"{gpus}x{cluster.name}", cluster.describe(gpus), steps,
                      cm.codec_source(cluster.topology))

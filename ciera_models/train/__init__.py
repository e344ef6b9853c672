"""FSDP training of the MoE transformer with the CIERA gather: the public entry.

config.py        every flag a dataclass field (TrainConfig, RunConfig)
data.py          token data
optimizer.py     AdamW, warm-up + cosine
compression.py   which gathered tensors compress, and each one's cache mode
memory_limit.py  XLA:GPU's scheduler memory limit from the plan (train and aot alike)
step.py          the sharded train step and the encode program after it
state.py         the state, and the trainer that compiles and runs both programs
beside.py        ``--compile-beside``: step programs compiled in threads beside the steps
build.py         build_trainer: the trainer for a config (memoized)
metrics.py       progress lines, summary, JSONL
loop.py          the loop (:func:`train`)

The names below load on first use, so reading the flags (``ciera train --help``) pulls in no
JAX.
"""

from ciera_jax.runtime.lazy import exports

_EXPORTS = {
    "RunResult": "ciera_models.train.loop", "check_inputs": "ciera_models.train.loop",
    "train": "ciera_models.train.loop", "summarize": "ciera_models.train.metrics",
    "make_optimizer": "ciera_models.train.optimizer",
    "make_schedule": "ciera_models.train.optimizer",
    "flat_params": "ciera_models.checkpoint.params_hash",
    "params_sha256": "ciera_models.checkpoint.params_hash",
    "PLANS": "ciera_models.train.compression",
    "choose_compressed": "ciera_models.train.compression",
    "make_mesh": "ciera_jax.runtime.devices", "build_trainer": "ciera_models.train.build",
    "Trainer": "ciera_models.train.state", "TrainState": "ciera_models.train.state",
    "RunConfig": "ciera_models.train.config", "TrainConfig": "ciera_models.train.config",
}
__getattr__, __dir__ = exports(__name__, _EXPORTS, globals(),
                               old={"make_plan": "choose_compressed"})

__all__ = ["TrainConfig", "RunConfig", "Trainer", "TrainState", "build_trainer", "make_mesh",
           "train", "check_inputs", "params_sha256", "flat_params", "summarize", "RunResult",
           "choose_compressed", "PLANS", "make_schedule", "make_optimizer"]

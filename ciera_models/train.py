"""FSDP training of the MoE transformer with the CIERA gather: the public entry.

One concern per module: :mod:`models.train_config` (the settings, one field per flag),
:mod:`models.optimizer`, :mod:`models.plan_policy` (which tensors compress), :mod:`models.step`
(the compiled sharded step), :mod:`models.state` (state, trainer, mesh), :mod:`models.metrics`
(records, progress, summary), :mod:`models.params_hash`, :mod:`models.checkpoint`,
:mod:`models.preemption`, :mod:`models.loop` (:func:`train`).
"""

from ciera_models.loop import RunResult, check_inputs, train
from ciera_models.metrics import summarize
from ciera_models.optimizer import make_optimizer, make_schedule
from ciera_models.params_hash import flat_params, params_sha256
from ciera_models.plan_policy import PLANS, make_plan
from ciera_jax.runtime.devices import make_mesh
from ciera_models.build import build_trainer
from ciera_models.state import Trainer, TrainState
from ciera_models.train_config import RunConfig, TrainConfig

__all__ = ["TrainConfig", "RunConfig", "Trainer", "TrainState", "build_trainer", "make_mesh",
           "train", "check_inputs", "params_sha256", "flat_params", "summarize", "RunResult",
           "make_plan", "PLANS", "make_schedule", "make_optimizer"]

"""Your own train loop running the trainer's program: :func:`train_step` wraps a jitted step
over a model with gathering modules so that the gathers are encoded ahead, agreed on once a
step and exchanged at rungs the host fixed per compiled program (no conditional on the
step's path). :mod:`.ahead` (the encode program), :mod:`.rungs` (which program a step runs),
:mod:`.step` (the wrapper)."""

from ciera_jax.loop.ahead import ahead_specs, ahead_values, at_rungs, encode_ahead
from ciera_jax.loop.rungs import RungPolicy
from ciera_jax.loop.step import TrainStep, train_step

__all__ = ["RungPolicy", "TrainStep", "ahead_specs", "ahead_values", "at_rungs", "encode_ahead",
           "train_step"]

"""The named configs ``ciera train`` knows; the shapes themselves live in :mod:`ciera_jax.planning.shapes`
(the library prices them), re-exported here for the model and the trainer."""

from ciera_jax.planning.shapes import (CONFIGS, ModelConfig, TensorSpec, get_config,
                                       global_tensors, layer_tensors, tensor_inventory,
                                       total_params)

__all__ = ["CONFIGS", "ModelConfig", "TensorSpec", "get_config", "global_tensors",
           "layer_tensors", "tensor_inventory", "total_params"]

"""FSDP for Flax NNX: one sharding rule table, gather-before-use, exponent caches as module state.

A sharded layer keeps its parameters as float32 shards (split over the ``fsdp`` mesh axis by
:data:`RULES`, or by a parameter's ``fsdp_axis`` metadata). Decorating its ``__call__`` with
:func:`gathered` makes every call, inside ``jax.shard_map``, cast each sharded parameter to the
compute dtype and all-gather it just before use, through CIERA's exponent-reuse gather (or the
plain / int8 baselines, chosen with :func:`gather_mode`). The exponent cache of each gathered
parameter lives on the module as an :class:`ExponentCacheVar`, like batch-norm statistics:
derived, replicated state carried through the train step, never checkpointed.

Outside ``shard_map`` (axis not bound) a decorated module runs on whatever it holds, cast to the
compute dtype: the unsharded reference path.

    class MLP(nnx.Module):
        def __init__(self, d, f, rngs):
            self.w_in = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d, f)), fsdp_axis=0)
            self.w_out = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (f, d)), fsdp_axis=1)

        @ciera_jax.gathered(axis_name="fsdp")
        def __call__(self, x):
            return jax.nn.gelu(x @ self.w_in[...]) @ self.w_out[...]

One concern per module: :mod:`.rules` (the sharding policy), :mod:`.specs` (PartitionSpecs,
placement), :mod:`.context` (gather mode, active engine), :mod:`.caches` (exponent caches as
module state), :mod:`.decorator` (:func:`gathered`), :mod:`.layer_stack` (layer stacks),
:mod:`.engine` (the step's gathers, prefetch, re-gather in backward), :mod:`.clipping`.
"""

from ciera_jax.fsdp._util import invariant
from ciera_jax.fsdp.caches import (ExponentCacheVar, attach_caches, cache_dict, reset_caches,
                                   with_caches)
from ciera_jax.fsdp.clipping import clip_by_global_norm, global_sq_norm
from ciera_jax.fsdp.context import GATHER_MODES, PREGATHERED, GatherContext, gather_mode, pregathered
from ciera_jax.fsdp.decorator import gather_params, gathered
from ciera_jax.fsdp.engine import (Engine, GatheredTensor, agree_tensors, encode_tensors,
                                   gathered_tensors, param_dict)
from ciera_jax.fsdp.layer_stack import scan_layers, stack, stack_size
from ciera_jax.fsdp.rules import AXIS, RULES, check_divisible, param_axis, rule_axis, spec_for
from ciera_jax.fsdp.specs import merge, param_specs, put, state_specs

__all__ = [
    "AXIS", "RULES", "GATHER_MODES", "ExponentCacheVar", "GatherContext", "gather_mode",
    "gathered", "attach_caches", "reset_caches", "param_specs", "state_specs", "put", "merge", "rule_axis", "param_axis",
    "spec_for", "global_sq_norm", "clip_by_global_norm", "gather_params", "invariant",
    "stack", "stack_size", "scan_layers", "GatheredTensor", "gathered_tensors", "Engine",
    "encode_tensors", "agree_tensors", "cache_dict", "with_caches", "param_dict", "pregathered",
]

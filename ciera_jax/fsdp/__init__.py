"""FSDP for Flax NNX: gather-before-use by instance (:func:`shard`) or by decorator
(:func:`gathered`), gather caches and stats as module state.

Wrap module instances with :func:`shard` (each block, then the root) or decorate a module's
``__call__`` with :func:`gathered`: every parameter under it that is split over the ``fsdp``
mesh axis (Flax's ``nnx.with_partitioning`` metadata first, then ``fsdp_axis`` metadata, then
a rule table passed to the decorator) is cast to the compute dtype and all-gathered just
before use, through CIERA's exponent-reuse gather (or the plain / int8 baselines:
:func:`set_gather_mode`, a static field of each module, so ``jit`` keys on it), over the
``fsdp`` axis only: other mesh axes in a parameter's spec (tensor, expert parallel) stay
split. Two programming models: inside the user's ``jax.shard_map``, or under ``jit`` with
``jax.set_mesh`` and eagerly sharded parameters, where the call opens its own ``shard_map``
region for the gathers. Caches (:class:`GatherCacheVar`, exponent or word,
:func:`attach_caches`) and stats (:class:`GatherStats`) are module state, created up front,
so ``nnx.remat``, ``nnx.scan``, ``nnx.vmap`` and ``jit`` carry them as values.

    class MLP(nnx.Module):
        def __init__(self, d, f, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
            self.up = nnx.Linear(d, f, kernel_init=init, rngs=rngs)
            self.down = nnx.Linear(f, d, kernel_init=..., rngs=rngs)

        @ciera_jax.gathered(axis_name="fsdp")
        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

One concern per module, imports one way: :mod:`.axes` (where a call gathers), :mod:`.rules`
(rule tables, specs of one axis), :mod:`.discovery` (which params, which axis),
:mod:`.stacking`, :mod:`.caches`, :mod:`.stats`, :mod:`.specs` (state PartitionSpecs,
placement), :mod:`.clipping`, :mod:`.inventory` (the one walk over a model: its gathering
modules and tensors), :mod:`.setup` (a module's static gather mode), :mod:`.gather` (the one
gather: shards, caches and setup in; fulls, new caches and stats out), :mod:`.percall` (a call
gathering on its own), :mod:`.phases` and :mod:`.prepared` (a train step's encode, one
agreement, and gathers with prefetch and the one custom VJP), :mod:`.remat` (what that VJP's
forward saves), :mod:`.layer_stack`, :mod:`.decorator`, :mod:`.wrap` (by instance).
"""

from ciera_jax.fsdp.state.axes import AXIS, invariant
from ciera_jax.fsdp.state.caches import (CACHE_MODES, ExponentCacheVar, GatherCacheVar,
                                         attach_caches, cache_dict, with_caches)
from ciera_jax.fsdp.clipping import clip_by_global_norm, global_sq_norm
from ciera_jax.fsdp.decorator import gathered
from ciera_jax.fsdp.state.discovery import GatherSpec
from ciera_jax.fsdp.gather import gather
from ciera_jax.fsdp.state.inventory import (GatheredTensor, Gatherer, gathered_tensors, gatherers,
                                            param_dict)
from ciera_jax.fsdp.layer_stack import scan_layers
from ciera_jax.fsdp.phases import (agree_tensors, encode_tensors, fix_rungs, needed_rungs,
                                   priming_inputs, unit_layers, wires)
from ciera_jax.fsdp.state.setup import (GATHER_MODES, REMAT_POLICIES, WORD_BACKWARDS,
                                        GatherSetup, gather_mode, set_gather_mode, setup_of)
from ciera_jax.fsdp.prepared import GatherInputs, prepare
from ciera_jax.runtime.partition import check_divisible, d_axis, rule_axis, spec_for
from ciera_jax.fsdp.state.specs import merge, param_specs, put, split_axes, state_specs
from ciera_jax.fsdp.state.stacking import stack, stack_size
from ciera_jax.fsdp.state.stats import (STAT_KEYS, GatherStats, columns as stat_columns,
                                        from_columns as stats_from_columns, gather_stats,
                                        unpack as unpack_stats, wire_ratio)
from ciera_jax.fsdp.wrap import is_sharded, shard
from ciera_jax.runtime.lazy import renamed

__getattr__ = renamed(__name__, {"Plan": "GatherSetup", "plan_of": "setup_of"})

__all__ = [
    "AXIS", "CACHE_MODES", "GATHER_MODES", "REMAT_POLICIES", "STAT_KEYS", "WORD_BACKWARDS",
    "ExponentCacheVar", "GatherCacheVar", "GatherInputs", "GatherSpec", "GatherStats",
    "GatheredTensor", "Gatherer", "GatherSetup", "agree_tensors", "attach_caches", "cache_dict",
    "check_divisible",
    "clip_by_global_norm", "d_axis", "encode_tensors", "fix_rungs", "gather", "gather_mode",
    "gather_stats",
    "gathered", "gathered_tensors", "gatherers", "global_sq_norm", "invariant", "is_sharded",
    "merge", "needed_rungs", "param_dict", "param_specs", "setup_of", "prepare", "priming_inputs",
    "put", "rule_axis",
    "scan_layers", "set_gather_mode", "shard", "spec_for", "split_axes", "stack", "stack_size",
    "stat_columns", "state_specs", "stats_from_columns", "unit_layers", "unpack_stats",
    "wire_ratio", "wires",
    "with_caches",
]

"""The trainer for a config: its model's shapes and shardings, its plan, its step.

:func:`build_trainer` is memoized on ``(TrainConfig, mesh)``: runs with the same config in one
process (tests, benchmarks, a resume after a preemption) share one compiled step.
"""

from __future__ import annotations

import functools

import jax
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ciera_jax import fsdp
from ciera_jax.fsdp import AXIS, GatherCacheVar
from ciera_models.model import configs
from ciera_models.model.transformer import Transformer
from ciera_models.train.optimizer import make_optimizer
from ciera_models.train.compression import cache_modes, choose_compressed
from ciera_models.train.state import Trainer, is_spec
from ciera_models.train.step import make_step


@functools.lru_cache(maxsize=8)
def build_trainer(tc, mesh: Mesh) -> Trainer:
    """Shapes, shardings and the compiled step for ``tc`` (a TrainConfig) on ``mesh``."""
    cfg = tc.model
    n = mesh.shape[AXIS]
    if tc.gather not in fsdp.GATHER_MODES:
        raise ValueError(f"unknown gather {tc.gather!r}; choose one of: "
                         f"{', '.join(fsdp.GATHER_MODES)}")
    platform = mesh.devices.flat[0].platform
    attention, experts = tc.attention_on(platform), tc.experts_on(platform)
    abstract = nnx.eval_shape(lambda: fsdp.attach_caches(Transformer(cfg, nnx.Rngs(0),
                                                                     attention, experts)))
    graphdef, params, caches = nnx.split(abstract, nnx.Param, GatherCacheVar)
    # The rule table's specs; raises if the mesh does not divide a split dimension.
    param_specs = fsdp.state_specs(abstract, params, AXIS, n=n)
    if tc.batch_size % n:
        raise ValueError(f"batch size {tc.batch_size} is not divisible by the {n} devices")
    tx = make_optimizer(tc)
    opt_abs = jax.eval_shape(tx.init, params)
    full_specs = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), param_specs,
                              params, is_leaf=is_spec)
    opt_specs = optax.tree_map_params(tx, lambda _, s: s, opt_abs, full_specs,
                                      transform_non_params=lambda _: P(), is_leaf=is_spec)
    tensors = fsdp.gathered_tensors(abstract)
    compress, plan_summary = choose_compressed(tc, tensors, n, mesh.devices.flat[0].platform)
    if tc.gather != "ciera":
        compress = {k: False for k in compress}
    modes = cache_modes(tc, tensors, compress, n, mesh.devices.flat[0].platform)
    step_fn, prepare_fn = make_step(tc, mesh, graphdef, param_specs, opt_specs, tx, tensors,
                                    compress)
    return Trainer(tc, mesh, graphdef, param_specs, opt_specs, tx, tensor_kinds(cfg, tensors),
                   step_fn, tensors, compress, plan_summary, prepare_fn, modes,
                   cache_shapes=caches, param_shapes=params, attention=attention,
                   experts=experts)


def tensor_kinds(cfg: configs.ModelConfig, tensors: dict) -> dict[str, str]:
    """Tensor path as the gather stats name it (per layer) -> TensorSpec.kind."""
    by_name = {t.name: t.kind for t in configs.tensor_inventory(cfg)}
    out = {}
    for key, t in tensors.items():
        kind = by_name.get(key.rsplit("/", 1)[-1], "other")
        for layer in range(t.stack or 1):
            out[t.layer_key(layer)] = kind
    return out

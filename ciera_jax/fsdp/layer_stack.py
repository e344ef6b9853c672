"""Running a layer stack built by :func:`~ciera_jax.fsdp.stack`: with a prepared engine inside
``shard_map``, prefetching layer l+1 during layer l; otherwise an ``nnx.scan`` whose decorated
layers gather per layer (their caches and stats stack with the layers)."""

from __future__ import annotations

from flax import nnx

from ciera_jax.fsdp.axes import axis_bound
from ciera_jax.fsdp.context import active_engine


def scan_layers(stack_module, x, *args):
    """Apply the layers of ``stack_module`` in order: ``x, y = layer(x, *args)``; returns
    ``(x, ys)`` with the ``y`` of every layer stacked."""
    engine = active_engine()
    if engine is not None and engine.prepared and axis_bound(engine.axis_name):
        return engine.scan(stack_module, x, *args)

    def body(x, layer):
        return layer(x, *args)

    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, stack_module)

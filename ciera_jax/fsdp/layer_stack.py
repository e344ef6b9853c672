"""Running a layer stack built by :func:`~ciera_jax.fsdp.stack`: prepared by a train step
(inside ``shard_map``), prefetching layer l+1 during layer l; otherwise an ``nnx.scan`` whose
gathering layers gather per layer (their caches and stats stack with the layers)."""

from __future__ import annotations

from flax import nnx

from ciera_jax.fsdp.state.axes import axis_bound
from ciera_jax.fsdp.state.discovery import gather_spec, iter_modules
from ciera_jax.fsdp.state.setup import setup_of
from ciera_jax.fsdp.prepared import scan as prepared_scan


def scan_layers(stack_module, x, *args):
    """Apply the layers of ``stack_module`` in order: ``x, y = layer(x, *args)``; returns
    ``(x, ys)`` with the ``y`` of every layer stacked."""
    specs = [(gather_spec(m), setup_of(m)) for _, m in iter_modules(stack_module)
             if gather_spec(m) is not None]
    if specs and specs[0][1].prepared and axis_bound(specs[0][0].axis_name):
        return prepared_scan(stack_module, x, *args)

    def body(x, layer):
        return layer(x, *args)

    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, stack_module)

"""Layer stacks: ``n`` layers with their variables stacked on a leading axis, run by one
``lax.scan`` so a single layer body is traced and compiled."""

from __future__ import annotations

from typing import Callable

from flax import nnx
from jax import lax

from ciera_jax.fsdp._util import _axis_bound
from ciera_jax.fsdp.context import _CTX, _ENGINE, PREGATHERED, GatherContext
from ciera_jax.fsdp.rules import AXIS


_STACK_ATTR = "_ciera_stack"


def stack(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """``n`` layers built by ``make(rngs)``, every variable stacked on a new leading axis.

    Run them with :func:`scan_layers`. Sharding rules and exponent caches of the stacked
    parameters shift by one axis (the layer axis is never split). Nesting stacks is not supported.
    """
    if n < 1:
        raise ValueError(f"a layer stack needs at least one layer, got {n}")

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)

    module = build(rngs)
    object.__setattr__(module, _STACK_ATTR, n)
    return module


def stack_size(module) -> int:
    """Layers in a module built by :func:`stack` (0: not a stack)."""
    return getattr(module, _STACK_ATTR, 0)


def _stack_of(path: tuple, mods: dict) -> tuple[int, tuple]:
    """(layers, path of the stack) for the module at ``path`` ((0, ()) outside any stack)."""
    found = [(stack_size(mods[path[:i]]), path[:i]) for i in range(len(path) + 1)
             if path[:i] in mods and stack_size(mods[path[:i]])]
    if len(found) > 1:
        raise ValueError(f"nested layer stacks at {'/'.join(map(str, path))} are not supported")
    return found[0] if found else (0, ())


def scan_layers(stack_module, x, *args):
    """Apply the layers of ``stack_module`` (built by :func:`stack`) in order:
    ``x, y = layer(x, *args)``; returns ``(x, ys)`` with the ``y`` of every layer stacked.

    Inside a train step with an active :class:`Engine` the stack runs with prefetch (the gather
    of layer l+1 overlaps the compute of layer l) and re-gathers in backward; elsewhere (no mesh
    axis bound) it is a plain ``lax.scan``.
    """
    engine = _ENGINE.get()
    if engine is not None and _axis_bound(engine.axis_name):
        return engine.scan(stack_module, x, *args)
    if _axis_bound(AXIS) and (_CTX.get() or GatherContext()).mode != PREGATHERED:
        raise ValueError("a layer stack inside shard_map gathers through an fsdp.Engine: "
                         "build one for the step and run the model under engine.active()")
    graphdef, state = nnx.split(stack_module)

    def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, *args)

    return lax.scan(body, x, state)

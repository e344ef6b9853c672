"""Layer stacks: ``n`` layers with their variables stacked on a leading axis (built once with
``nnx.vmap``), run by one scan so a single layer body is traced and compiled."""

from __future__ import annotations

from typing import Callable

from flax import nnx

STACK_ATTR = "ciera_stack"


def stack(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """``n`` layers built by ``make(rngs)``, every variable stacked on a new leading axis.

    Run them with :func:`~ciera_jax.fsdp.scan_layers`. Split axes and exponent caches of the
    stacked parameters are those of one layer (the layer axis is never split). Nesting stacks
    is not supported.
    """
    if n < 1:
        raise ValueError(f"a layer stack needs at least one layer, got {n}")

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)

    module = build(rngs)
    object.__setattr__(module, STACK_ATTR, n)
    return module


def stack_size(module) -> int:
    """Layers in a module built by :func:`stack` (0: not a stack)."""
    return getattr(module, STACK_ATTR, 0)


def stack_of(path: tuple, mods: dict) -> tuple[int, tuple]:
    """(layers, path of the stack) for the module at ``path`` ((0, ()) outside any stack)."""
    found = [(stack_size(mods[path[:i]]), path[:i]) for i in range(len(path) + 1)
             if path[:i] in mods and stack_size(mods[path[:i]])]
    if len(found) > 1:
        raise ValueError(f"nested layer stacks at {'/'.join(map(str, path))} are not supported")
    return found[0] if found else (0, ())

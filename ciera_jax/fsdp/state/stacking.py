"""Layer stacks: ``n`` layers with their variables stacked on a leading axis, run by one scan
so a single layer body is traced and compiled. Two kinds are recognised: stacks built by
:func:`stack` (marked), and layers stacked the Flax way with ``nnx.vmap`` (recognised from
the Flax layers inside: a kernel with one more dimension than its layer declares)."""

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


def _declared_ndims(module) -> dict[str, int]:
    """The dimensions one instance of a Flax layer declares for its parameters."""
    if isinstance(module, nnx.Einsum):
        out = {"kernel": len(module.kernel_shape)}
        if getattr(module, "bias_shape", None) is not None:
            out["bias"] = len(module.bias_shape)
        return out
    if isinstance(module, nnx.Conv):
        return {"kernel": len(module.kernel_size) + 2, "bias": 1}
    if isinstance(module, nnx.Linear):
        return {"kernel": 2, "bias": 1}
    if isinstance(module, nnx.Embed):
        return {"embedding": 2}
    if isinstance(module, (nnx.LayerNorm, nnx.RMSNorm)):
        return {"scale": 1, "bias": 1}
    return {}


def vmapped_layers(module) -> int:
    """Layers of a module stacked with ``nnx.vmap`` (0: not recognised as such).

    Every Flax layer under it (``Linear``, ``Einsum``, ``Embed``, ``Conv``, ``LayerNorm``,
    ``RMSNorm``) must hold its parameters with exactly one extra leading axis, all of the same
    size; a module holding no such layer is not recognised (build it with :func:`stack`)."""
    sizes = set()
    for _, m in nnx.iter_graph(module):
        if not isinstance(m, nnx.Module):
            continue
        for name, ndim in _declared_ndims(m).items():
            var = getattr(m, name, None)
            if not isinstance(var, nnx.Param):
                continue
            shape = tuple(var.get_value().shape)
            if len(shape) != ndim + 1:
                return 0
            sizes.add(shape[0])
    return sizes.pop() if len(sizes) == 1 else 0


def stack_of(path: tuple, mods: dict) -> tuple[int, tuple]:
    """(layers, path of the stack) for the module at ``path`` ((0, ()) outside any stack):
    the outermost :func:`stack` or ``nnx.vmap``-stacked module on the way to it."""
    found = [(stack_size(mods[path[:i]]), path[:i]) for i in range(len(path) + 1)
             if path[:i] in mods and stack_size(mods[path[:i]])]
    if len(found) > 1:
        raise ValueError(f"nested layer stacks at {'/'.join(map(str, path))} are not supported")
    if found:
        return found[0]
    for i in range(len(path) + 1):
        if path[:i] in mods:
            n = vmapped_layers(mods[path[:i]])
            if n:
                return n, path[:i]
    return 0, ()

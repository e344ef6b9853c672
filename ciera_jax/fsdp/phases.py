"""A train step's CIERA phases over its whole inventory: encode every compressed tensor (at the
end of the previous step, off the critical path) and agree on all their demands with ONE
collective. :func:`~ciera_jax.fsdp.prepare` hands both to the model, whose gathers then
exchange each at its agreed tier."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import ciera_jax.collective as collective
from ciera_jax.fsdp.axes import AXIS


def encode_tensors(tensors: dict, params: dict, caches: dict, compress: dict,
                   axis_name: str = AXIS, impl: str = "auto") -> dict:
    """Phase 1 for every compressed tensor (inside ``shard_map``): ``{key: Encoded}``.

    ``params``: ``{key: local shard}`` (any float dtype; cast to the tensor's compute dtype);
    ``caches``: ``{key: cache}``; stacked tensors are encoded layer by layer, so their Encoded
    leaves carry the layer axis first.
    """
    out = {}
    for key, t in tensors.items():
        if not compress.get(key, False):
            continue
        shard = params[key].astype(t.dtype)

        def enc(s, c, t=t):
            return collective.encode(s, c, axis_name, axis=t.axis, impl=impl, name=t.key)

        # Layer by layer with lax.map (one traced body; vmap would turn the tier switch of
        # encode into a select of all branches).
        out[key] = (lax.map(lambda sc: enc(*sc), (shard, caches[key])) if t.stack
                    else enc(shard, caches[key]))
    return out


def agree_tensors(tensors: dict, encoded: dict, axis_name: str = AXIS) -> dict:
    """Phase 2: ONE ``agree`` (one ``pmax``) over the demand of every layer of every encoded
    tensor. Returns ``{key: agreed}`` (per layer for stacks)."""
    flat, where = [], []
    for key, e in encoded.items():
        n = tensors[key].stack
        if n:
            for layer in range(n):
                flat.append(jax.tree.map(lambda a, layer=layer: a[layer], e))
                where.append(key)
        else:
            flat.append(e)
            where.append(key)
    agreed = collective.agree(flat, axis_name) if flat else []
    out: dict = {}
    for key, a in zip(where, agreed):
        out.setdefault(key, []).append(a)
    return {k: (jnp.stack(v) if tensors[k].stack else v[0]) for k, v in out.items()}

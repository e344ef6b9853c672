"""A jitted shard_map harness that runs one CIERA gather per call and returns every rank's view.

It returns, per rank, the compressed result, the reference gather of the uint view, and the
stats, so tests can check all ranks bit for bit. Compiled functions are cached per
configuration to keep the suite fast on 2 cores. Shared by the exponent-mode and word-mode
gather tests (``test_collective*.py``, ``test_word_collective.py``, ``test_verify.py``).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.codec import bitfields, escapes
from ciera_jax.fsdp import spec_for
from bitdata import BF16, weights


@functools.lru_cache(maxsize=None)
def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]):
    return jax.make_mesh(shape, names)


@contextlib.contextmanager
def escape_walk(loop: bool):
    """While tracing: ``loop`` compiles the escapes' loop walk beside the dense one for any
    row (on CPU it is compiled only for rows of ``escapes.LOOP_MIN`` elements, longer than
    the tests' tensors), so whole gathers exercise it too."""
    saved = escapes.LOOP_MIN
    escapes.LOOP_MIN = 1 if loop else saved
    try:
        yield
    finally:
        escapes.LOOP_MIN = saved


@functools.lru_cache(maxsize=None)
def gather_step(mesh_shape, mesh_names, axis_name, axis, ndim, impl="xla", loop=False):
    """(x_global, cache) -> (full per rank, ref per rank, new cache, stats per rank); ``loop``:
    :func:`escape_walk`."""
    mesh = mesh_of(mesh_shape, mesh_names)
    x_spec = spec_for(axis, ndim, axis_name)
    all_axes = tuple(mesh_names)

    def body(x, cache):
        full, new_cache, stats = ciera_jax.all_gather(x, cache, axis_name, axis=axis, impl=impl)
        ref = lax.all_gather(bitfields.to_bits(x), axis_name, axis=axis, tiled=True)
        per_rank = lambda v: v[None]  # noqa: E731
        return (per_rank(full), per_rank(ref), new_cache,
                jax.tree.map(per_rank, stats))

    fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P()),
                       out_specs=(P(all_axes), P(all_axes), P(), P(all_axes)))
    jitted = jax.jit(fn)

    def run(x, cache):
        x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, x_spec))
        cache = jax.device_put(cache, NamedSharding(mesh, P()))
        with escape_walk(loop):  # (traced on the first call)
            return jitted(x, cache)

    return run


def run_steps(xs, *, mesh_shape=(8,), mesh_names=("fsdp",), axis_name="fsdp", axis=0,
              impl="xla", mode="exponent", loop=False):
    """Gather each array of ``xs`` in turn with a ``mode`` cache carried; yields (full, ref,
    stats, new cache)."""
    step = gather_step(tuple(mesh_shape), tuple(mesh_names), axis_name, axis, xs[0].ndim, impl,
                       loop)
    cache = ciera_jax.init_cache(xs[0].shape, xs[0].dtype, mode=mode)
    for x in xs:
        full, ref, cache, stats = step(x, cache)
        yield np.asarray(full), np.asarray(ref), jax.tree.map(np.asarray, stats), cache


def encode_vmap_matches_layerwise(mode: str, seed: int) -> bool:
    """Stacked layers encoded in one ``jax.vmap`` equal encoding layer by layer (3 layers of
    (16, 8) bf16, ``mode`` caches, layer 1's cache primed with ones), on every rank."""
    mesh = mesh_of((8,), ("fsdp",))
    rng = np.random.default_rng(seed)
    L, shape = 3, (16, 8)
    x = weights(rng, (L,) + shape, BF16)
    caches = jax.vmap(lambda _: ciera_jax.init_cache(shape, BF16, mode=mode))(jnp.arange(L))
    caches = jax.tree.map(lambda a: a.at[1].set(jnp.ones_like(a[1])), caches)

    def body(x, c):
        enc = jax.vmap(lambda x, c: ciera_jax.encode(x, c, "fsdp"))(x, c)
        one = [ciera_jax.encode(x[i], jax.tree.map(lambda a: a[i], c), "fsdp") for i in range(L)]
        same = [jnp.array_equal(a, b) for i in range(L) for a, b in
                zip(jax.tree.leaves(jax.tree.map(lambda a: a[i], enc)), jax.tree.leaves(one[i]))]
        return jnp.all(jnp.stack(same))[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "fsdp"), P()),
                               out_specs=P("fsdp")))
    x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(None, "fsdp")))
    return bool(np.asarray(fn(x, caches)).all())

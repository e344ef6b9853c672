"""Tensors of one size encoded by one traced codec (``encode_group``): bitwise the Encoded each
gets alone, whatever its shape and gather axis, stacked or not, on adversarial words in both
cache modes; and a step's encode compiles one codec per size, not per tensor."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from bitdata import BF16, F32, adversarial, bits_of, special_words
from ciera_jax.fsdp import encode_group
from ciera_jax.fsdp import phases
from ciera_jax.collective import gather as G

N = 8
# Three tensors of 512 elements per rank, split on different axes with different shapes.
SHAPES = {"rows": (N * 16, 32), "cols": (64, N * 8), "flat": (N * 512,)}
AXES = {"rows": 0, "cols": 1, "flat": 0}
LAYERS = 3


def _mesh():
    return jax.make_mesh((N,), ("fsdp",))


def _spec(name, lead):
    spec = [None] * (lead + len(SHAPES[name]))
    spec[lead + AXES[name]] = "fsdp"
    return P(*spec)


def _moved(rng, x0, dtype):
    """``x0`` with small moves, far moves, sign flips and the special words mixed in."""
    word = np.dtype(np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32)
    b = bits_of(x0).astype(np.int64).reshape(-1)
    move = rng.integers(-3, 4, size=b.size)
    far = rng.choice(b.size, size=b.size // 8, replace=False)
    move[far] = rng.integers(-(1 << 20), 1 << 20, size=far.size)
    b1 = (b + move) % (1 << (8 * word.itemsize))
    b1[rng.choice(b.size, size=b.size // 50, replace=False)] ^= 1 << (8 * word.itemsize - 1)
    sp = special_words(dtype)
    b1[:sp.size] = sp
    return b1.astype(word).view(dtype).reshape(x0.shape)


def _primed(x, mode, axis, lead):
    """A cache primed with ``x`` (a plain gather through the compressed all_gather)."""
    shape = x.shape[lead:]

    def prime(x):
        one = lambda s: ciera_jax.all_gather(  # noqa: E731
            s, ciera_jax.init_cache(shape, s.dtype, mode), "fsdp", axis=axis)[1]
        for _ in range(lead):
            one = jax.vmap(one)
        return one(x)

    name = next(k for k, v in SHAPES.items() if v == shape)
    f = jax.shard_map(prime, mesh=_mesh(), in_specs=_spec(name, lead), out_specs=P(),
                      check_vma=False)
    return jax.jit(f)(jax.device_put(x, NamedSharding(_mesh(), _spec(name, lead))))


def _word(dtype):
    return jnp.uint16 if np.dtype(dtype).itemsize == 2 else jnp.uint32


def _uint(a):
    a = jnp.asarray(a)
    if a.dtype in (jnp.bfloat16, jnp.float16):
        return np.asarray(lax.bitcast_convert_type(a, jnp.uint16))
    if a.dtype == jnp.float32:
        return np.asarray(lax.bitcast_convert_type(a, jnp.uint32))
    return np.asarray(a)


# Two of the eight in the fast lane, between them each mode, dtype and layout (the grouping is
# the same code for all; the stacked bf16 one is where XLA:CPU quieted NaN payloads).
FAST = {("word", "bf16", "stacked"), ("exponent", "f32", "one")}
CASES = [pytest.param(mode, dtype, lead, id=f"{mode}-{dname}-{lname}",
                      marks=() if (mode, dname, lname) in FAST else pytest.mark.slow)
         for mode in ("exponent", "word") for dtype, dname in ((BF16, "bf16"), (F32, "f32"))
         for lead, lname in ((0, "one"), (1, "stacked"))]


@pytest.mark.parametrize("mode, dtype, lead", CASES)
def test_grouped_encode_is_bitwise_each_alone(mode, dtype, lead):
    rng = np.random.default_rng(7)
    names = list(SHAPES)
    lead_shape = (LAYERS,) * lead
    x0 = {k: adversarial(rng, lead_shape + SHAPES[k], dtype) for k in names}
    x1 = {k: _moved(rng, x0[k], dtype) for k in names}
    caches = {k: _primed(jnp.asarray(x0[k]), mode, AXES[k], lead) for k in names}
    caches["flat"] = jax.tree.map(jnp.zeros_like, caches["flat"])  # one unprimed cache

    def alone(xs, cs):
        """Each tensor (each layer) by ``gather.encode``, layers cut statically as bits (a
        bf16 copy on XLA:CPU may run through float32 and quiet NaN payloads)."""
        out = []
        for k in names:
            def enc(x, c, k=k):
                return G.encode(x, c, "fsdp", axis=AXES[k], name=k)

            if not lead:
                out.append(enc(xs[k], cs[k]))
                continue
            bits = lax.bitcast_convert_type(xs[k], _word(dtype))
            layers = [enc(lax.bitcast_convert_type(bits[i], dtype),
                          jax.tree.map(lambda a, i=i: a[i], cs[k])) for i in range(LAYERS)]
            out.append(jax.tree.map(lambda *a: jnp.stack(a), *layers))
        return out

    def grouped(xs, cs):
        return encode_group.encode_same_size([xs[k] for k in names], [cs[k] for k in names],
                                             "fsdp", axes=[AXES[k] for k in names], lead=lead,
                                             names=names)

    def fsdp_alone(xs, cs):
        """What a train step runs for a tensor of a size of its own."""
        return [phases._encode_alone(types.SimpleNamespace(stack=LAYERS * lead, axis=AXES[k],
                                                           key=k), xs[k], cs[k], "fsdp", "auto")
                for k in names]

    in_specs = ({k: _spec(k, lead) for k in names}, P())
    xs = {k: jax.device_put(jnp.asarray(x1[k]), NamedSharding(_mesh(), _spec(k, lead)))
          for k in names}
    got = {}
    for fn in (alone, grouped, fsdp_alone):
        ranked = lambda xs, cs, fn=fn: jax.tree.map(lambda a: a[None], fn(xs, cs))  # noqa: E731
        f = jax.shard_map(ranked, mesh=_mesh(), in_specs=in_specs, out_specs=P("fsdp"),
                          check_vma=False)
        got[fn.__name__] = jax.jit(f)(xs, caches)
    for other in ("grouped", "fsdp_alone"):
        for k, a, b in zip(names, got["alone"], got[other]):
            assert jax.tree.structure(a) == jax.tree.structure(b), k  # shape and axis kept
            for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                assert la.shape == lb.shape and la.dtype == lb.dtype, k
                np.testing.assert_array_equal(_uint(la), _uint(lb), err_msg=f"{other} {k}")


# Two more tensors of that size, for a step with more of them.
MORE_SHAPES = {"tall": (N * 4, 128), "wide": (16, N * 32)}
MORE_AXES = {"tall": 0, "wide": 1}


def test_a_step_compiles_one_codec_per_size():
    """Five tensors of one size: the grouped encode compiles fewer fusions than five codecs
    (on XLA:CPU the flattening and cutting back out take much of what one codec saves: with
    three tensors about all of it)."""
    shapes, axes = {**SHAPES, **MORE_SHAPES}, {**AXES, **MORE_AXES}
    names = list(shapes)

    def spec(k):
        return P(*["fsdp" if d == axes[k] else None for d in range(len(shapes[k]))])

    xs = {k: jax.ShapeDtypeStruct(shapes[k], BF16, sharding=NamedSharding(_mesh(), spec(k)))
          for k in names}
    cs = {k: jax.eval_shape(lambda k=k: ciera_jax.init_cache(shapes[k], BF16, "word"))
          for k in names}

    def size(fn):
        ranked = lambda xs, cs: jax.tree.map(lambda a: a[None], fn(xs, cs))  # noqa: E731
        f = jax.shard_map(ranked, mesh=_mesh(), in_specs=({k: spec(k) for k in names}, P()),
                          out_specs=P("fsdp"), check_vma=False)
        text = jax.jit(f).lower(xs, cs).compile().as_text()
        return text.count(" fusion(")

    def alone(xs, cs):
        return [G.encode(xs[k], cs[k], "fsdp", axis=axes[k]) for k in names]

    def grouped(xs, cs):
        return encode_group.encode_same_size([xs[k] for k in names], [cs[k] for k in names],
                                             "fsdp", axes=[axes[k] for k in names])

    one, five = size(grouped), size(alone)
    assert one < five, (one, five)


def test_tensors_of_different_sizes_are_refused():
    xs = [jnp.zeros((4, 8), BF16), jnp.zeros((4, 4), BF16)]
    caches = [ciera_jax.init_cache(x.shape, BF16, "word") for x in xs]
    with pytest.raises(ValueError, match="differ in size"):
        encode_group.encode_same_size(xs, caches, "fsdp", axes=[0, 0], names=["a", "b"])

"""The caches: the kind picks the mode, shapes and dtypes follow the full tensor, errors say why."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ciera_jax
from bitdata import BF16, F32
from ciera_jax.collective.cache import ExponentCache, WordCache


@pytest.mark.parametrize("dtype,word", [(BF16, np.uint16), (F32, np.uint32)])
def test_word_cache_holds_full_words_unprimed(dtype, word):
    c = ciera_jax.init_cache((16, 8), dtype, mode="word")
    assert isinstance(c, WordCache) and c.mode == "word" and ciera_jax.is_cache(c)
    assert c.words.shape == (16, 8) and c.words.dtype == word and c.shape == (16, 8)
    assert not bool(c.primed) and c.dtype == np.dtype(dtype) and c.compressible
    assert c.exp.dtype == jnp.uint8 and c.exp.shape == (16, 8)


def test_exponent_cache_is_the_default():
    c = ciera_jax.init_cache((4, 3), BF16)
    assert isinstance(c, ExponentCache) and c.mode == "exponent" and ciera_jax.is_cache(c)
    assert c.exp.shape == (4, 3) and c.exp.dtype == jnp.uint8 and not bool(c.primed)


@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_other_dtypes_get_placeholder_caches(mode):
    """One element, never zero-size: JAX 0.11 crashes compiling a shard_map that takes a
    zero-size array."""
    c = ciera_jax.init_cache((16, 8), np.int32, mode=mode)
    assert c.shape == (1,) and not c.compressible and c.mode == mode


def test_word_cache_is_a_pytree_with_static_dtype():
    c = ciera_jax.init_cache((8,), BF16, mode="word")
    leaves, treedef = jax.tree.flatten(c)
    assert len(leaves) == 2  # words and primed; dtype is static
    primed = jax.jit(lambda c: c.primed | True)(c)
    assert bool(primed)
    stacked = jax.vmap(lambda _: ciera_jax.init_cache((8,), BF16, mode="word"))(jnp.arange(3))
    assert stacked.words.shape == (3, 8) and stacked.primed.shape == (3,)


def test_tree_with_one_mode_or_a_tree_of_modes():
    tree = {"w": jnp.zeros((8, 4), BF16), "b": jax.ShapeDtypeStruct((8,), F32)}
    caches = ciera_jax.init_cache_tree(tree, mode="word")
    assert all(c.mode == "word" for c in jax.tree.leaves(caches, is_leaf=ciera_jax.is_cache))
    shaped = ciera_jax.init_cache_tree({"s": (8, 2)}, dtype=BF16, mode="word")
    assert shaped["s"].words.shape == (8, 2)
    with pytest.raises(ValueError, match="shape-tuple leaves need dtype"):
        ciera_jax.init_cache_tree({"s": (8, 2)})
    mixed = ciera_jax.init_cache_tree({"w": tree["w"], "b": tree["b"]},
                                      mode={"w": "word", "b": "exponent"})
    assert mixed["w"].mode == "word" and mixed["b"].mode == "exponent"
    assert mixed["b"].dtype == np.dtype(F32) and mixed["w"].words.dtype == jnp.uint16


def test_bad_mode_names_the_choices():
    with pytest.raises(ValueError, match="unknown cache mode 'words'.*exponent.*word"):
        ciera_jax.init_cache((8,), BF16, mode="words")
    with pytest.raises(ValueError, match="mode must be one of"):
        ciera_jax.init_cache_tree({"a": jnp.zeros((8,), BF16)}, mode={"b": "word"})


def test_cached_full_views_the_words_and_refuses_exponent_caches():
    bits = np.array([0x7F81, 0xFF80, 0x8000, 0x0001, 0x3F80], np.uint16)
    c = ciera_jax.init_cache((5,), BF16, mode="word")
    c = WordCache(jnp.asarray(bits), jnp.bool_(True), c.dtype)
    full = ciera_jax.cached_full(c)
    assert full.dtype == BF16
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(full, jnp.uint16)),
                                  bits)
    with pytest.raises(TypeError, match="needs a WordCache"):
        ciera_jax.cached_full(ciera_jax.init_cache((5,), BF16))

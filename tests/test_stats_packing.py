"""Gather stats travel packed (one vector and ``changed`` per tensor) and come back by name."""

import jax.numpy as jnp
import numpy as np
import pytest

from ciera_jax import fsdp
from ciera_jax.fsdp.state import stats as stats_lib
from ciera_models.train.step import STEP_STAT_KEYS, per_layer_stats


def _named(layers: int) -> dict:
    """Every stat a distinct value (per layer when ``layers``)."""
    shape = (layers,) if layers else ()
    return {s: (10 * i + 1 + jnp.arange(max(layers, 1), dtype=jnp.int32)).reshape(shape)
            for i, s in enumerate(fsdp.STAT_KEYS)}


@pytest.mark.parametrize("layers", [0, 3])
def test_pack_then_unpack_gives_every_stat_back_by_name(layers):
    named = _named(layers)
    packed = stats_lib.pack(named)
    assert packed["vector"].shape[-1] == len(stats_lib.VECTOR_KEYS)
    assert packed["changed"].shape == named["changed"].shape  # its own leaf
    back = fsdp.unpack_stats(packed)
    assert sorted(back) == sorted(fsdp.STAT_KEYS)
    for s in fsdp.STAT_KEYS:
        np.testing.assert_array_equal(back[s], named[s])


def test_pack_names_a_missing_stat():
    named = _named(0)
    del named["rung"]
    with pytest.raises(ValueError, match="lack \\['rung'\\]"):
        stats_lib.pack(named)


def test_unpack_refuses_a_vector_of_the_wrong_width():
    with pytest.raises(ValueError, match="5 columns, not 6"):
        fsdp.stats_from_columns(jnp.zeros((2, 5), jnp.int32), stats_lib.VECTOR_KEYS)


def test_empty_stats_are_packed_zeros_that_unpack_by_name():
    empty = stats_lib.empty_stats(["a"], layers=4)["a"]
    assert stats_lib.is_packed(empty)
    back = fsdp.unpack_stats(empty)
    assert all(v.shape == (4,) and not np.any(v) for v in back.values())


def test_step_stats_split_by_stat_and_layer_on_the_host():
    class T:  # what per_layer_stats reads of a GatheredTensor
        def __init__(self, key, stack):
            self.key, self.stack = key, stack

        def layer_key(self, layer):
            return f"layers/{layer}/w" if self.stack else self.key

    width = len(STEP_STAT_KEYS)
    stacked = np.arange(2 * width, dtype=np.int32).reshape(2, width)
    alone = np.arange(width, dtype=np.int32) + 100
    out = per_layer_stats({"layers/w": T("layers/w", 2), "head": T("head", 0)},
                          {"layers/w": stacked, "head": alone})
    assert sorted(out) == ["head", "layers/0/w", "layers/1/w"]
    for layer in range(2):
        got = out[f"layers/{layer}/w"]
        assert [int(got[s]) for s in STEP_STAT_KEYS] == list(stacked[layer])
    assert int(out["head"]["step_sent_bytes"]) == int(alone[STEP_STAT_KEYS.index(
        "step_sent_bytes")])

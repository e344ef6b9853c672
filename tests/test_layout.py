"""Shard layouts: rank rows and the full tensor, and reading a shard's elements in place."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ciera_jax.codec.layout import full_index, full_to_rows, gathered_shape, rows_to_full


@pytest.mark.parametrize("shard_shape,axis", [((6,), 0), ((3, 4), 0), ((3, 4), 1),
                                               ((2, 3, 5), 1), ((2, 3, 5), 2)])
def test_rows_and_in_place_reads_match_numpy_slicing(shard_shape, axis):
    n_ranks = 3
    full = np.arange(np.prod(gathered_shape(shard_shape, axis, n_ranks))).reshape(
        gathered_shape(shard_shape, axis, n_ranks))
    shards = np.split(full, n_ranks, axis=axis)
    rows = np.asarray(full_to_rows(jnp.asarray(full), shard_shape, axis, n_ranks))
    np.testing.assert_array_equal(rows, np.stack([s.reshape(-1) for s in shards]))
    np.testing.assert_array_equal(np.asarray(rows_to_full(jnp.asarray(rows), shard_shape, axis)),
                                  full)
    i = jnp.arange(int(np.prod(shard_shape)), dtype=jnp.int32)
    for r, shard in enumerate(shards):
        at = full_index(i, shard_shape, axis, n_ranks, jnp.int32(r * shard_shape[axis]))
        np.testing.assert_array_equal(full.reshape(-1)[np.asarray(at)], shard.reshape(-1))

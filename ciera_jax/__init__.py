"""CIERA: lossless all-gather that reuses last step's exponents or words (see README).

The names below load on first use, so importing a light part of the package (the `ciera`
command's parser, the cost model, the planner) does not start JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciera_jax.runtime import lazy

if TYPE_CHECKING:
    from ciera_jax.collective.cache import (ExponentCache, WordCache, cached_full, init_cache,
                                            init_cache_tree, is_cache)
    from ciera_jax.collective.capacity import PLAIN_RUNG, FixedRung, needed_rung
    from ciera_jax.collective.gather import (Encoded, WordEncoded, agree, all_gather,
                                             all_gather_tree, encode, exchange, plain_all_gather,
                                             priming_encoded)
    from ciera_jax.fsdp import gathered
    from ciera_jax.loop import train_step

_EXPORTS = {
    "ExponentCache": "ciera_jax.collective.cache",
    "WordCache": "ciera_jax.collective.cache",
    "init_cache": "ciera_jax.collective.cache",
    "init_cache_tree": "ciera_jax.collective.cache",
    "is_cache": "ciera_jax.collective.cache",
    "cached_full": "ciera_jax.collective.cache",
    "all_gather": "ciera_jax.collective.gather",
    "all_gather_tree": "ciera_jax.collective.gather",
    "plain_all_gather": "ciera_jax.collective.gather",
    "gathered": "ciera_jax.fsdp",
    "train_step": "ciera_jax.loop",
    "Encoded": "ciera_jax.collective.gather",
    "WordEncoded": "ciera_jax.collective.gather",
    "encode": "ciera_jax.collective.gather",
    "agree": "ciera_jax.collective.gather",
    "exchange": "ciera_jax.collective.gather",
    "priming_encoded": "ciera_jax.collective.gather",
    "FixedRung": "ciera_jax.collective.capacity",
    "PLAIN_RUNG": "ciera_jax.collective.capacity",
    "needed_rung": "ciera_jax.collective.capacity",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS, globals())

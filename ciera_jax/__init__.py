"""CIERA: lossless all-gather that reuses last step's exponents (see README)."""

from ciera_jax.cache import ExponentCache, init_cache, init_cache_tree
from ciera_jax.collective import (Encoded, agree, all_gather, all_gather_tree, encode, exchange,
                                  plain_all_gather, priming_encoded)
from ciera_jax.fsdp import gathered

__all__ = [
    "ExponentCache",
    "init_cache",
    "init_cache_tree",
    "all_gather",
    "all_gather_tree",
    "plain_all_gather",
    "gathered",
    "Encoded",
    "encode",
    "agree",
    "exchange",
    "priming_encoded",
]

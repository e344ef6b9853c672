"""CIERA: lossless all-gather that reuses last step's exponents or words (see README).

The names below load on first use, so importing a light part of the package (the `ciera`
command's parser, the cost model, the planner) does not start JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ciera_jax.cache import (ExponentCache, WordCache, cached_full, init_cache,
                                 init_cache_tree, is_cache)
    from ciera_jax.collective import (Encoded, WordEncoded, agree, all_gather, all_gather_tree,
                                      encode, exchange, plain_all_gather, priming_encoded)
    from ciera_jax.fsdp import gathered

_EXPORTS = {
    "ExponentCache": "ciera_jax.cache",
    "WordCache": "ciera_jax.cache",
    "init_cache": "ciera_jax.cache",
    "init_cache_tree": "ciera_jax.cache",
    "is_cache": "ciera_jax.cache",
    "cached_full": "ciera_jax.cache",
    "all_gather": "ciera_jax.collective",
    "all_gather_tree": "ciera_jax.collective",
    "plain_all_gather": "ciera_jax.collective",
    "gathered": "ciera_jax.fsdp",
    "Encoded": "ciera_jax.collective",
    "WordEncoded": "ciera_jax.collective",
    "encode": "ciera_jax.collective",
    "agree": "ciera_jax.collective",
    "exchange": "ciera_jax.collective",
    "priming_encoded": "ciera_jax.collective",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

"""The compressed all-gather inside ``jax.shard_map``: its phases, transfers, caches and check.

gather.py           all_gather / all_gather_tree and the phases encode, agree, exchange
exponent_mode.py  exponent mode: encode and exchange
word_mode.py      word mode: encode and exchange
transfer.py         the main plane outside conditionals, the escape section, the fallback
capacity.py         FixedRung: the rung fixed when the step is compiled
selfcheck.py        the sender's checksum on the main plane; the receiver's check
validation.py       checks on what a caller passes
cache.py            ExponentCache, WordCache, init_cache
gradient.py         the one custom VJP every gather shares (backward: psum_scatter)
heal.py             what a failed check does
quantized.py        the int8 blockwise gather (the lossy baseline)

Imports :mod:`ciera_jax.codec`, :mod:`ciera_jax.kernels` and :mod:`ciera_jax.runtime`. The
public names are exported by the top-level ``ciera_jax``.

The layers above (``fsdp``, ``ciera_models``) reach the codec and the kernels only through this
package: the names below (the bit split, the rank layout, the wire table's constants, the
lowering per GPU) load their module on first use, so importing the package pulls in no JAX.
"""

import importlib

from ciera_jax.runtime.lazy import exports

_MODULES = {"bitfields": "ciera_jax.codec.bitfields", "layout": "ciera_jax.codec.layout"}
_EXPORTS = {
    **{name: "ciera_jax.codec.wire" for name in (
        "DEFAULT_CODE_BITS", "OVERFLOW_RUNGS", "PLAIN_RUNG", "ExponentWire", "WordWire",
        "agreement_bytes", "rung_for")},
    "lowering_for": "ciera_jax.kernels.backend",
}
_name, __dir__ = exports(__name__, _EXPORTS | _MODULES, globals())


def __getattr__(name: str):
    if name in _MODULES:
        module = globals()[name] = importlib.import_module(_MODULES[name])
        return module
    return _name(name)

"""The Pallas GPU backend every kernel here compiles for, chosen in one place.

Triton (``jax.experimental.pallas.triton``): our kernels are 1-D bandwidth-bound streams
(see ``encode.py`` for why Triton and not Mosaic GPU). JAX 0.11 deprecated the Triton lowering
in favour of Mosaic GPU; a port changes this file and each kernel's body, nothing else.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as plgpu


def compiler_params(num_warps: int):
    """Compiler parameters for one ``pl.pallas_call`` of a streaming kernel."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)

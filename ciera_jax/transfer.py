"""The transfers of a compressed gather: the main plane, unconditional, and escape sections
sized by a rank-invariant rung.

The main plane's all-gather sits in the step's top-level computation, so XLA can schedule it
asynchronously and overlap it with compute. An escape section is one max-capacity buffer;
:func:`gather_section` all-gathers a static prefix of it chosen by ``lax.switch`` on the agreed
rung, and its branches hold nothing but that transfer and a pad.

Shape letters: N ranks, L bytes per rank, C a capacity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def gather_rows(buf_L: jax.Array, axis_name) -> jax.Array:
    """(L,) per rank -> (N, L), rank-major, the same on every rank."""
    return lax.all_gather(buf_L, axis_name, axis=0, tiled=False, to="invarying")


def _prefix(buf_C, *, cap: int, axis_name):
    n_ranks = lax.axis_size(axis_name)
    if cap == 0:
        rows = jnp.zeros((n_ranks, buf_C.shape[0]), buf_C.dtype)
    else:
        rows = jnp.pad(gather_rows(buf_C[:cap], axis_name), ((0, 0), (0, buf_C.shape[0] - cap)))
    return varying_like(rows, buf_C, axis_name)  # every branch typed alike


def gather_section(buf_C: jax.Array, caps: tuple[int, ...], rung: jax.Array, axis_name):
    """All-gather the first ``caps[rung]`` entries of every rank's ``buf_C`` (its length is
    ``caps[-1]``); returns (N, C), zero past the prefix. ``rung`` must be rank-invariant."""
    if len(caps) == 1:
        return _prefix(buf_C, cap=caps[0], axis_name=axis_name)
    branches = [functools.partial(_prefix, cap=c, axis_name=axis_name) for c in caps]
    return lax.switch(rung, branches, buf_C)


def pick_rung(caps: tuple[int, ...], agreed: jax.Array):
    """(rung, overflow): the smallest capacity that holds ``agreed``, and whether even the top
    is too small (the gather then falls back to plain, and the rung is 0: send nothing)."""
    over = jnp.sum(agreed > jnp.asarray(caps, jnp.int32)).astype(jnp.int32)
    overflow = over == len(caps)
    return jnp.where(overflow, 0, over), overflow


def section_bytes(sizes: tuple[int, ...], rung: jax.Array) -> jax.Array:
    """int32: the bytes of the rung's prefix (``sizes``: bytes per rung)."""
    return jnp.asarray(sizes, jnp.int32)[rung]


def vma(x) -> set:
    """The mesh axes ``x`` varies over (its type's manual-axis varying set)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # JAX 0.10's type; older ones have .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def varying_like(x, operands, axis_name) -> jax.Array:
    """``x`` typed to vary over every mesh axis ``operands`` vary over, but the gather's: both
    sides of a conditional then return the same type, whatever the inputs vary over."""
    want = set().union(*(vma(a) for a in jax.tree.leaves(operands))) - {axis_name}
    missing = tuple(sorted(want - vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

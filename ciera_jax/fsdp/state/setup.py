"""What a gathering module's calls do, held on the module as a static field: the gather mode
(ciera, plain, int8) and whether a train step prepared its gathers (:func:`~ciera_jax.fsdp.
prepare`). A static field is part of the module's graph definition, so ``nnx.jit`` (and
``jax.jit`` over a split model) keys on it: a step traced under one mode and called under
another is traced again, never silently run in the mode it was first traced with.

Nothing here is read from a context: set the mode on the model with :func:`set_gather_mode`,
or for a block of code with :func:`gather_mode`."""

from __future__ import annotations

import contextlib
import dataclasses

from flax import nnx

from ciera_jax.fsdp.state.discovery import gather_spec, iter_modules

GATHER_MODES = ("ciera", "plain", "int8")
# How a prepared step's backward gets a compressed tensor's full weights: "cache" (default:
# read what the forward's gather left in the cache: a word cache's full words, no backward
# gather; an exponent cache's exponents, beside a gather of sign + mantissa alone) or
# "regather" (the same exact compressed gather again). Both give parameters bitwise equal to a
# plain gather's.
WORD_BACKWARDS = ("cache", "regather")
DEFAULT_WORD_BACKWARD = "cache"

# What a prepared layer stack's forward saves for its backward, named like MaxText's
# ``remat_policy`` (:mod:`~ciera_jax.fsdp.remat`): everything autodiff keeps, the attention's
# projections too, or each layer's input alone.
REMAT_POLICIES = ("none", "save_dot_except_mlp", "full")
DEFAULT_REMAT = "full"

SETUP_ATTR = "ciera_setup"  # on a gathering module: its GatherSetup (static, in the graphdef)


def check_policy(policy: str) -> str:
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; choose one of: "
                         f"{', '.join(REMAT_POLICIES)}")
    return policy


def check_mode(mode: str) -> str:
    if mode not in GATHER_MODES:
        raise ValueError(f"unknown gather {mode!r}; choose one of: {', '.join(GATHER_MODES)}")
    return mode


@dataclasses.dataclass(frozen=True)
class GatherSetup:
    """A gathering module's static settings.

    ``mode``: the gather (``ciera``: the caches' compressed gather; ``plain``: all-gather of
    the bits; ``int8``: blockwise absmax int8, lossy). ``impl``: the codec implementation.
    ``prepared``: a train step encoded and agreed for the whole step (the module holds the
    step's gather inputs, :func:`~ciera_jax.fsdp.prepare`); ``word_backward``: how its
    backward gets word-mode weights; ``remat``: what a prepared layer stack's forward saves
    for its backward (:mod:`~ciera_jax.fsdp.remat`). ``held``: the module's values are full
    already (a prepared layer stack gathered them): its calls only run. ``rungs``: ``((key,
    rung), ...)`` of every compressed tensor or bucket the module gathers, fixed by the host
    for this program (:func:`ciera_jax.train_step`): a call gathers from the inputs made
    ahead of the step (:mod:`~ciera_jax.fsdp.state.ahead`) at these rungs, with no encode, no
    agreement and no conditional; empty: the call encodes and agrees for itself.
    """

    mode: str = "ciera"
    impl: str = "auto"
    prepared: bool = False
    word_backward: str = DEFAULT_WORD_BACKWARD
    held: bool = False
    remat: str = DEFAULT_REMAT
    rungs: tuple = ()

    def __post_init__(self):
        check_mode(self.mode)
        if not all(isinstance(k, str) and isinstance(r, int) for k, r in self.rungs):
            raise ValueError(f"rungs must be ((key, rung), ...), got {self.rungs!r}")
        if self.word_backward not in WORD_BACKWARDS:
            raise ValueError(f"word_backward must be one of {WORD_BACKWARDS}, got "
                             f"{self.word_backward!r}")
        check_policy(self.remat)


DEFAULT_SETUP = GatherSetup()


def setup_of(module) -> GatherSetup:
    """The module's :class:`GatherSetup` (the default ``ciera`` one until a mode is set)."""
    return getattr(module, SETUP_ATTR, DEFAULT_SETUP)


def set_setup(module, setup: GatherSetup) -> None:
    object.__setattr__(module, SETUP_ATTR, setup)


def gathering_modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """(path, module) of every module under ``model`` (itself included) that gathers."""
    return [(p, m) for p, m in iter_modules(model) if gather_spec(m) is not None]


def set_gather_mode(model: nnx.Module, mode: str = "ciera", *, impl: str = "auto"):
    """Set the gather of every gathering module under ``model``; returns ``model``.

    ``ciera``: the caches' compressed gather (lossless; exponent or word caches, see
    :func:`~ciera_jax.fsdp.attach_caches`); ``plain``: all-gather of the bits (lossless
    baseline); ``int8``: blockwise absmax int8 gather (lossy baseline, ZeRO++ qwZ). The mode is
    a static field of each module, so a jitted step taking the model retraces when it changes.
    """
    if isinstance(model, str):
        raise TypeError(f"set_gather_mode(model, mode): pass the model first, then the mode "
                        f"{model!r}")
    check_mode(mode)
    for _, m in gathering_modules(model):
        set_setup(m, dataclasses.replace(setup_of(m), mode=mode, impl=impl))
    return model


@contextlib.contextmanager
def gather_mode(model: nnx.Module, mode: str = "ciera", *, impl: str = "auto"):
    """Gather with ``mode`` while inside the block (:func:`set_gather_mode`), then restore the
    modes the model had. Yields the model. It may enclose calls of a jitted step or sit
    inside a traced function: the mode is in the model's graph definition, what ``jit``
    keys on."""
    if isinstance(model, str):
        raise TypeError(f"gather_mode(model, mode): the mode is set on the model's modules "
                        f"(a static field, so jit retraces when it changes); write "
                        f"fsdp.gather_mode(model, {model!r})")
    check_mode(mode)
    saved = [(m, getattr(m, SETUP_ATTR, None)) for _, m in gathering_modules(model)]
    set_gather_mode(model, mode, impl=impl)
    try:
        yield model
    finally:
        for m, setup in saved:  # as it was, unset included (the graphdef compares equal)
            if setup is None:
                object.__delattr__(m, SETUP_ATTR)
            else:
                set_setup(m, setup)

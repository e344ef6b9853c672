"""Your own jitted train step running the trainer's program: :func:`train_step`.

Wrap the step (an ``nnx.jit`` function taking the model) and each call:

1. makes sure the model's inputs made ahead are current: an encode program (every compressed
   tensor encoded, ONE agreement, the needed rungs: :mod:`~ciera_jax.loop.ahead`) ran on the
   parameters and caches the step is about to read; it is dispatched right after the step
   before, so it runs while the host returns to your loop;
2. reads the needed rungs (the step's one host synchronisation) and picks a program that
   holds them, by the policy ``ciera train`` runs (:class:`~ciera_jax.loop.rungs.RungPolicy`,
   pricing bytes on ``link`` and each compile at what the first ones took): the rungs are a
   static field of each gathering module, so ``jit`` compiles one program per rung vector and
   the step's gathers exchange at fixed rungs, with no encode, no agreement and no
   conditional; a demand no compiled program holds runs a program with those tensors plain
   (also the first step, which primes the caches);
3. calls your step, then dispatches the next encode program.

Outside a call the modules gather as before (the bare decorator's per-call path), so an
evaluation step or a forward of your own needs nothing else. Inside, the model's calls must
read the parameters the step was called with (the optimizer's update after them, as usual):
a call sends what the encode program made of those, whose checksum its self-check reads."""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ciera_jax.collective import PLAIN_RUNG
from ciera_jax.fsdp import buckets
from ciera_jax.fsdp.state.ahead import ahead_of
from ciera_jax.fsdp.state.caches import GatherCacheVar
from ciera_jax.fsdp.state.setup import gathering_modules, set_setup, setup_of
from ciera_jax.loop.ahead import encode_ahead, wire_of
from ciera_jax.loop.rungs import RungPolicy, exits_for, seconds_per_byte
from ciera_jax.planning import clusters, links


def agreed_seconds(seconds: float) -> float:
    """Process 0's figure on every process (a compile's seconds, which price the next
    program): each process's policy must pick the same programs, and each measures its own."""
    if jax.process_count() == 1:
        return seconds
    return float(multihost_utils.broadcast_one_to_all(np.float32(seconds)))


def _models(args, kwargs) -> list:
    """The ``nnx.Module`` arguments holding a gathering module, each once."""
    out, seen = [], set()
    for a in (*args, *kwargs.values()):
        if isinstance(a, nnx.Module) and id(a) not in seen and gathering_modules(a):
            seen.add(id(a))
            out.append(a)
    return out


def _read(model) -> list:
    """The arrays the encode program reads: parameters and caches."""
    return jax.tree.leaves(nnx.state(model, nnx.Any(nnx.Param, GatherCacheVar)))


class TrainStep:
    """``step`` (a function taking the model) run at rungs the host picks. Counters:
    ``steps``, ``plain_steps`` (steps whose program gathers a compressed tensor plain: the
    priming step, a demand above every compiled rung), ``encodes`` (encode programs run);
    ``programs``: the rung vectors compiled, ``{(model index, module path, key): rung}`` each;
    ``policies``: the :class:`~ciera_jax.loop.rungs.RungPolicy` of each set of such units
    called (made at its first call, from the wires it prices)."""

    def __init__(self, step, *, max_programs: int = 8, patience: float = 1.0,
                 headroom: int = 3, link=None):
        if max_programs < 1 or not patience >= 0 or headroom < 0:
            raise ValueError(f"max_programs must be >= 1, patience and headroom >= 0, got "
                             f"{max_programs}, {patience} and {headroom}")
        self.step = step
        self.max_programs, self.patience, self.headroom = max_programs, patience, headroom
        self.link = None if link is None else clusters.get_link(link)  # a bad name fails here
        self.policies: dict = {}  # sorted units -> RungPolicy
        self.steps = self.plain_steps = self.encodes = 0
        self._read: dict = {}  # id(model) -> weak references to what its encode read
        functools.update_wrapper(self, step)

    @property
    def programs(self) -> list:
        return [dict(p) for policy in self.policies.values() for p in policy.programs]

    def __call__(self, *args, **kwargs):
        models = _models(args, kwargs)
        for m in models:
            if not self._current(m):
                self._encode(m)
        units = {}  # (model index, module path, key) -> (module, needed, encoded)
        for i, m in enumerate(models):
            for path, mod in gathering_modules(m):
                for k, (e, _, needed) in ahead_of(mod).items():
                    units[(i, "/".join(map(str, path)), k)] = (mod, needed, e)
        if not units:
            return self.step(*args, **kwargs)
        needed = jax.device_get({u: v[1] for u, v in units.items()})  # the one host sync
        policy = self._policy(units, needed)
        rungs, new = policy.choose(needed)
        saved = self._fix(units, rungs)
        t0 = time.perf_counter()
        try:
            out = self.step(*args, **kwargs)
        finally:
            for mod, setup in saved:
                set_setup(mod, setup)
        if new:  # the call compiled the program (the step itself runs on, dispatched)
            policy.compiled(agreed_seconds(time.perf_counter() - t0))
        self.steps += 1
        self.plain_steps += any(r == PLAIN_RUNG for r in rungs.values())
        for m in models:
            self._encode(m)
        return out

    def _policy(self, units: dict, needed: dict) -> RungPolicy:
        """The policy of this set of units, made at its first call: their wires priced on
        ``link`` (default: this platform's built-in profile) over the most ranks any of them
        gathers, ``headroom`` overflow rungs over a demand still rising (the units carrying
        enough of the word bytes: :func:`~ciera_jax.loop.rungs.exits_for`)."""
        key = tuple(sorted(units))
        if key not in self.policies:
            wires = {u: wire_of(e, np.ndim(needed[u])) for u, (_, _, e) in units.items()}
            ranks = max(buckets.unwrap(e).n_ranks for _, _, e in units.values())
            device = jax.devices()[0]
            link = clusters.get_link(self.link or links.default_profile(device.platform,
                                                                        device.device_kind))
            layers = {u: max(1, np.size(n)) for u, n in needed.items()}
            self.policies[key] = RungPolicy(
                wires, seconds_per_byte(link, ranks), max_programs=self.max_programs,
                patience=self.patience, exits=exits_for(wires, layers, self.headroom),
                holds=True)
        return self.policies[key]

    def _fix(self, units: dict, rungs: dict) -> list:
        """Each module's setup with its rungs fixed; returns the setups it had."""
        per_module: dict = {}
        for u, (mod, _, _) in units.items():
            per_module.setdefault(id(mod), (mod, []))[1].append((u[2], rungs[u]))
        saved = []
        for mod, fixed in per_module.values():
            saved.append((mod, setup_of(mod)))
            set_setup(mod, dataclasses.replace(setup_of(mod), rungs=tuple(fixed)))
        return saved

    def _encode(self, model) -> None:
        encode_ahead(model)
        self.encodes += 1
        self._read[id(model)] = [weakref.ref(a) for a in _read(model)]

    def _current(self, model) -> bool:
        """Did the last encode read exactly the arrays the model holds now?"""
        refs = self._read.get(id(model))
        now = _read(model)
        return refs is not None and len(refs) == len(now) and all(
            r() is a for r, a in zip(refs, now))


def train_step(step=None, *, max_programs: int = 8, patience: float = 1.0, headroom: int = 3,
               link=None):
    """Run a jitted train step over a model with gathering modules (``@ciera_jax.gathered``,
    ``fsdp.shard``) as ``ciera train`` runs its own: encode ahead, one agreement a step, rungs
    fixed per compiled program and picked on the host by its policy, no conditional. Use it as
    a decorator above ``@nnx.jit`` (or ``train_step(step)``); returns a :class:`TrainStep`.
    ``max_programs``, ``patience``: ``ciera train``'s ``--max-programs`` and
    ``--program-patience``; ``headroom``: its ``--overflow-rungs``; ``link``: the link bytes
    are priced on (a profile or cluster name, ``16xh100-ib400``, or a Profile; default: this
    platform's built-in profile). The model is any ``nnx.Module`` argument; the step runs
    under ``jax.set_mesh`` with the parameters placed (the gathers open their own
    ``shard_map``). Bitwise the parameters of a plain gather."""
    options = dict(max_programs=max_programs, patience=patience, headroom=headroom, link=link)
    if step is None:
        return functools.partial(train_step, **options)
    return TrainStep(step, **options)

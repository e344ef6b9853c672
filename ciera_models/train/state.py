"""The training state, and the trainer that owns its shapes, shardings and compiled step.

:func:`ciera_models.train.build.build_trainer` makes the trainer for a config, memoized.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp
from ciera_jax.collective import PLAIN_RUNG
from ciera_jax.collective.cache import EMPTY_SHAPE
from ciera_jax.fsdp import AXIS
from ciera_jax.planning import clusters
from ciera_jax.planning.links import default_profile
from ciera_jax.runtime import gpu_targets
from ciera_jax.loop import step as loop_step
from ciera_jax.loop.rungs import (RungPolicy, exits_for, program_key, rungs_holding,
                                  seconds_per_byte)
from ciera_models.train import memory_limit
from ciera_models.resilience import peers, watchdog
from ciera_models.train.beside import CompilesBeside, abstract_like, in_thread
from ciera_models.train.data import Dataset
from ciera_models.model.transformer import Transformer
from ciera_models.train.compression import NO_CACHE
from ciera_models.train.step import AHEAD_SPECS, all_words, per_layer_stats

INT32_MAX = np.iinfo(np.int32).max
PROGRAMS = ("steady", "priming")  # the programs Trainer.at_rungs names
ENCODE = "encode"  # the encode program's key among the programs compiled beside the steps


@dataclasses.dataclass
class TrainState:
    """``ahead``: what the encode program prepared after the previous step for this one
    (``encoded``: the ``ciera_jax.Encoded`` of every compressed tensor, per rank;
    ``word_changed``: bf16 words of each gathered tensor that differ from the previous
    gather). Derived, like the caches: never checkpointed; None after init/restore (then
    :meth:`Trainer.prepare` encodes at the start, and the step's gathers prime the fresh
    caches)."""

    step: int
    params: nnx.State
    caches: nnx.State
    opt_state: object
    ahead: dict | None = None

    @property
    def priming(self) -> bool:
        """The next step's gathers prime fresh caches (first step, first after a restore)."""
        return self.ahead is None


def bytes_per_device(tree) -> int:
    """Bytes one device holds of the arrays in ``tree`` (its shard; replicated: all of it)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(tree))


def fresh_caches(abstract, tensors: dict, modes: dict):
    """Unprimed caches shaped like ``abstract`` (the cache state of ``fsdp.attach_caches`` on
    the abstract model), each in its tensor's mode: a word or exponent cache, or a one-byte
    placeholder (``EMPTY_SHAPE``) for every tensor ``modes`` says ``none`` (gathered plainly: a
    cache would be memory for nothing); stacked tensors get one per layer. Only these are ever
    allocated."""
    def fresh(t, mode):
        shape, mode = (EMPTY_SHAPE, "exponent") if mode == NO_CACHE else (t.shape, mode)
        one = lambda _=None: ciera_jax.init_cache(shape, t.dtype, mode)  # noqa: E731
        return jax.vmap(one)(jnp.zeros(t.stack)) if t.stack else one()

    missing = set(fsdp.cache_dict(abstract)) - set(modes)
    if missing:
        raise ValueError(f"no cache mode for {sorted(missing)}")
    return fsdp.with_caches(abstract, {k: fresh(tensors[k], m) for k, m in modes.items()})


def agreed_seconds(seconds: float) -> float:
    """:func:`ciera_jax.loop.step.agreed_seconds` once every process arrived."""
    if jax.process_count() == 1:
        return seconds
    # Processes come here after compiles of uneven length (one that loads the program from
    # JAX's compilation cache is done long before one that compiles it: on CPUs each process's
    # program has a key of its own, and only process 0 writes the cache), and the broadcast
    # may be their first collective, which gloo abandons when a peer is late past its timeout.
    peers.all_arrived("compiled")
    return loop_step.agreed_seconds(seconds)


def is_spec(x) -> bool:
    return isinstance(x, P)


def placed_abstract(tree, specs, mesh):
    """Abstract arrays with the shardings ``specs`` (a prefix tree of PartitionSpecs): what
    arrays placed with :func:`ciera_jax.fsdp.put` look like to ``jit``."""
    def one(spec, sub):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, spec)), sub)
    return jax.tree.map(one, specs, tree, is_leaf=is_spec)


@dataclasses.dataclass
class Trainer:
    tc: object  # TrainConfig
    mesh: Mesh
    graphdef: object
    param_specs: object  # prefix tree of PartitionSpecs over params
    opt_specs: object
    tx: optax.GradientTransformation
    kinds: dict[str, str]
    step_fn: Callable
    tensors: dict = dataclasses.field(default_factory=dict)  # key -> fsdp.GatheredTensor
    compress: dict = dataclasses.field(default_factory=dict)  # key -> bool (ciera only)
    plan_summary: str = ""
    prepare_fn: Callable | None = None
    cache_modes: dict = dataclasses.field(default_factory=dict)  # key -> exponent, word, none
    cache_shapes: object = None  # the abstract cache state (every tensor's, exponent mode)
    param_shapes: object = None  # the abstract params (``ciera aot`` lowers the step on them)
    compiled: bool = False  # a step has run (so the next one does not compile)
    policy: RungPolicy | None = None  # picks each step's rungs (ciera_jax.loop.rungs)
    programs: dict = dataclasses.field(default_factory=dict)  # rung vector -> compiled step
    # the policy's programs compiling while the steps run others (--compile-beside)
    beside_compiles: CompilesBeside = dataclasses.field(default_factory=CompilesBeside)
    # prepare_fn compiled, or a Future while it compiles (None then with --compile-beside)
    encode_program: object = None
    _encode_seconds: tuple = (0.0, 0.0)  # (waited for, compiling) not yet in a step's metrics
    priming_ahead: dict | None = None  # placed, while steps prime beside the encode's compile
    ahead_shapes: dict | None = None  # the shapes of ``ahead`` (_ahead_shapes)
    encode_trace: object = None  # prepare_fn traced by _ahead_shapes, until it is lowered
    attention: str = "xla"  # the attention's implementation (tc.attention resolved)
    experts: str = "ragged"  # the experts' grouped matmul (tc.experts_matmul resolved)

    @property
    def n(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def beside(self) -> bool:
        """Whether a step whose program is not compiled runs one that is (the priming program
        at first) while it compiles in a thread (``--compile-beside``; auto: on accelerators,
        where a compile takes minutes and a step seconds, not on a CPU's few cores)."""
        if self.tc.gather != "ciera":
            return False  # one program: plain's
        if self.tc.compile_beside != "auto":
            return self.tc.compile_beside == "on"
        return self.mesh.devices.flat[0].platform != "cpu"

    def _take_compiled_beside(self, policy: RungPolicy) -> float:
        """Move the programs compiled beside (on every process) into :attr:`programs` (the
        encode program into :attr:`encode_program`); each step program's compile seconds price
        the policy's next program. Returns those seconds."""
        taken = self.beside_compiles.take_ready()
        if ENCODE in taken:
            self.encode_program, seconds = taken.pop(ENCODE)
            self._encode_seconds = (0.0, seconds)  # reported with this step's metrics
        for key, (compiled, seconds) in taken.items():
            self.programs[key] = compiled
            policy.compiled(agreed_seconds(seconds))
        return sum(seconds for _, seconds in taken.values())

    def _stand_in(self, policy: RungPolicy, needed: dict) -> dict:
        """The rungs of the compiled program that sends the fewest bytes for ``needed``; the
        priming program's (every gather plain, the caches filled from it) when none is."""
        if not self.programs:
            return {k: PLAIN_RUNG for k in policy.wires}
        return policy.cheapest(self.programs, needed)

    @property
    def holds(self) -> bool:
        """Whether every program holds its step's demand (``--fallback program``; auto: on
        GPUs, where a conditional is a host sync): its gathers compile no fallback and no
        conditional, and the host runs another program for a demand above its rungs."""
        if self.tc.fallback != "auto":
            return self.tc.fallback == "program"
        return gpu_targets.is_gpu(self.mesh.devices.flat[0].platform)

    @property
    def compiler_options(self) -> dict:
        """XLA's options for the step: on GPUs the flag set ``ciera aot`` reports with
        (``tc.xla_flags``: the FSDP set overlaps each layer's gathers with compute), none on
        other platforms."""
        if not gpu_targets.is_gpu(self.mesh.devices.flat[0].platform):
            return {}
        return gpu_targets.compiler_options(self.tc.xla_flags)

    def compile(self, args: tuple, log=None, lowered=None):
        """The step compiled for ``args`` (one rung vector's program; ``lowered``: the step
        lowered for them already). On GPUs: with :attr:`compiler_options`, and XLA's scheduler
        memory limit as ``--memory-limit`` says (:func:`ciera_models.train.memory_limit.compile_within`,
        the policy ``ciera aot`` reports with; a GPU model not in ``gpu_targets.TARGETS`` keeps
        XLA's own limit)."""
        with watchdog.compiling():
            return self._compile(args, log, lowered)

    def _compile(self, args: tuple, log, lowered):
        lowered = self.step_fn.lower(*args) if lowered is None else lowered
        device = self.mesh.devices.flat[0]
        target = gpu_targets.target_of(device) if gpu_targets.is_gpu(device.platform) else None
        if target is None:
            return gpu_targets.compile_with(lowered, self.compiler_options)
        tokens = self.tc.batch_size * self.tc.length // self.n
        limit = memory_limit.scheduler_limit(self, args, target, tokens)
        at = lambda slop: gpu_targets.compile_with(  # noqa: E731
            lowered, gpu_targets.compiler_options(self.tc.xla_flags, slop))
        kept, _ = memory_limit.compile_within(
            limit, self.tc.memory_limit, at,
            lambda c: memory_limit.xla_total(c.memory_analysis()),
            log or (lambda line: print(line, file=sys.stderr, flush=True)), who="ciera train")
        return kept

    def prepare(self, state: TrainState) -> TrainState:
        """Fill ``state.ahead`` at the start (first step, after a restore): encode against
        the current (unprimed) caches, so the first gather primes them."""
        if state.ahead is not None:
            return state
        caches = fsdp.cache_dict(state.caches)
        encodes = not self.beside or self.encode_program is not None  # not still compiling
        if encodes:
            self.priming_ahead = None  # no more steps that prime beside the encode's compile
        if encodes and any(np.any(np.asarray(c.primed)) for c in caches.values()):
            words = fsdp.put(all_words(self.tensors), P(), self.mesh)  # placed as a step's
            return dataclasses.replace(state, ahead=self.encode(state.params, state.caches, words))
        # Fresh caches (init, restore), or the encode program still compiling beside the
        # steps: every Encoded only has to say "prime me" (demand = int32 max), and the
        # priming gather sends the shard's own bits, not the payload. So build it on the host
        # instead of compiling the encoder a second time; placed once for the steps that prime
        # while the encode program compiles (the step does not donate it), then let go of.
        ahead = self.priming_ahead or self._placed_priming_ahead()
        self.priming_ahead = None if encodes else ahead
        return dataclasses.replace(state, ahead=ahead)

    def _placed_priming_ahead(self) -> dict:
        """``ahead`` asking every compressed gather to prime, placed as a step takes it."""
        shapes = self._ahead_shapes()
        wires = self.rung_policy().wires
        host = {"encoded": fsdp.priming_inputs(self.tensors, shapes["encoded"], self.n),
                "word_changed": jax.tree.map(np.asarray, jax.device_get(
                    all_words(self.tensors))),
                "agreed": jax.tree.map(lambda a: np.full(a.shape, INT32_MAX, a.dtype),
                                       shapes["agreed"]),
                "needed": {k: np.full(a.shape, wires[k].rungs, a.dtype)
                           for k, a in shapes["needed"].items()}}
        return fsdp.put(host, AHEAD_SPECS, self.mesh)

    def encode_arguments(self) -> tuple:
        """``(params, caches, word_changed)`` as the encode program takes them, abstract: the
        trainer's shapes and placements (fresh caches: a restored state's have the same
        structure), the words placed as a step's."""
        params = placed_abstract(self.param_shapes, self.param_specs, self.mesh)
        caches = placed_abstract(jax.eval_shape(lambda: fresh_caches(
            self.cache_shapes, self.tensors, self.cache_modes)), P(), self.mesh)
        words = placed_abstract(jax.eval_shape(lambda: all_words(self.tensors)),
                                AHEAD_SPECS["word_changed"], self.mesh)
        return params, caches, words

    def _ahead_shapes(self):
        """The shapes of ``ahead``, from the encode's trace (once per trainer), which
        :meth:`start_encode_compile` then lowers instead of tracing the encode again."""
        if self.ahead_shapes is None:
            self.encode_trace = self.prepare_fn.trace(*self.encode_arguments())
            self.ahead_shapes = self.encode_trace.out_info
        return self.ahead_shapes

    def start_encode_compile(self) -> None:
        """Compile the encode program (one for the whole run) in a thread of its own, for the
        trainer's arguments (:meth:`encode_arguments`). XLA lets go of Python while it
        compiles, so what the process does meanwhile runs beside it: ``ciera train`` starts it
        before it makes or restores the state (Python, mostly one core), and the first step
        program compiles after (on a GPU host, in the wall time of that compile alone)."""
        if self.encode_program is not None or ENCODE in self.beside_compiles:
            return
        self._ahead_shapes()
        traced, self.encode_trace = self.encode_trace, None  # lowered once: let go of it
        if traced is None:  # let go of already (a copy of a trainer that compiled it)
            traced = self.prepare_fn.trace(*self.encode_arguments())
        lowered = traced.lower()
        options = self.compiler_options

        def compile_fn():
            with watchdog.compiling():
                return gpu_targets.compile_with(lowered, options)
        if self.beside:  # taken by a step once compiled on every process (until then, steps prime)
            self.beside_compiles.start(ENCODE, compile_fn)
        else:
            self.encode_program = in_thread(compile_fn, "ciera-encode")

    def encode(self, params, caches, word_changed) -> dict:
        """``ahead`` for the next step: the encode program (``prepare_fn``: every compressed
        tensor encoded against ``caches``, one agreement, the rungs needed) on ``params``,
        compiled first if it is not (:meth:`start_encode_compile`). The seconds this waited for
        the compile and the compile's own are reported with the next step's metrics. With
        programs compiled beside (:attr:`beside`), None while it compiles: the next step primes
        the caches again (its gathers plain) instead of waiting."""
        if self.beside and self.encode_program is None:
            return None  # compiling beside the steps (started after this one)
        t0 = time.perf_counter()
        self.start_encode_compile()
        if isinstance(self.encode_program, concurrent.futures.Future):
            self.encode_program, compiling_s = self.encode_program.result()
            waited, compiled = self._encode_seconds
            self._encode_seconds = (waited + time.perf_counter() - t0, compiled + compiling_s)
        return self.encode_program(params, caches, word_changed)

    def rung_policy(self) -> RungPolicy:
        """The policy that picks each step's rungs (made on first use: it prices the wire of
        every compressed tensor, whose shapes the encode knows, on the link the plan priced:
        ``--profile``)."""
        if self.policy is None:
            shapes = self._ahead_shapes()["encoded"]
            platform = self.mesh.devices.flat[0].platform
            link = clusters.get_link(self.tc.profile or default_profile(platform))
            self.policy = RungPolicy(fsdp.wires(self.tensors, shapes, self.n),
                                     seconds_per_byte(link, self.n),
                                     exits=self.unit_exits(shapes), holds=self.holds,
                                     **self.tc.rung_policy_options())
        return self.policy

    def unit_exits(self, encoded) -> dict:
        """``{key: overflow rungs}`` of every compressed tensor and bucket: ``--overflow-rungs``
        where the unit carries enough of the word bytes
        (:func:`ciera_jax.loop.rungs.exits_for`), none elsewhere. ``encoded``: ahead's, arrays or
        shapes."""
        return exits_for(fsdp.wires(self.tensors, encoded, self.n),
                         fsdp.unit_layers(self.tensors, encoded), self.tc.overflow_rungs)

    def at_rungs(self, args: tuple, rungs="steady") -> tuple:
        """The step's ``(params, caches, opt_state, ahead, tokens)`` with every compressed
        gather's rung fixed (the ahead's ``agreed``): ``rungs`` is ``{key: rung}``,
        ``"steady"`` (each tensor at the rung holding the steady-state demand,
        ``ciera_jax.loop.rungs.rungs_holding``: the first step's program) or ``"priming"``
        (every one plain). Abstract arguments work too (``ciera aot``)."""
        params, caches, opt_state, ahead, tokens = args
        if isinstance(rungs, str):
            if rungs not in PROGRAMS:
                raise ValueError(f"rungs must be a dict or one of {PROGRAMS}, got {rungs!r}")
            wires = fsdp.wires(self.tensors, ahead["encoded"], self.n)
            rungs = (rungs_holding(wires) if rungs == "steady"
                     else {k: PLAIN_RUNG for k in wires})
        exits = (self.policy.exits if self.policy is not None
                 else self.unit_exits(ahead["encoded"]))
        ahead = {**ahead, "agreed": fsdp.fix_rungs(ahead["agreed"], rungs, ahead["needed"],
                                                   exits, guaranteed=self.holds)}
        return params, caches, opt_state, ahead, tokens

    def step(self, state: TrainState, tokens: jax.Array,
             steps_left: int | None = None) -> tuple[TrainState, dict]:
        """One step from ``state`` (its arrays are donated): the next state and the step's
        metrics on the host. The caller decides whether the next state is taken.
        ``steps_left`` (this one included), when known, keeps a program that could not pay
        for its compile from being compiled.

        The rungs of the step's gathers are fixed here, from the demands the previous step
        agreed on (``ahead["needed"]``, read on the host) by :attr:`policy`; a rung vector not
        run before compiles a program (``m["compile_s"]``); a tensor whose demand is above the
        program's rung overflows (``m["overflows"]``: tensor-layers): a word tensor up to
        ``--overflow-rungs`` above still sends words at the rung it needs
        (``m["overflow_words"]``), any other takes the plain fallback. With programs compiled
        beside (:attr:`beside`), a rung vector not compiled yet starts compiling in a thread
        and the step runs a compiled stand-in (``m["stand_in"]``; the first step, the priming
        program); the new program runs from the first step it has compiled on every process
        (``m["beside_compile_s"]``: its compile's seconds, waited for by no step)."""
        beside_s = self._take_compiled_beside(self.rung_policy()) if self.beside else 0.0
        priming = state.priming
        state = self.prepare(state)
        policy = self.rung_policy()
        needed = jax.device_get(state.ahead["needed"])
        rungs, _ = policy.choose(needed, steps_left)
        base = (state.params, state.caches, state.opt_state, state.ahead, tokens)
        wanted = program_key(rungs)
        if self.beside and (wanted not in self.programs or priming):
            # while ``wanted`` compiles beside, or to prime: the cheapest program compiled
            rungs = self._stand_in(policy, needed)
        args = self.at_rungs(base, rungs)
        key = program_key(rungs)
        compile_s = 0.0
        if key not in self.programs:
            t0 = time.perf_counter()
            lowered = self.step_fn.lower(*args)
            # The encode program compiles beside the run's first step program (unless it
            # started earlier, as ``ciera train`` starts it), once that is traced: started
            # before, its compile threads would slow the trace (Python) down more than they
            # overlap it. With
            # programs compiled beside, the first steps prime instead: it starts after.
            if not self.beside:
                self.start_encode_compile()
            self.programs[key] = self.compile(args, lowered=lowered)
            compile_s = time.perf_counter() - t0
            if key == wanted:  # the policy's own (a stand-in does not price its programs)
                policy.compiled(agreed_seconds(compile_s))
        compile_beside = (self.beside and wanted not in self.programs
                          and wanted not in self.beside_compiles)
        # its arguments' shapes, taken before the step donates them
        wanted_args = abstract_like(self.at_rungs(base, dict(wanted))) if compile_beside else None
        params, caches, opt_state, word_changed, m = self.programs[key](*args)
        ahead = self.encode(params, caches, word_changed)
        self.compiled = True
        m = jax.device_get(m)
        if self.beside:  # once the step has run: they compile beside the next steps
            self.start_encode_compile()
            if compile_beside:
                self.beside_compiles.start(wanted, lambda: self.compile(wanted_args))
        m["gather"] = per_layer_stats(self.tensors, m["gather"])
        (encode_waited_s, encode_compile_s), self._encode_seconds = self._encode_seconds, (0, 0)
        m["step_compile_s"] = compile_s  # this step's program (0: compiled before)
        m["compile_s"] = compile_s + encode_waited_s  # all the step waited for compiles
        m["encode_compile_s"] = encode_compile_s  # the encode program's own, beside the step's
        m["program"] = list(self.programs).index(key)
        m["beside_compile_s"] = beside_s  # programs taken now, compiled beside earlier steps
        m["stand_in"] = int(key != wanted)  # this step ran a stand-in while ``wanted`` compiled
        # tensor-layers above their program's rungs; of those, the ones still sent as words,
        # at an overflow rung (the rest went plainly)
        m["overflows"], m["overflow_words"] = policy.overflows(rungs, needed)
        m["padding_bytes"] = policy.padding(rungs, needed)  # one rank's, as sent_bytes
        # A failed self-check left params and optimizer state as they were: same step again.
        done = 0 if int(m["verify_failed"]) else 1
        return TrainState(state.step + done, params, caches, opt_state, ahead), m

    def init_state(self, seed: int) -> TrainState:
        model = Transformer(self.tc.model, nnx.Rngs(seed), self.attention, self.experts)
        _, params, _ = nnx.split(model, nnx.Param, ...)
        params = fsdp.put(params, self.param_specs, self.mesh)
        caches = fsdp.put(fresh_caches(self.cache_shapes, self.tensors, self.cache_modes), P(),
                          self.mesh)
        opt_state = jax.jit(self.tx.init, out_shardings=jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.opt_specs, is_leaf=is_spec))(params)
        return TrainState(0, params, caches, opt_state)

    def batch(self, data: Dataset, seed: int, position: int) -> jax.Array:
        toks = data.batch(seed, position, self.tc.batch_size, self.tc.length)
        return fsdp.put(toks, P(AXIS), self.mesh)

"""Which rungs a step is compiled at: a host-side policy over the demands it already knows.

``ciera train``'s steps and a user's own (:func:`ciera_jax.train_step`) both run it.
A step compiled with fixed rungs (:mod:`ciera_jax.collective.capacity`) sends each tensor's
escape section at a static size inside its main transfer. The host knows the next step's
demand exactly (the end of this step encoded and agreed on it), so it could fix the cheapest
rungs every step, but every new rung vector is a new program to compile, and a compile costs
as much as a step's codec many times over. :class:`RungPolicy` prices both in seconds (a
ski-rental rule): the first step compiles one program, at rungs holding the steady-state
demand (a fresh cache takes the fallback, so that program also primes the caches); every step
runs the cheapest compiled program for its demand (a tensor above its program's rung takes
the fallback: a plain gather, exact, at plain's bytes); a new program is bought only when the
wire time the compiled ones lost against each step's ideal adds up to what a compile costs
(``patience`` times the compiles measured so far), up to ``max_programs``. A new program fits
the last ``window`` steps' demands, not just this one's, so a drift (warm-up, peak, decay)
needs few of them.

Host-side, over :mod:`ciera_jax.codec.wire`: the caller feeds it the needed rungs each step
returned and each compile's seconds, and prices bytes with a link
(:func:`seconds_per_byte`). Each tensor's bytes are a table made once (a row per fixed rung, a
column per demand, :func:`bytes_table`), so a step's price is a row times how many layers need
each rung: it runs before every step's launch, so it must cost far less than the step, and
asking the wire of every layer each step would cost many times more.
"""

from __future__ import annotations

import collections
import dataclasses

import math

import numpy as np

from ciera_jax.collective import PLAIN_RUNG, WordWire, rung_for
from ciera_jax.planning import costmodel

# Steady-state demands, as shares of a shard's elements, for a program compiled before any
# step ran (the first program, ``ciera aot``): word mode's escapes at 3 bits (small's and
# tiny's steady state, the word-delta study) and exponent mode's changed exponents after
# warm-up (the stability study), each rounded up to a rung.
STEADY_ESCAPES = 1 / 8
STEADY_EXPONENTS = 1 / 512
COMPILE_S_PRIOR = 60.0  # a compile's price until one was measured (``compiled``)
# Word units (tensors, buckets) that compile overflow rungs (``wire.overflow_rungs``): those
# carrying at least this share of the word bytes a step sends. An exit costs every unit the
# same compile (a switch and a fill in its fallback), whatever its size, and saves bytes in
# proportion to it: OLMoE-1B-7B's 3 expert tensors carry nearly all its word bytes (embed,
# head and each attention projection fall below this share); tiny's and small's layer
# buckets carry most of theirs.
EXIT_SHARE = 1 / 32

Rungs = tuple  # ((key, rung), ...) in key order: hashable, one per compiled program


@dataclasses.dataclass
class RungPolicy:
    """``wires``: ``{key: ExponentWire | WordWire}`` of one layer of each compressed tensor or
    bucket (:func:`ciera_jax.fsdp.wires`; keys of one kind, which sort); ``seconds_per_byte``:
    what one more byte sent by one rank costs the step (:func:`seconds_per_byte` of the plan's
    link); ``first``: the first program's rungs (default :func:`rungs_holding`).
    Deterministic: every process of a multi-host run feeds it the same agreed demands and the
    same compile price, and so compiles and runs the same programs.

    A new program is compiled when the wire time the compiled ones lost against each step's
    ideal, summed since the last new one, passes ``patience`` compiles' seconds, and what it
    saves at this step's rate over ``steps_left`` pays for it too; it is the rung vector that
    would have sent the fewest bytes over the last ``window`` steps. ``patience=0`` buys one
    whenever a better one exists (up to ``max_programs``). With ``holds`` the same rule moves
    the run back down: a demand falling after the warm-up leaves the warm-up's programs
    padded, and the wire time they lose buys the window's program, at lower rungs holding each
    of its steps (a compiled program that holds a step's demand runs it before any is
    bought)."""

    wires: dict
    seconds_per_byte: float
    first: dict | None = None
    max_programs: int = 8
    patience: float = 1.0
    window: int = 4
    # word mode's overflow rungs compiled in every program (``bytes_at``): for every key, or
    # ``{key: exits}`` (a key left out: none; :func:`exits_for`)
    exits: int | dict = 0
    # every program a step runs holds each tensor's demand in every layer (its rung at or
    # above the layers' highest need, or plain): the steps compile no fallback and no
    # conditional (``capacity.FixedRung.guaranteed``), and a demand no compiled program holds
    # runs a plain-rung program instead (the priming program at worst)
    holds: bool = False
    programs: list = dataclasses.field(default_factory=list)
    compile_s: list = dataclasses.field(default_factory=list)  # seconds of each compile
    _history: collections.deque = dataclasses.field(init=False, repr=False)
    _regret_s: float = dataclasses.field(default=0.0, init=False, repr=False)

    def __post_init__(self):
        if self.max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {self.max_programs}")
        if not self.patience >= 0:
            raise ValueError(f"patience must be >= 0, got {self.patience}")
        if any(e < 0 for e in (self.exits.values() if isinstance(self.exits, dict)
                               else (self.exits,))):
            raise ValueError(f"exits must be >= 0, got {self.exits}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not self.seconds_per_byte >= 0:
            raise ValueError(f"seconds_per_byte must be >= 0, got {self.seconds_per_byte}")
        if self.first is None:
            self.first = rungs_holding(self.wires)
        if set(self.first) != set(self.wires):
            raise ValueError(f"first program's rungs name {sorted(self.first)}, the wires "
                             f"{sorted(self.wires)}")
        self._history = collections.deque(maxlen=self.window)
        # holding programs compile no overflow rung: ``exits`` is then the first compressed
        # program's headroom (:meth:`_raised`)
        self._tables = {k: bytes_table(w, 0 if self.holds else self.exits_of(k))
                        for k, w in self.wires.items()}

    @property
    def compile_price_s(self) -> float:
        """What buying a program costs: ``patience`` times the mean compile measured so far
        (:data:`COMPILE_S_PRIOR` before any)."""
        mean = float(np.mean(self.compile_s)) if self.compile_s else COMPILE_S_PRIOR
        return self.patience * mean

    def start_run(self) -> None:
        """A new run on the same compiled programs: what earlier runs lost or asked for does
        not buy this one a program (its choices depend on the programs it has, not on the
        history of the process)."""
        self._history.clear()
        self._regret_s = 0.0

    def compiled(self, seconds: float) -> None:
        """The trainer measured a program's compile: it prices the next one."""
        self.compile_s.append(float(seconds))

    def choose(self, needed: dict, steps_left: int | None = None) -> tuple[dict, bool]:
        """``needed``: ``{key: needed rung}`` (an int, or an array per layer for stacks;
        ``wire.rungs``: above the top or unprimed); ``steps_left``: the steps the run has left,
        this one included, when known. Returns (``{key: rung}`` to run the step at, whether
        that is a program not compiled before)."""
        demand = self.demand(needed)
        ideal = self._best([demand])
        if any(r != PLAIN_RUNG for r in ideal.values()):  # a priming step tells nothing
            self._history.append(demand)
        if not self.programs:
            return self._compile(ideal if self.holds else dict(self.first))
        best = self._cheapest(self.programs, demand)
        if self._plain_could_compress(best, ideal):
            # No compiled program sends a tensor compressed that could be: what a program
            # without ``holds`` sends as words at an overflow rung or in its per-layer
            # fallback, this one would gather plainly, the whole tensor, until a compile paid
            # off. So buy one now (the first compressed program too): the window's, with
            # headroom for a demand still rising (warm-up).
            return self._compile(self._raised(self._best(list(self._history))))
        return self._rent_or_buy(best, ideal, demand, steps_left)

    def _plain_could_compress(self, best: dict, ideal: dict) -> bool:
        """Whether a holding policy with room for a program runs a tensor plainly (``best``)
        that this step could send compressed (``ideal``)."""
        return (self.holds and len(self.programs) < self.max_programs
                and any(best[k] == PLAIN_RUNG != ideal[k] for k in ideal))

    def _rent_or_buy(self, best: dict, ideal: dict, demand: dict,
                     steps_left: int | None) -> tuple[dict, bool]:
        """Run ``best`` (rent) until the wire time it lost against each step's ``ideal``
        passes a compile's price, then buy the window's program, or this step's where the
        window's does not help it."""
        self._regret_s += self.seconds(self._cost(best, demand) - self._cost(ideal, demand))
        if not self._may_buy():
            return best, False
        new = self._best(list(self._history))
        if program_key(new) in self.programs or self._cost(new, demand) >= self._cost(best,
                                                                                      demand):
            new = ideal  # the window's program does not help this step: this step's does
        return self._buy_if_it_pays(best, new, demand, steps_left)

    def _may_buy(self) -> bool:
        """Whether the lost wire time passed a compile's price and a program is left to buy."""
        return (self._regret_s > self.compile_price_s
                and len(self.programs) < self.max_programs)

    def _buy_if_it_pays(self, best: dict, new: dict, demand: dict,
                        steps_left: int | None) -> tuple[dict, bool]:
        """``new`` compiled, if what it saves against ``best`` at this step's rate over the
        steps left pays for its compile; else ``best``."""
        saving_s = self.seconds(self._cost(best, demand) - self._cost(new, demand))
        if saving_s <= 0 or (steps_left is not None
                             and saving_s * steps_left < self.compile_price_s):
            return best, False  # nothing to gain, or too late in the run to pay for itself
        return self._compile(new)

    def padding(self, rungs: dict, needed: dict) -> int:
        """Bytes one rank sends at ``rungs`` beyond this step's ideal rungs for ``needed`` (as
        :meth:`choose` takes it): what running a compiled program instead of a step's own
        costs on the wire (escape sections sized for more, fallbacks on overflow)."""
        demand = self.demand(needed)
        return self._cost(rungs, demand) - self._cost(self._best([demand]), demand)

    def overflows(self, rungs: dict, needed: dict) -> tuple[int, int]:
        """Of the tensor-layers ``needed`` (as :meth:`choose` takes it) asks for, those above
        their fixed rung at ``rungs`` (a plain one does not overflow), and of those the ones
        still sent as words, at one of their overflow rungs (``wire.overflow_rungs``)."""
        over = words = 0
        if self.holds:  # a program that runs holds its demand
            return over, words
        for key, count in self.demand(needed).items():
            rung = rungs[key]
            if rung != PLAIN_RUNG:
                over += int(count[rung + 1:].sum())
            words += int(count[list(self.wires[key].overflow_rungs(rung, self.exits_of(key)))]
                         .sum())
        return over, words

    def cheapest(self, programs, needed: dict) -> dict:
        """Of ``programs`` (rung vectors, as :func:`program_key` names them), the rungs that
        send the fewest bytes for ``needed`` (as :meth:`choose` takes it)."""
        return self._cheapest(programs, self.demand(needed))

    def demand(self, needed: dict) -> dict:
        """``needed`` (per key an int, or an array of one needed rung per layer) as every
        price here reads it: per key, how many layers need each rung (the last count: above
        the top or unprimed). A step's price is then a table's row times these counts."""
        return {k: self.layer_counts(k, needed[k]) for k in sorted(self.wires)}

    def layer_counts(self, key, need) -> np.ndarray:
        """How many of ``need``'s layers (an int or an array) need each rung of ``key``'s
        wire, ``wire.rungs`` (above the top or unprimed) last."""
        need = np.ravel(np.asarray(need)).astype(np.int64)
        top = self.wires[key].rungs
        if need.size and not 0 <= need.min() <= need.max() <= top:
            raise ValueError(f"needed rungs of {key!r} must be in 0..{top} ({top}: above the "
                             f"top or unprimed), got {sorted(set(need.tolist()))}")
        return np.bincount(need, minlength=top + 1)

    def _cheapest(self, programs, demand: dict) -> dict:
        if self.holds:  # only a program holding the demand may run; plain ones always do
            programs = [v for v in programs if self._holding(dict(v), demand)]
            if not programs:
                return self._plain()
        return dict(min(programs, key=lambda v: self._cost(dict(v), demand)))

    def _holding(self, rungs: dict, demand: dict) -> bool:
        """Whether every layer of every key fits its rung at ``rungs`` (a plain rung holds
        anything)."""
        return all(rungs[k] == PLAIN_RUNG or not count[rungs[k] + 1:].any()
                   for k, count in demand.items())

    def _plain(self) -> dict:
        return {k: PLAIN_RUNG for k in self.wires}

    def _only_plain(self) -> bool:
        return all(r == PLAIN_RUNG for v in self.programs for _, r in v)

    def _raised(self, rungs: dict) -> dict:
        """``rungs`` with each compressed key at least at the first program's rung and
        ``exits`` rungs above its own (the top at most): headroom for a demand still rising
        (warm-up), which a program without it would not hold, as overflow rungs would."""
        return {k: r if r == PLAIN_RUNG else min(max(r + self.exits_of(k), self.first[k]),
                                                 self.wires[k].rungs - 1)
                for k, r in rungs.items()}

    def _compile(self, rungs: dict) -> tuple[dict, bool]:
        self.programs.append(program_key(rungs))
        self._regret_s = 0.0
        return rungs, True

    def exits_of(self, key) -> int:
        """The overflow rungs ``key``'s programs compile."""
        return self.exits.get(key, 0) if isinstance(self.exits, dict) else self.exits

    def seconds(self, nbytes: float) -> float:
        return nbytes * self.seconds_per_byte

    def cost(self, rungs: dict, needed: dict) -> int:
        """Bytes one rank sends for every layer of every tensor at ``rungs``."""
        return sum(self.tensor_bytes(k, rungs[k], needed[k]) for k in needed)

    def _cost(self, rungs: dict, demand: dict) -> int:
        return sum(self._bytes(k, rungs[k], count) for k, count in demand.items())

    def plain_cost(self, needed: dict) -> int:
        return sum(self.wires[k].plain_bytes * np.size(needed[k]) for k in needed)

    def tensor_bytes(self, key, rung: int, need) -> int:
        """Bytes one rank sends for every layer of tensor ``key`` at ``rung``, each layer's
        demand ``need`` (a fallback's where it does not fit)."""
        return self._bytes(key, rung, self.layer_counts(key, need))

    def _bytes(self, key, rung: int, count: np.ndarray) -> int:
        if not PLAIN_RUNG <= rung < self.wires[key].rungs:
            raise ValueError(f"rung {rung} is outside 0..{self.wires[key].rungs - 1} "
                             "(or PLAIN_RUNG)")
        return int(self._tables[key][rung + 1] @ count)

    def best_for(self, steps: list) -> dict:
        """Per key, the rung (or PLAIN_RUNG) that sends the fewest bytes over ``steps`` (each a
        ``needed`` dict as :meth:`choose` takes it): one step's ideal, or a window's program.
        Of rungs sending as much, the one overflowing least: an overflow rung's escapes send
        what its own rung would, but in the fallback's conditional, where they cannot overlap
        compute."""
        return self._best([self.demand(s) for s in steps])

    def _best(self, demands: list) -> dict:
        out = {}
        for key, table in self._tables.items():
            count = sum((d[key] for d in demands), np.zeros(table.shape[1], np.int64))
            sent = table @ count  # per option: PLAIN_RUNG, then each rung
            above = np.cumsum(count[::-1])[::-1]  # above[n]: layers needing rung n or more
            over = (0, *above[1:].tolist())  # a fixed rung r overflows those needing > r
            options = range(len(sent))
            if self.holds:  # plain, or a rung holding every layer of every step
                options = [0] + [i for i in options[1:] if not over[i]]
            rung = min(options, key=lambda i: (int(sent[i]), over[i], i - 1))
            out[key] = rung - 1
        return out


def bytes_table(wire, exits: int) -> np.ndarray:
    """``[rung + 1, need]``: bytes one rank sends for one layer of ``wire`` with its rung fixed
    at each rung (row 0: :data:`PLAIN_RUNG`) when the layer needs each rung (the last column:
    above the top or unprimed), ``exits`` overflow rungs compiled (``wire.bytes_at``)."""
    return np.array([[wire.bytes_at(rung, need, exits) for need in range(wire.rungs + 1)]
                     for rung in (PLAIN_RUNG, *range(wire.rungs))], dtype=np.int64)


def exits_for(wires: dict, layers: dict, exits: int, share: float = EXIT_SHARE) -> dict:
    """``{key: overflow rungs}``: ``exits`` for every word unit of ``wires`` (one layer's,
    sent ``layers[key]`` times a step) carrying at least ``share`` of the word bytes a step
    sends, none for the rest (:data:`EXIT_SHARE`: where the bytes an exit saves pay for its
    compile)."""
    if exits < 0:
        raise ValueError(f"exits must be >= 0, got {exits}")
    if not 0 <= share <= 1:
        raise ValueError(f"share must be in [0, 1], got {share}")
    sent = {k: w.plain_bytes * layers.get(k, 1) for k, w in wires.items()
            if isinstance(w, WordWire)}
    total = sum(sent.values())
    return {k: exits if b >= share * total else 0 for k, b in sorted(sent.items())}


def seconds_per_byte(link, n_ranks: int) -> float:
    """What one more byte in every rank's shard costs an all-gather on ``link`` (a cost-model
    Profile or Topology) over ``n_ranks``: the bandwidth term of its gather time."""
    probe = float(1 << 20)
    return (costmodel.gather_time(probe * n_ranks, n_ranks, link)
            - costmodel.gather_time(0.0, n_ranks, link)) / probe


def rungs_holding(wires: dict, escapes: float = STEADY_ESCAPES,
                  exponents: float = STEADY_EXPONENTS) -> dict:
    """``{key: rung}``: the smallest rung of each wire that holds the given share of its
    elements (word mode: escapes, with raw words at the level-2 share; exponent mode: changed
    exponents); the top rung where none does."""
    out = {}
    for key, wire in wires.items():
        if isinstance(wire, WordWire):
            rung = rung_for(wire.caps1, math.ceil(wire.n * escapes))
        else:
            rung = rung_for(wire.caps, math.ceil(wire.n * exponents))
        out[key] = wire.rungs - 1 if rung is None else rung
    return out


def program_key(rungs: dict) -> Rungs:
    """A rung vector as one hashable key (what names a compiled program)."""
    return tuple(sorted(rungs.items()))

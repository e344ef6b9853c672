"""The host's rung policy (``ciera_jax.loop.rungs``): which programs a run compiles, and which of
them each step runs, from the demands the previous step agreed on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_jax.codec.wire import PLAIN_RUNG, ExponentWire, WordWire
from ciera_jax.loop.rungs import (EXIT_SHARE, RungPolicy, exits_for, rungs_holding,
                                  seconds_per_byte)
from ciera_jax.planning.links import Profile

WIRES = {"experts": WordWire(1 << 16, 2), "attn": ExponentWire(1 << 14, 2)}
LAYERS = 4


def needs(word: int, exponent: int) -> dict:
    """Every layer needing the same rungs (``wire.rungs``: above the top / unprimed)."""
    return {"experts": np.full(LAYERS, word), "attn": np.full(LAYERS, exponent)}


PRIMING = needs(WIRES["experts"].rungs, WIRES["attn"].rungs)
SLOW = 1e-5  # seconds per byte of a 100 kB/s link: a few steps lose a compile's seconds
STEADY = {"experts": 5, "attn": 2}


def policy_at(**kw) -> RungPolicy:
    """A policy whose first program runs the steady rungs, one 2-second compile measured."""
    policy = RungPolicy(WIRES, kw.pop("seconds_per_byte", SLOW), first=dict(STEADY), **kw)
    policy.choose(PRIMING)
    policy.compiled(2.0)
    return policy


def test_the_first_step_compiles_the_steady_program_and_primes_through_its_fallback():
    policy = RungPolicy(WIRES, SLOW)
    rungs, new = policy.choose(PRIMING)
    assert new and rungs == rungs_holding(WIRES) and PLAIN_RUNG not in rungs.values()
    # fresh caches: every tensor-layer takes the fallback (plain's bytes and a check)
    assert policy.cost(rungs, PRIMING) == sum(
        LAYERS * w.fallback_bytes for w in WIRES.values()) >= policy.plain_cost(PRIMING)


def test_a_lasting_demand_buys_its_program_once_the_lost_wire_time_passes_a_compile():
    policy = policy_at(patience=1.0)
    low = needs(3, 2)
    ideal = {"experts": 3, "attn": 2}
    lost_s = (policy.cost(STEADY, low) - policy.cost(ideal, low)) * SLOW
    assert lost_s > 0
    steps_to_buy = int(2.0 // lost_s) + 1
    got = [policy.choose(low) for _ in range(steps_to_buy + 3)]
    new_at = [i for i, (_, new) in enumerate(got) if new]
    assert new_at == [steps_to_buy - 1], new_at  # rent until the loss passes one compile
    assert got[new_at[0]][0] == ideal
    assert all(r == ideal for r, _ in got[new_at[0]:])
    assert len(policy.programs) == 2


def test_a_new_run_starts_without_the_last_runs_losses():
    low = needs(3, 2)
    policy = policy_at(patience=1.0)
    steps = [policy.choose(low)[1] for _ in range(50)].index(True)
    again = policy_at(patience=1.0)
    for _ in range(steps):  # one step short of buying
        assert not again.choose(low)[1]
    again.start_run()
    assert not again.choose(low)[1]  # the next run's first step buys nothing
    assert len(again.programs) == 1


def test_a_slower_compile_or_a_faster_link_waits_longer():
    low = needs(3, 2)

    def bought_at(seconds_per_byte, compile_s):
        policy = RungPolicy(WIRES, seconds_per_byte, first=dict(STEADY))
        policy.choose(PRIMING)
        policy.compiled(compile_s)
        return next(i for i in range(1000) if policy.choose(low)[1])

    base = bought_at(SLOW, 2.0)
    assert bought_at(SLOW, 4.0) > base and bought_at(SLOW / 2, 2.0) > base
    assert bought_at(SLOW * 4, 2.0) < base


def test_a_one_step_spike_falls_back_instead_of_compiling():
    policy = policy_at(patience=2.0)
    for _ in range(5):
        policy.choose(needs(5, 2))
    programs = list(policy.programs)
    spike = needs(9, 2)
    rungs, new = policy.choose(spike)
    assert not new and policy.programs == programs
    assert rungs == STEADY
    # what the step sends: the word tensor's layers take the fallback (plain's bytes + check)
    wire = WIRES["experts"]
    assert policy.tensor_bytes("experts", 5, spike["experts"]) == LAYERS * wire.fallback_bytes


def test_no_program_is_bought_too_late_in_the_run_to_pay_for_itself():
    low = needs(3, 2)
    late, early = policy_at(patience=0.5), policy_at(patience=0.5)
    for _ in range(50):
        late.choose(low, steps_left=1)  # every step the last: saving one step never pays
        early.choose(low, steps_left=10**6)
    assert len(late.programs) == 1 and len(early.programs) == 2


def test_a_link_that_costs_nothing_never_buys_a_second_program():
    policy = policy_at(seconds_per_byte=0.0, patience=0.0)
    for w in range(WIRES["experts"].rungs):
        policy.choose(needs(w, 0))
    assert len(policy.programs) == 1


def test_never_more_programs_than_allowed_and_always_a_compiled_one():
    policy = RungPolicy(WIRES, SLOW, max_programs=3, patience=0.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        step = needs(int(rng.integers(0, WIRES["experts"].rungs + 1)),
                     int(rng.integers(0, WIRES["attn"].rungs + 1)))
        rungs, _ = policy.choose(step)
        assert tuple(sorted(rungs.items())) in policy.programs
    assert len(policy.programs) == 3


def test_the_same_demands_give_the_same_programs_on_every_process():
    rng = np.random.default_rng(1)
    seq = [PRIMING] + [needs(int(w), int(e)) for w, e in zip(rng.integers(0, 12, 40),
                                                             rng.integers(0, 11, 40))]
    a, b = RungPolicy(WIRES, SLOW, patience=0.1), RungPolicy(WIRES, SLOW, patience=0.1)
    for policy in (a, b):
        policy.compiled(1e-4)
    assert [a.choose(s) for s in seq] == [b.choose(s) for s in seq]
    assert len(a.programs) > 1


def test_per_layer_demands_are_priced_layer_by_layer():
    policy = RungPolicy(WIRES, SLOW)
    mixed = {"experts": np.array([1, 1, 1, WIRES["experts"].rungs]), "attn": np.zeros(LAYERS)}
    wire = WIRES["experts"]
    assert policy.tensor_bytes("experts", 1, mixed["experts"]) == (
        3 * (wire.main_bytes + wire.section_bytes(1)) + wire.fallback_bytes)
    assert policy.best_for([mixed])["attn"] == 0


def test_padding_is_what_the_program_sends_beyond_the_steps_ideal_rungs():
    """A section sized above the demand pads by the difference of the two sections; a demand
    above the program's rung pads by its fallback's plain bytes less the ideal's."""
    policy = RungPolicy(WIRES, SLOW)
    word, exp = WIRES["experts"], WIRES["attn"]
    assert policy.padding(STEADY, needs(5, 2)) == 0
    assert policy.padding(STEADY, needs(3, 2)) == LAYERS * (word.section_bytes(5)
                                                           - word.section_bytes(3))
    over = needs(5, 4)  # every attn layer above its rung 2: plain bytes, not rung 4's
    assert policy.padding(STEADY, over) == LAYERS * (exp.fallback_bytes - exp.main_bytes
                                                     - exp.section_bytes(4)) > 0


def test_rungs_holding_the_steady_state_shares():
    rungs = rungs_holding(WIRES, escapes=1 / 8, exponents=1 / 512)
    word, exp = WIRES["experts"], WIRES["attn"]
    assert word.caps1[rungs["experts"]] >= word.n // 8 > word.caps1[rungs["experts"] - 1]
    assert exp.caps[rungs["attn"]] >= exp.n // 512 > exp.caps[rungs["attn"] - 1]
    assert rungs_holding(WIRES, escapes=2.0)["experts"] == word.rungs - 1  # none does: the top


@pytest.mark.parametrize("kw,msg", [(dict(max_programs=0), "max_programs"),
                                    (dict(patience=-1), "patience"),
                                    (dict(window=0), "window"),
                                    (dict(seconds_per_byte=-1.0), "seconds_per_byte"),
                                    (dict(first={"experts": 1}), "first program")])
def test_bad_options_are_clear_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RungPolicy(WIRES, **{"seconds_per_byte": SLOW, **kw})


def test_seconds_per_byte_is_the_rings_bandwidth_term():
    link = Profile.load("cpu-emulated")
    for n in (2, 8, 16):  # a ring: each rank receives the other n - 1 shards
        assert seconds_per_byte(link, n) == pytest.approx((n - 1) / link.beta_Bps)


def test_bytes_at_refuses_a_rung_off_the_ladder():
    with pytest.raises(ValueError, match="outside 0.."):
        WIRES["attn"].bytes_at(WIRES["attn"].rungs, 0)


def test_overflow_rungs_price_an_overflow_at_its_own_rung_and_never_win_a_tie():
    """With 3 overflow rungs a word tensor up to 3 rungs above its program's rung sends what
    its own rung would; further above, and any exponent tensor above its rung, plain's bytes.
    Of rungs sending as much, the policy keeps the one holding the demand (an overflow's
    escapes travel in the fallback's conditional, where they cannot overlap compute)."""
    policy = RungPolicy(WIRES, SLOW, first=dict(STEADY), exits=3)
    word, exp = WIRES["experts"], WIRES["attn"]
    for need in (6, 7, 8):
        assert policy.tensor_bytes("experts", 5, np.full(LAYERS, need)) == LAYERS * (
            word.main_bytes + word.section_bytes(need))
    assert policy.tensor_bytes("experts", 5, np.full(LAYERS, 9)) == LAYERS * word.fallback_bytes
    assert policy.tensor_bytes("attn", 2, np.full(LAYERS, 3)) == LAYERS * exp.fallback_bytes
    assert policy.best_for([needs(7, 2)]) == {"experts": 7, "attn": 2}
    assert policy.padding(STEADY, needs(7, 2)) == 0  # the program's overflow sends the ideal
    with pytest.raises(ValueError, match="exits must be >= 0"):
        RungPolicy(WIRES, SLOW, exits=-1)
    with pytest.raises(ValueError, match="exits must be >= 0"):
        RungPolicy(WIRES, SLOW, exits={"experts": -1})


def test_overflow_rungs_go_to_the_units_carrying_the_word_bytes():
    """An exit costs every unit the same compile and saves bytes in proportion to the unit:
    the word units carrying at least EXIT_SHARE of a step's word bytes (a layer's bytes times
    the layers) compile them, the rest overflow plainly, and the policy prices each so."""
    wires = {**WIRES, "embed": WordWire(1 << 10, 2)}
    layers = {"experts": LAYERS, "attn": LAYERS, "embed": 1}
    exits = exits_for(wires, layers, 3)
    assert exits == {"experts": 3, "embed": 0}  # 1/257 of the word bytes; attn: exponent
    assert exits_for(wires, layers, 3, share=0) == {"experts": 3, "embed": 3}
    assert exits_for(wires, layers, 0) == {"experts": 0, "embed": 0}
    share = wires["embed"].plain_bytes / (wires["embed"].plain_bytes
                                          + LAYERS * wires["experts"].plain_bytes)
    assert exits_for(wires, layers, 3, share=share)["embed"] == 3  # at the share: in
    assert share < EXIT_SHARE
    policy = RungPolicy(wires, SLOW, first={**STEADY, "embed": 5}, exits=exits)
    assert [policy.exits_of(k) for k in ("experts", "attn", "embed")] == [3, 0, 0]
    word, small = wires["experts"], wires["embed"]
    assert policy.tensor_bytes("experts", 5, np.full(LAYERS, 7)) == LAYERS * (
        word.main_bytes + word.section_bytes(7))
    assert policy.tensor_bytes("embed", 5, np.array([6])) == small.fallback_bytes
    for bad in ({"exits": -1}, {"exits": 1, "share": 1.5}):
        with pytest.raises(ValueError, match="must be"):
            exits_for(wires, layers, **bad)


def test_fix_rungs_takes_each_units_exits():
    import jax.numpy as jnp

    from ciera_jax import fsdp

    agreed = {"a": jnp.int32(5), "b": jnp.int32(7)}
    fixed = fsdp.fix_rungs(agreed, {"a": 1, "b": 2}, exits={"a": 3})
    assert (fixed["a"].rung, fixed["a"].exits, fixed["b"].rung, fixed["b"].exits) == (1, 3, 2, 0)
    assert fsdp.fix_rungs(agreed, {"a": 1, "b": 2}, exits=2)["b"].exits == 2


def _layer_needs(wire):
    return st.lists(st.integers(0, wire.rungs), min_size=1, max_size=6).map(np.array)


@settings(max_examples=60, deadline=None)
@given(word=_layer_needs(WIRES["experts"]), exponent=_layer_needs(WIRES["attn"]),
       word_rung=st.integers(PLAIN_RUNG, WIRES["experts"].rungs - 1),
       exponent_rung=st.integers(PLAIN_RUNG, WIRES["attn"].rungs - 1),
       exits=st.integers(0, 4))
def test_the_policys_prices_are_the_wires_layer_by_layer(word, exponent, word_rung,
                                                         exponent_rung, exits):
    """The policy prices a step from each wire's table of bytes (a row per rung, a column per
    demand) times how many layers need each rung: the same bytes, choices and overflows as
    asking the wire of every layer."""
    policy = RungPolicy(WIRES, SLOW, exits={"experts": exits})
    needed = {"experts": word, "attn": exponent}
    rungs = {"experts": word_rung, "attn": exponent_rung}
    layer_exits = {"experts": exits, "attn": 0}

    def sent(key, rung, need):
        return sum(WIRES[key].bytes_at(rung, int(n), layer_exits[key]) for n in need)

    for key, need in needed.items():
        assert policy.tensor_bytes(key, rungs[key], need) == sent(key, rungs[key], need)
    for key, need in needed.items():  # the fewest bytes, then the fewest overflows, then lowest
        options = (PLAIN_RUNG, *range(WIRES[key].rungs))
        best = min(options, key=lambda r: (sent(key, r, need),
                                           0 if r == PLAIN_RUNG else int(np.sum(need > r)), r))
        assert policy.best_for([needed])[key] == best
    assert policy.padding(rungs, needed) == (
        sum(sent(k, rungs[k], n) for k, n in needed.items())
        - sum(sent(k, r, needed[k]) for k, r in policy.best_for([needed]).items()))
    over = sum(int(np.sum(n > rungs[k])) for k, n in needed.items() if rungs[k] != PLAIN_RUNG)
    words = sum(int(np.sum(np.isin(n, WIRES[k].overflow_rungs(rungs[k], layer_exits[k]))))
                for k, n in needed.items())
    assert policy.overflows(rungs, needed) == (over, words)
    assert policy.best_for([]) == {k: PLAIN_RUNG for k in WIRES}  # no demand seen: plain


def test_a_demand_or_rung_off_the_ladder_is_refused():
    policy = RungPolicy(WIRES, SLOW)
    top = WIRES["experts"].rungs
    with pytest.raises(ValueError, match="needed rungs of 'experts' must be in 0.."):
        policy.tensor_bytes("experts", 0, np.array([top + 1]))
    with pytest.raises(ValueError, match="needed rungs"):
        policy.choose(needs(-1, 0))
    with pytest.raises(ValueError, match="outside"):
        policy.tensor_bytes("experts", top, np.array([0]))
    with pytest.raises(ValueError, match="outside"):
        policy.tensor_bytes("experts", PLAIN_RUNG - 1, np.array([0]))


def _holds(rungs: dict, need: dict) -> bool:
    return all(r == PLAIN_RUNG or int(np.max(need[k])) <= r for k, r in rungs.items())


def test_a_holding_policy_primes_first_and_only_ever_runs_programs_holding_the_demand():
    """``holds``: the first program gathers everything plainly (fresh caches); the first step
    whose demand is known buys a compressed program with headroom; no step ever runs a
    program some layer's demand is above (its gathers compile no fallback); a demand no
    compressed program holds buys one (up to ``max_programs``), and past that runs the
    plain-rung program."""
    policy = RungPolicy(WIRES, SLOW, first=dict(STEADY), holds=True, exits={"experts": 3},
                        max_programs=4)
    rungs, new = policy.choose(PRIMING)
    assert new and set(rungs.values()) == {PLAIN_RUNG}
    rungs, new = policy.choose(needs(1, 1))
    assert new and rungs == {"experts": STEADY["experts"], "attn": STEADY["attn"]}
    rungs, new = policy.choose(needs(6, 1))  # above: headroom of 3 rungs over the need
    assert new and rungs["experts"] == 9 and _holds(rungs, needs(6, 1))
    rng = np.random.default_rng(3)
    top = {k: w.rungs for k, w in WIRES.items()}
    for _ in range(200):
        need = {k: rng.integers(0, top[k] + 1, size=LAYERS) for k in WIRES}
        rungs, _ = policy.choose(need, steps_left=100)
        assert _holds(rungs, need), (rungs, need)
        assert policy.overflows(rungs, need) == (0, 0)
        assert rungs in [dict(p) for p in policy.programs] or set(rungs.values()) == {
            PLAIN_RUNG}
    assert len(policy.programs) == 4


def test_a_falling_demand_moves_a_holding_policy_down_to_lower_rungs():
    """``holds``: the warm-up's demand buys a high program; as the demand falls, the wire
    time that program loses against the window's buys a lower one (and reuses the compiled
    ones that hold it), every step's program holding that step's demand."""
    policy = RungPolicy(WIRES, SLOW, first=dict(STEADY), holds=True, patience=0.5)
    policy.choose(PRIMING)
    policy.compiled(2.0)
    trace = [needs(10, 3)] * 5 + [needs(w, 1) for w in range(10, 2, -1) for _ in range(40)]
    ran = []
    for step, need in enumerate(trace):
        rungs, new = policy.choose(need, steps_left=len(trace) - step)
        if new:
            policy.compiled(2.0)
        assert _holds(rungs, need), (step, rungs, need)
        ran.append(rungs)
    peak = ran[4]["experts"]
    assert peak >= 10 and ran[-1]["experts"] < peak
    assert policy.cost(ran[-1], trace[-1]) < policy.cost(ran[4], trace[-1])
    assert len(policy.programs) <= policy.max_programs
    # a demand that stays put buys nothing more
    bought = len(policy.programs)
    for _ in range(50):
        policy.choose(trace[-1], steps_left=1000)
    assert len(policy.programs) == bought

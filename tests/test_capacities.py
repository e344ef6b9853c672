"""The host's rung policy (``planning.capacities``): which programs a run compiles, and which of
them each step runs, from the demands the previous step agreed on."""

from __future__ import annotations

import numpy as np
import pytest

from ciera_jax.codec.wire import PLAIN_RUNG, ExponentWire, WordWire
from ciera_jax.planning.capacities import RungPolicy, rungs_holding

WIRES = {"experts": WordWire(1 << 16, 2), "attn": ExponentWire(1 << 14, 2)}
LAYERS = 4


def needs(word: int, exponent: int) -> dict:
    """Every layer needing the same rungs (``wire.rungs``: above the top / unprimed)."""
    return {"experts": np.full(LAYERS, word), "attn": np.full(LAYERS, exponent)}


PRIMING = needs(WIRES["experts"].rungs, WIRES["attn"].rungs)


def test_a_priming_step_runs_a_program_of_plain_gathers():
    policy = RungPolicy(WIRES)
    rungs, new = policy.choose(PRIMING)
    assert new and rungs == {"experts": PLAIN_RUNG, "attn": PLAIN_RUNG}
    assert policy.cost(rungs, PRIMING) == policy.plain_cost(PRIMING)


def test_a_lasting_demand_buys_its_program_once_a_steps_worth_of_bytes_was_lost():
    policy = RungPolicy(WIRES, patience=1.0)
    policy.choose(PRIMING)
    steady = needs(5, 2)
    ideal_gap = policy.plain_cost(steady) - policy.cost({"experts": 5, "attn": 2}, steady)
    steps_to_buy = int(policy.plain_cost(steady) // ideal_gap) + 1
    got = [policy.choose(steady) for _ in range(steps_to_buy + 3)]
    new_at = [i for i, (_, new) in enumerate(got) if new]
    assert new_at == [steps_to_buy - 1], new_at  # rent until the loss passes one plain step
    assert got[new_at[0]][0] == {"experts": 5, "attn": 2}
    assert all(r == {"experts": 5, "attn": 2} for r, _ in got[new_at[0]:])
    assert len(policy.programs) == 2


def test_a_one_step_spike_falls_back_instead_of_compiling():
    policy = RungPolicy(WIRES, patience=1.0)
    policy.choose(PRIMING)
    for _ in range(5):
        policy.choose(needs(5, 2))
    programs = list(policy.programs)
    spike = needs(9, 2)
    rungs, new = policy.choose(spike)
    assert not new and policy.programs == programs
    assert rungs == {"experts": 5, "attn": 2} or rungs["experts"] == PLAIN_RUNG
    # what the step sends: the word tensor's layers take the fallback (plain's bytes + check)
    wire = WIRES["experts"]
    assert policy._bytes("experts", 5, spike["experts"]) == LAYERS * wire.fallback_bytes


def test_no_program_is_bought_too_late_in_the_run_to_pay_for_itself():
    steady = needs(5, 2)
    late, early = RungPolicy(WIRES), RungPolicy(WIRES)
    for policy in (late, early):
        policy.choose(PRIMING)
    for _ in range(10):
        late.choose(steady, steps_left=1)  # every step the last: saving one step never pays
        early.choose(steady, steps_left=1000)
    assert len(late.programs) == 1 and len(early.programs) == 2


def test_never_more_programs_than_allowed_and_always_a_compiled_one():
    policy = RungPolicy(WIRES, max_programs=3, patience=0.0)
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
    a, b = RungPolicy(WIRES), RungPolicy(WIRES)
    assert [a.choose(s) for s in seq] == [b.choose(s) for s in seq]


def test_per_layer_demands_are_priced_layer_by_layer():
    policy = RungPolicy(WIRES)
    mixed = {"experts": np.array([1, 1, 1, WIRES["experts"].rungs]), "attn": np.zeros(LAYERS)}
    wire = WIRES["experts"]
    assert policy._bytes("experts", 1, mixed["experts"]) == (
        3 * (wire.main_bytes + wire.section_bytes(1)) + wire.fallback_bytes)
    assert policy._best_for([mixed])["attn"] == 0


def test_rungs_holding_the_steady_state_shares():
    rungs = rungs_holding(WIRES, escapes=1 / 8, exponents=1 / 512)
    word, exp = WIRES["experts"], WIRES["attn"]
    assert word.caps1[rungs["experts"]] >= word.n // 8 > word.caps1[rungs["experts"] - 1]
    assert exp.caps[rungs["attn"]] >= exp.n // 512 > exp.caps[rungs["attn"] - 1]
    assert rungs_holding(WIRES, escapes=2.0)["experts"] == word.rungs - 1  # none does: the top


@pytest.mark.parametrize("kw,msg", [(dict(max_programs=0), "max_programs"),
                                    (dict(patience=-1), "patience"),
                                    (dict(window=0), "window")])
def test_bad_options_are_clear_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RungPolicy(WIRES, **kw)


def test_fixed_bytes_refuses_a_rung_off_the_ladder():
    with pytest.raises(ValueError, match="outside 0.."):
        WIRES["attn"].bytes_at(WIRES["attn"].rungs, 0)

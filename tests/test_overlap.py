"""The train step's schedule, checked on its jaxpr (the steady program: rungs fixed): one
agreement per step (the next step's, in the encode program after it; none in the step), the
next layer's gather independent of the current layer's compute (prefetch), and the Encoded
the encode program hands the next step equal to a fresh encode.

All on the trainer test_train compiles (``build_trainer`` is memoized in-process).
"""

import jax
import numpy as np
import pytest
from jax.extend import core as jcore

from jaxprs import outside, subjaxprs, walk

from ciera_jax.fsdp import buckets
from ciera_jax.fsdp.state.stats import VECTOR_KEYS
from ciera_models.train import data
from ciera_models.train.step import all_words
from ciera_models.train import TrainConfig, build_trainer, make_mesh
from conftest import TINY_PROGRAMS

# test_train's config: a shared trainer
TC = TrainConfig(config="tiny", schedule_steps=20, **TINY_PROGRAMS)


GATHERS = {"all_gather", "all_gather_invariant"}  # word mode's planes: the invariant one


def _has(jaxpr, names) -> bool:
    return any(e.primitive.name in names for e in walk(jaxpr))


def _deps(jaxpr, in_deps):
    """Labels each var depends on; returns (out deps, [deps of every all_gather inside])."""
    env = {v: d for v, d in zip(jaxpr.invars, in_deps)}
    gathers = []

    def get(v):
        return set() if isinstance(v, jcore.Literal) else env.get(v, set())

    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        every = set().union(*ins) if ins else set()
        if eqn.primitive.name in GATHERS:
            gathers.append(every)
        subs = subjaxprs(eqn)
        outs = None
        if subs:
            offset = len(eqn.invars) - len(subs[0].invars)
            if offset >= 0 and all(len(s.invars) == len(subs[0].invars) for s in subs):
                extra = set().union(*ins[:offset]) if offset else set()
                outs = [set() for _ in eqn.outvars]
                for s in subs:
                    o, g = _deps(s, [d | extra for d in ins[offset:]])
                    gathers += g
                    if len(o) == len(outs):
                        outs = [a | b for a, b in zip(outs, o)]
                    else:
                        outs = None
                        break
            if outs is None:  # unknown calling convention: every output depends on everything
                outs = [every for _ in eqn.outvars]
                if any(_has(s, GATHERS) for s in subs):
                    gathers.append(every)
        else:
            outs = [every for _ in eqn.outvars]
        for v, d in zip(eqn.outvars, outs):
            env[v] = d
    return [get(v) for v in jaxpr.outvars], gathers


def _step_jaxpr(tc, rungs="steady"):
    """The step the trainer runs at ``rungs`` (``Trainer.at_rungs``: the steady program)."""
    tr = build_trainer(tc, make_mesh(8))
    state = tr.prepare(tr.init_state(0))
    batch = tr.batch(data.load_dataset(None, 256, tc.length), 0, 0)
    return jax.make_jaxpr(tr.step_fn)(*tr.at_rungs(
        (state.params, state.caches, state.opt_state, state.ahead, batch), rungs)).jaxpr


@pytest.fixture(scope="module")
def step_jaxpr():
    return _step_jaxpr(TC)


def test_one_agreement_per_step(step_jaxpr):
    """The step program agrees on nothing; the encode program after it (``prepare_fn``)
    agrees ONCE, over every layer of every compressed tensor, outside its per-layer loops."""
    assert not [e for e in walk(step_jaxpr) if e.primitive.name == "pmax"]
    assert "pmax" not in str(step_jaxpr)  # make_jaxpr's text includes the nested bodies too
    tr = build_trainer(TC, make_mesh(8))
    state = tr.init_state(0)
    encode = jax.make_jaxpr(tr.prepare_fn)(state.params, state.caches,
                                           all_words(tr.tensors)).jaxpr
    pmax = [e for e in walk(encode) if e.primitive.name == "pmax"]
    assert len(pmax) == 1, [str(e) for e in pmax]
    shapes = jax.eval_shape(tr.prepare_fn, state.params, state.caches, all_words(tr.tensors))
    demands = sum(buckets.unwrap(e).demand.size // 8  # 8 ranks
                  for e in shapes["encoded"].values())
    assert demands > 0 and pmax[0].invars[0].aval.shape == (demands,)
    for e in walk(encode):  # not inside a stack's per-layer encode (once per layer)
        if e.primitive.name == "scan":
            assert not _has(e.params["jaxpr"].jaxpr, {"pmax"})


def _consts_and_carry(scan_params) -> tuple[int, int]:
    """How many of a scan's inputs are constants and how many carry: JAX 0.10's ``num_consts``
    and ``num_carry``, or JAX 0.11's flat trees (``ft_in``: constants, carry, scanned; a carry
    passed through unchanged is moved to the constants there)."""
    if "num_consts" in scan_params:
        return scan_params["num_consts"], scan_params["num_carry"]
    consts, carry, _ = scan_params["ft_in"].elts
    return len(list(consts.vals)), len(list(carry.vals))


def test_next_layer_gather_does_not_wait_for_this_layer(step_jaxpr):
    scans = [e for e in walk(step_jaxpr) if e.primitive.name == "scan"
             and _has(e.params["jaxpr"].jaxpr, GATHERS)
             and _has(e.params["jaxpr"].jaxpr, {"ragged_dot_general", "ragged_dot"})]
    assert scans, "no layer scan with gathers and expert matmuls"
    checked = 0
    for e in scans:
        body = e.params["jaxpr"].jaxpr
        nc, nk = _consts_and_carry(e.params)
        # the activation carry: float32 (batch, seq, d_model); gathered weights travel as bf16
        acts = {i for i in range(nc, nc + nk)
                if body.invars[i].aval.dtype == np.float32 and body.invars[i].aval.ndim == 3}
        assert acts
        outs, gathers = _deps(body, [{i} for i in range(len(body.invars))])
        assert gathers
        for g in gathers:
            assert not (g & acts), "a gather in the layer scan depends on the activations"
        # sanity: the compute does depend on them (the carry was identified right)
        assert any(o & acts for o in outs[:nk])
        checked += 1
    assert checked >= 1


def test_layer_scan_stacks_one_stats_vector_per_layer(step_jaxpr):
    """The gathers' stats leave the layer scan as ONE int32 vector per layer (every key's
    stats but ``changed``) and one ``changed`` per key, not one output per stat per key: on a
    GPU every output of the loop is a kernel per layer (7 stats x 8 keys were 56)."""
    columns = len(VECTOR_KEYS)
    scans = [e for e in walk(step_jaxpr) if e.primitive.name == "scan"
             and any(v.aval.dtype == np.int32 and v.aval.ndim == 3
                     and v.aval.shape[-1] == columns for v in e.outvars)]
    assert len(scans) == 1, "one layer scan (the forward) leaves the stats"
    outs = [v.aval for v in scans[0].outvars if v.aval.dtype == np.int32]
    vectors = [a for a in outs if a.ndim == 3 and a.shape[-1] == columns]
    assert len(vectors) == 1
    keys = vectors[0].shape[1]
    assert keys >= 8  # tiny's layer: attention, router, experts (the buckets' members apart)
    per_layer_scalars = [a for a in outs if a.shape == (scans[0].params["length"],)]
    assert len(per_layer_scalars) == keys  # each key's changed


@pytest.mark.slow  # encodes once more (a jit of prepare_fn) for this test alone; the fast lane's
# train tests check what a stale Encoded would break: every step's self-check passes
# (test_train) and the run is bitwise plain's
def test_encoded_ahead_is_a_fresh_encode_of_the_new_state():
    tr = build_trainer(TC, make_mesh(8))
    state = tr.prepare(tr.init_state(0))
    ds = data.load_dataset(None, 256, TC.length)
    for i, rungs in enumerate(("priming", "steady")):  # the programs the trainer runs
        params, caches, opt, word_changed, _ = tr.step_fn(*tr.at_rungs(
            (state.params, state.caches, state.opt_state, state.ahead, tr.batch(ds, 0, i)),
            rungs))
        ahead = tr.encode(params, caches, word_changed)  # the encode program
        state = type(state)(i + 1, params, caches, opt, ahead)
    fresh = jax.jit(tr.prepare_fn)(state.params, state.caches, state.ahead["word_changed"])
    got, want = jax.tree.leaves(state.ahead["encoded"]), jax.tree.leaves(fresh["encoded"])
    assert got and len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _gathering_switches(jaxpr) -> int:
    """Conditionals whose branches all-gather (with rungs fixed, each exchange's fallback
    alone), nested bodies included."""
    return sum(1 for e in walk(jaxpr) if e.primitive.name == "cond"
               and any(_has(b, {"all_gather", "all_gather_invariant"}) for b in subjaxprs(e)))


def test_backward_reads_the_caches_instead_of_a_compressed_gather():
    """With word_backward="cache" (the default) the backward runs no compressed gather: a
    word cache gives it the full words, an exponent cache the exponents, so only an
    unconditional all-gather of the sign + mantissa bytes travels. word_backward="regather"
    runs the compressed gather again. (Traced copies: a stack's forward traces its gathers
    twice, the first layer's before its scan; its backward once. The compiled word step's
    backward is checked to gather nothing in test_word_backward.)"""
    def step(**kw):  # no overflow rungs: their switch nests in the fallback (test_fixed_rungs)
        return _step_jaxpr(TrainConfig(**{**TC.__dict__, "plan": "all", "overflow_rungs": 0,
                                          **kw}))

    def payload_gathers(jaxpr):  # uint8 planes outside any cond: main planes and payloads
        return sum(1 for e in outside(jaxpr, "cond") if e.primitive.name == "all_gather"
                   and e.invars[0].aval.dtype == np.uint8)

    exponent, word = step(cache="exponent"), step(cache="word")
    # per exchange: the fallback alone (the rung is fixed: no switch); forward: embed, head
    # and a decoder layer's bucket (its attention, router and experts), a stack's twice
    assert _gathering_switches(exponent) == _gathering_switches(word) == 2 + 2
    # exponent mode's backward: one payload transfer each for embed, head and the layer
    regathered = step(cache="exponent", word_backward="regather")
    assert payload_gathers(exponent) == payload_gathers(regathered) + 3
    again = 2 + 2 + 3  # the backward's compressed gathers: + 1 per exchange
    assert _gathering_switches(regathered) == again
    assert _gathering_switches(step(cache="word", word_backward="regather")) == again

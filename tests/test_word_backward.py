"""Word caches gather once per step: the backward reads the cache the forward's gather left,
and the parameters stay bitwise those of a plain gather (trainer, Flax layers under nnx.jit and
the user's shard_map, nnx.remat, nnx.scan). ``tests/test_train.py`` covers the trainer's
defaults (``--cache auto --plan auto``: word caches on every tensor on CPU) and
``tests/test_train_multihost.py`` two processes.

The trainer tests use test_train's configs (its defaults, the same step as ``--plan all
--cache word`` on CPU, and its ``--cache exponent`` run), so they share its trainers and
compiled programs: the file runs in conftest's ``tiny_run`` group."""

import functools
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

from ciera_jax import fsdp
from ciera_jax.planning import memory
from ciera_jax.fsdp import buckets
from ciera_jax.loop.rungs import program_key, rungs_holding
from flax_nets import (LM, MLP, all_compressed, batches, make_mesh, same_bits, train_jit,
                       train_shard_map)
from ciera_models.train import data
from ciera_models.train.build import build_trainer
from ciera_models.train.state import bytes_per_device
from ciera_models.train import TrainConfig, train
from ciera_models.train import make_mesh as train_mesh
from test_flax_transforms import REMATS, D, F, call, compressed, fit_jit
from conftest import TINY_PROGRAMS

STEPS = 20
TINY = TrainConfig(config="tiny", schedule_steps=STEPS, **TINY_PROGRAMS)


def _tc(**kw):
    return TrainConfig(**{**TINY.__dict__, **kw})


@functools.cache
def _plain(config="tiny", steps=STEPS):
    return train(_tc(config=config, schedule_steps=steps, gather="plain"), steps=steps, seed=0,
                 mesh=train_mesh(8), log=None)


@pytest.mark.slow  # on CPU the same step as test_train's defaults (word caches on every tensor)
def test_tiny_plan_all_word_caches_bitwise_plain():
    res = train(_tc(plan="all", cache="word"), steps=STEPS, seed=0, mesh=train_mesh(8),
                log=None)
    plain = _plain()
    assert res.sha256 == plain.sha256
    assert [r["loss"] for r in res.history] == [r["loss"] for r in plain.history]
    assert [r["grad_norm"] for r in res.history] == [r["grad_norm"] for r in plain.history]
    late = res.history[STEPS // 2:]  # near peak learning rate: words still move a lot
    assert sum(r["sent_bytes"] for r in late) < sum(r["plain_bytes"] for r in late)


@pytest.mark.slow  # small's 4 layers: the prepared layer loop rolled (runtime.loops.rolled_scan)
@pytest.mark.parametrize("cache", ["word", "exponent"])
def test_small_defaults_bitwise_plain(cache):
    steps = 8
    res = train(_tc(config="small", schedule_steps=steps, cache=cache), steps=steps, seed=0,
                mesh=train_mesh(8), log=None)
    assert res.sha256 == _plain("small", steps).sha256


def _compiled(tc):
    """``(trainer, primed state, the step compiled at its steady rungs)``: the trainer's own
    program where a run in this process compiled it (plain's only one, tiny_run's)."""
    tr = build_trainer(tc, train_mesh(8))
    state = tr.prepare(tr.init_state(0))
    batch = tr.batch(data.load_dataset(None, 256, tc.length), 0, 0)
    key = program_key(rungs_holding(fsdp.wires(tr.tensors, state.ahead["encoded"], tr.n)))
    if key in tr.programs:
        return tr, state, tr.programs[key]
    return tr, state, tr.step_fn.lower(*tr.at_rungs(
        (state.params, state.caches, state.opt_state, state.ahead, batch), "steady")).compile()


def _gathers(hlo: str) -> dict:
    """All-gathers of a compiled step by where they were traced: ``forward`` or ``backward``
    (the op's name, kept in the HLO metadata, says ``transpose(jvp(...))`` in the backward)."""
    out = {"forward": 0, "backward": 0}
    for line in hlo.splitlines():
        if " all-gather(" in line or " all-gather-start(" in line:
            name = re.search(r'op_name="([^"]*)"', line)
            out["backward" if name and "transpose(" in name.group(1) else "forward"] += 1
    return out


@functools.cache
def _step(**kw):
    """The defaults on CPU: word caches on every tensor (``--plan all --cache word``)."""
    tr, state, compiled = _compiled(_tc(**kw))
    assert kw.get("gather") == "plain" or set(tr.cache_modes.values()) == {"word"}
    return tr, state, compiled


@pytest.mark.slow
def test_compiled_word_step_has_no_backward_gather():
    """In the compiled step with word caches on every tensor, no all-gather belongs to the
    backward: it reads the full weights from the caches."""
    got = _gathers(_step()[2].as_text())
    assert got["forward"] > 0 and got["backward"] == 0, got


def test_cache_backward_keeps_no_second_copy_of_the_words(tiny_run):
    """Measured (XLA's memory analysis of the compiled step): word caches add less than half
    of their own size to the step's temporaries over plain FSDP, besides a bucket's transient
    join (no gathered weights kept, no copy of the words: the backward reads the cache, which
    the step updates in place), and the caches it carries are the memory model's word-cache
    bytes."""
    tiny_run("plain")  # compiles plain's one program (the same TrainConfig as _tc(gather=...))
    tr, state, word = _step()
    _, plain_state, plain = _step(gather="plain")
    assert bytes_per_device(plain_state.caches) < 64  # plain carries the primed flags only
    caches = bytes_per_device(state.caches)
    extra = word.memory_analysis().temp_size_in_bytes - plain.memory_analysis().temp_size_in_bytes
    # a bucket of small tensors joins its members' caches (one layer) for a moment: measured
    # 2.5x the largest bucket's words, on top of the 0.32x of the caches without buckets
    groups = buckets.groups(tr.tensors, fsdp.cache_dict(state.caches), fsdp.AXIS)
    bucket = max((2 * sum(math.prod(tr.tensors[k].shape) for k in m) for m in groups.values()),
                 default=0)
    assert bucket and extra < caches / 2 + 3 * bucket, (extra, caches, bucket)
    modeled = memory.memory_per_gpu(tr.tc.model, 8, "word", tokens_per_gpu=1).caches["word"]
    assert caches == modeled
    # the step donates its caches and returns them in the same buffers
    assert word.memory_analysis().alias_size_in_bytes >= caches


@pytest.mark.slow
def test_regather_backward_gathers_again():
    """The check above can fail: word_backward="regather" compiles backward all-gathers."""
    got = _gathers(_step(word_backward="regather")[2].as_text())
    assert got["backward"] > 0, got


@pytest.mark.parametrize("model", ["jit", "shard_map"])
def test_flax_layers_word_caches_bitwise_plain(model):
    mesh = make_mesh((8,), ("fsdp",))
    tokens = batches(mesh, 10)
    fit = {"jit": train_jit, "shard_map": train_shard_map}[model]
    pw, hw, lw = fit(LM, mesh, "ciera", tokens, cache="word")
    pp, _, lp = fit(LM, mesh, "plain", tokens)
    assert same_bits(pw, pp) and lw == lp
    assert compressed(hw), hw[-1]


def test_nnx_remat_word_caches_bitwise_plain():
    mesh = make_mesh((8,), ("fsdp",))
    make = functools.partial(MLP, D, F)
    (pw, hw, cw), (pp, _, _) = [fit_jit(make, REMATS["nnx.remat"], mode, mesh, cache="word")
                                for mode in ("ciera", "plain")]
    assert same_bits(pw, pp)
    assert any(np.asarray(c).dtype == np.uint16 for c in jax.tree.leaves(cw))  # word caches
    # the first step primes the caches; every later one sends every tensor as words
    assert all(int(s["fallback"]) == 1 for s in hw[0].values())
    assert all(all_compressed(st) for st in hw[1:])


class WordScanNet(nnx.Module):
    """Three MLP layers stacked by nnx.vmap, each with word caches, run by nnx.scan."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def build(r):
            return fsdp.attach_caches(MLP(D, F, r), "word")

        self.layers = build(rngs)

    def __call__(self, x):
        return nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0),
                        out_axes=nnx.Carry)(x, self.layers)


def test_nnx_scan_word_caches_bitwise_plain():
    mesh = make_mesh((2, 4), ("data", "fsdp"))
    (pw, hw, cw), (pp, _, _) = [fit_jit(WordScanNet, call, mode, mesh, cache="word")
                                for mode in ("ciera", "plain")]
    assert same_bits(pw, pp)
    assert all(all_compressed(st) for st in hw[1:]), hw[1:]
    words = [c for c in jax.tree.leaves(cw) if np.asarray(c).dtype == np.uint16]
    assert words and all(np.asarray(w).shape[0] == 3 for w in words)  # word caches per layer


@pytest.mark.parametrize("cache", [pytest.param("auto", id="word"), "exponent"])
def test_planner_prices_the_bytes_a_train_step_reports(cache):
    """Per tensor and layer, the bytes a real step reports for the whole step (forward gather,
    the backward's gather where there is one, the gradient's reduce-scatter) are what
    ``planner.step_wire_bytes`` prices for the tensor's mode; plain FSDP's are three shards.
    test_train's trainers: its defaults (word caches on every tensor on CPU) and its exponent
    run (the expert weights with exponent caches, the other tensors plain)."""
    from ciera_jax.planning import planner
    from ciera_jax.codec.wire import agreement_bytes

    tc = _tc(cache=cache)
    tr = build_trainer(tc, train_mesh(8))
    want = {"word"} if cache == "auto" else {"exponent", "none"}
    assert set(tr.cache_modes.values()) == want
    ds = data.load_dataset(None, 256, tc.length)
    state = tr.init_state(0)
    for i in range(3):  # priming (plain fallbacks), then coded steps
        state, m = tr.step(state, tr.batch(ds, 0, i))
        for key, t in tr.tensors.items():
            mode = tr.cache_modes[key] if tr.compress[key] else "plain"
            for layer in range(t.stack or 1):
                st = {k: int(v) for k, v in m["gather"][t.layer_key(layer)].items()}
                shard = math.prod(t.shape) * 2 // tr.n  # bf16 bytes of one rank's shard
                assert st["plain_bytes"] == shard and st["step_plain_bytes"] == 3 * shard
                agree = agreement_bytes(mode) if mode != "plain" else 0
                assert st["step_sent_bytes"] == planner.step_wire_bytes(
                    mode, shard, st["sent_bytes"] - agree, agree, t.dtype), (key, mode, st)

"""``ciera_jax.train_step``: the README's Flax example in the user's own ``nnx.jit`` loop, run at
rungs the host fixes per program from inputs encoded and agreed on ahead of each step. Bitwise
the parameters of a plain gather, compressed past the priming step, no fallback there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp, loop
from ciera_jax.collective import PLAIN_RUNG
from ciera_jax.fsdp.state.ahead import ahead_of

from readme_step import MLP, Stacked

STEPS = 5


def _mesh():
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)


class Unwrapped(nnx.Module):
    """The README's ``MLP`` without the decorator: wrapped by instance (``fsdp.shard``)."""

    def __init__(self, d, f, rngs):
        part = lambda *n: nnx.with_partitioning(nnx.initializers.lecun_normal(), n)  # noqa: E731
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, f, kernel_init=part("fsdp", None), rngs=rngs)
        self.down = nnx.Linear(f, d, kernel_init=part(None, "fsdp"), rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


@nnx.jit  # one function for every run: a program compiles once, whichever test runs it first
def _train_step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(x) - x)))(model)
    opt.update(model, grads)
    return loss, fsdp.gather_stats(model)


def _run(gather: str, wrap: bool, steps: int = STEPS, nudge_at: int | None = None,
         sharded: bool = False, stacked: bool = False):
    """The README's loop: final params, each step's stats, and the wrapper (or None).
    ``nudge_at``: before that step, every parameter is changed outside the step;
    ``sharded``: the model wrapped by instance instead of decorated; ``stacked``: three
    smaller layers stacked with ``nnx.vmap``, run with ``nnx.scan``."""
    d = 64 if stacked else 256
    with jax.set_mesh(_mesh()):
        x = jax.device_put(jax.random.normal(jax.random.key(1), (64, d)), P(("data", "fsdp")))
        model = (fsdp.shard(Unwrapped(256, 1024, nnx.Rngs(0))) if sharded
                 else Stacked(3, d, 256, nnx.Rngs(0)) if stacked
                 else MLP(256, 1024, nnx.Rngs(0)))
        if gather == "plain":
            fsdp.set_gather_mode(model, "plain")
        else:
            fsdp.attach_caches(model, mode=gather)
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        step = ciera_jax.train_step(_train_step) if wrap else _train_step
        stats = []
        for i in range(steps):
            if i == nudge_at:
                params = nnx.state(model, nnx.Param)
                nnx.update(model, jax.tree.map(lambda a: a * 1.5, params))
            _, st = step(model, opt, x)
            stats.append(jax.device_get(st))
        params = jax.device_get(nnx.state(model, nnx.Param))
    return params, stats, step if wrap else None


def _bits(tree):
    return [np.asarray(a).view(f"u{np.asarray(a).dtype.itemsize}") for a in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def _totals(st: dict) -> tuple[int, int, int]:
    """(sent bytes, plain bytes, fallbacks) over every gathered tensor (and layer) of one
    step."""
    rows = list(st.values())
    return tuple(int(sum(np.asarray(r[k]).sum() for r in rows))
                 for k in ("sent_bytes", "plain_bytes", "fallback"))


@pytest.fixture(scope="module")
def plain():
    return _run("plain", False)[0]


@pytest.mark.parametrize("mode", ["word", "exponent"])
def test_the_readme_loop_is_bitwise_plain_and_compressed_past_priming(plain, mode):
    params, stats, step = _run(mode, True)
    assert _same(params, plain)
    first = _totals(stats[0])
    assert first[2] > 0 and first[0] >= first[1]  # the priming program: plain, refilling caches
    for st in stats[2:]:
        sent, plain_bytes, fallbacks = _totals(st)
        assert fallbacks == 0 and 0 < sent < plain_bytes
    assert step.steps == STEPS and 1 <= step.plain_steps <= 2
    assert step.encodes == STEPS + 1  # one before the first step, one after each
    assert 2 <= len(step.programs) <= step.max_programs
    assert all(r != PLAIN_RUNG for r in step.programs[-1].values())
    # ciera train's policy, holding every demand, priced with each compile it measured
    (policy,) = step.policies.values()
    assert policy.holds and len(policy.compile_s) == len(step.programs)
    assert all(s > 0 for s in policy.compile_s)


def test_the_wrapper_matches_the_bare_decorator_and_leaves_its_path_alone(plain):
    bare, bare_stats, _ = _run("word", False, steps=3)
    loop_params, _, step = _run("word", True, steps=3)
    assert _same(bare, loop_params)
    assert all(_totals(st)[2] == 0 for st in bare_stats[1:])


@pytest.mark.parametrize("mode", ["word", "exponent"])
def test_a_layer_stack_run_with_nnx_scan_is_bitwise_plain(mode):
    """The docs' nnx.vmap recipe: each layer's call in the scan gathers from its slice of the
    inputs made ahead (a layer axis before the rank axis); one rung per stack, the most any
    layer needs."""
    want = _run("plain", False, stacked=True)[0]
    params, stats, step = _run(mode, True, stacked=True)
    assert _same(params, want)
    for st in stats[2:]:
        sent, plain_bytes, fallbacks = _totals(st)
        assert fallbacks == 0 and 0 < sent < plain_bytes
    assert step.plain_steps == 1


def test_parameters_changed_outside_the_step_are_encoded_again():
    """A parameter set between steps (a restore, an edit) is not what the last encode read:
    the wrapper encodes again before the step, and the run stays bitwise a plain one's."""
    want = _run("plain", False, steps=4, nudge_at=2)[0]
    params, stats, step = _run("word", True, steps=4, nudge_at=2)
    assert _same(params, want)
    assert step.encodes == 4 + 1 + 1
    # the step after the nudge sent the nudged words: far more exponents changed than at the
    # optimizer's steps around it
    changed = [sum(int(r["changed"]) for r in st.values()) for st in stats]
    assert changed[2] > 2 * max(changed[1], changed[3])


def test_a_model_wrapped_by_instance_runs_the_same_program(plain):
    params, stats, step = _run("exponent", True, sharded=True)
    assert _same(params, plain)
    assert all(_totals(st)[2] == 0 for st in stats[2:]) and step.plain_steps == 1


def test_the_inputs_made_ahead_are_split_over_the_ranks():
    with jax.set_mesh(_mesh()):
        model = fsdp.attach_caches(MLP(256, 1024, nnx.Rngs(0)), mode="word")
        loop.encode_ahead(model)
        ahead = ahead_of(model)
    assert ahead
    for e, agreed, needed in ahead.values():
        for leaf in jax.tree.leaves(e):
            assert leaf.shape[0] == 4 and leaf.sharding.spec[0] == "fsdp"
        assert int(needed) == loop.ahead.wire_of(e).rungs  # unprimed: plain


@pytest.mark.parametrize("bad", [dict(max_programs=0), dict(patience=-1.0),
                                 dict(headroom=-1)])
def test_bad_policy_options_are_one_line_errors(bad):
    with pytest.raises(ValueError, match="max_programs must be >= 1"):
        ciera_jax.train_step(lambda model: None, **bad)


def test_the_link_is_read_when_the_step_is_wrapped():
    with pytest.raises(KeyError, match="unknown profile 'nvlink9'"):
        ciera_jax.train_step(lambda model: None, link="nvlink9")
    assert ciera_jax.train_step(lambda model: None, link="16xh100-ib400").link.inter.name == \
        "h100-ib400"

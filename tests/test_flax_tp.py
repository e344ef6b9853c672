"""FSDP beside tensor (and expert) parallelism on a Gemma-like model written as Flax's Gemma
example writes it (``kernel_metadata={'out_sharding': ...}`` over ``('fsdp', 'tp')``, an
Explicit mesh, ``nnx.jit``, ``jax.set_mesh``), wrapped by instance with ``fsdp.shard``.

The gathers run over ``fsdp`` only; ``tp`` / ``expert`` stay split. Plain, exponent and word
caches end bitwise equal after training through compressed steps, every step function is traced and compiled once,
and the mode a step was traced with is the mode it runs."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from ciera_jax import fsdp
from flax_nets import all_compressed
from gemma_like import (Block, DecoratedBlock, DecoratedTransformer, MoEModel,
                        ScannedTransformer, Transformer, batches, loss_fn, make_mesh,
                        params_sha256, shard_gemma, train)

STEPS = 5


def wrapped(cls):
    return lambda rngs: shard_gemma(cls(rngs))


def primed(model) -> bool:
    caches = fsdp.cache_dict(nnx.state(model, fsdp.GatherCacheVar))
    return bool(caches) and all(np.all(np.asarray(c.primed)) for c in caches.values())


def check_run(model, history, counts, settle: int = 1):
    """Traced once, compiled during the first ``settle`` steps only; caches filled; the first
    step primes them, the last sends every tensor compressed (no fallback, below plain)."""
    assert counts["traces"] == 1, counts
    assert counts["compiles"][0] >= 1 and sum(counts["compiles"][settle:]) == 0, counts
    assert primed(model)
    assert all(np.all(np.asarray(s["fallback"]) == 1) for s in history[0].values())
    assert all_compressed(history[-1]), history[-1]
    assert fsdp.wire_ratio(history[-1]) < 1.0, fsdp.wire_ratio(history[-1])


@functools.cache
def gemma_runs(mesh_shape, explicit, modes=("plain", "exponent", "word")):
    mesh = make_mesh(mesh_shape, explicit_axes=explicit)
    toks = batches(mesh, STEPS)
    # One block in the nnx.List: the loop, the wrapping and the shardings are those of any depth,
    # and each mode's step compiles in about half the time of two blocks.
    build = wrapped(functools.partial(Transformer, layers=1))
    # the plain baseline: the same model and caches (unused), gathered plain
    return {m: train(build, mesh, toks, mode="exponent" if m == "plain" else m,
                     gather="plain" if m == "plain" else "ciera") for m in modes}


def test_fsdp_beside_tp_explicit_mesh_all_modes_bitwise():
    runs = gemma_runs((4, 2), True)
    sha = {m: params_sha256(r[0]) for m, r in runs.items()}
    assert sha["exponent"] == sha["plain"] and sha["word"] == sha["plain"], sha
    assert runs["exponent"][2]["losses"] == runs["plain"][2]["losses"]
    model = runs["word"][0]
    # tp shardings are kept: the params, and the caches split like the gathered weights
    assert model.blocks[0].ffw.down.kernel[...].sharding.spec == jax.P("tp", "fsdp")
    assert model.blocks[0].attn.q.kernel[...].sharding.spec == jax.P("fsdp", "tp", None)
    cache = model.blocks[0].ffw.down.kernel_gather_cache.get_value()
    assert cache.words.shape == (32, 16) and cache.words.sharding.spec == jax.P("tp", None)
    for m in ("exponent", "word"):
        check_run(*runs[m])
    # word caches send less than exponent caches; stats count the whole tensor
    assert fsdp.wire_ratio(runs["word"][1][-1]) < fsdp.wire_ratio(runs["exponent"][1][-1])
    st = runs["plain"][1][-1]["blocks/0/ffw/down/kernel"]
    assert int(st["elements"]) == 32 * 16 and int(st["rung"]) == -1
    assert runs["plain"][2]["traces"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,explicit", [((8, 1), True), ((4, 2), False)],
                         ids=["explicit-tp1", "auto-tp2"])
def test_fsdp_beside_tp_other_meshes(mesh_shape, explicit):
    runs = gemma_runs(mesh_shape, explicit, ("plain", "exponent"))
    assert params_sha256(runs["exponent"][0]) == params_sha256(runs["plain"][0])
    check_run(*runs["exponent"])


@pytest.mark.slow
def test_experts_split_over_an_expert_axis():
    mesh = make_mesh((2, 4), ("expert", "fsdp"), explicit_axes=False)
    toks = batches(mesh, STEPS)
    build = lambda r: fsdp.shard(MoEModel(r))  # noqa: E731
    plain, ciera = (train(build, mesh, toks, mode="exponent", gather=g)
                    for g in ("plain", "ciera"))
    assert params_sha256(ciera[0]) == params_sha256(plain[0])
    # On an Auto mesh XLA picks the step's output shardings: the model's unannotated router
    # comes back split over ``expert`` (P() -> P(None, 'expert')), so step 2 compiles once
    # more for the new input shardings, then never again (Explicit meshes compile once).
    check_run(*ciera, settle=2)
    cache = ciera[0].moe.w_in_gather_cache.get_value()
    assert cache.exp.shape == (2, 16, 32) and cache.exp.sharding.spec == jax.P("expert")


@pytest.mark.slow
def test_stacked_scanned_layers_wrapped_and_decorated_bitwise_plain():
    """nnx.vmap-stacked blocks run with nnx.scan: attach_caches on the whole model gives each
    layer its own cache and stats; wrapped by instance and decorated, each trains plain's
    parameters bitwise through compressed steps."""
    mesh = make_mesh((4, 2))
    toks = batches(mesh, 3)

    def decorated(rngs):
        class Scanned(ScannedTransformer):
            def __init__(self, rngs):
                nnx.Module.__init__(self)
                ScannedTransformer.__init__(self, rngs)

            @fsdp.gathered()
            def __call__(self, tokens):
                return super().__call__(tokens)

        model = Scanned(rngs)
        fsdp.shard(model.layers)  # the stacked Block instance (its class is Block)
        return model

    runs = {"wrapped": train(wrapped(ScannedTransformer), mesh, toks, mode="exponent"),
            "decorated": train(decorated, mesh, toks, mode="exponent"),
            "plain": train(wrapped(ScannedTransformer), mesh, toks, mode="exponent",
                           gather="plain")}
    model, history, counts = runs["wrapped"]
    assert params_sha256(model) == params_sha256(runs["plain"][0])
    assert params_sha256(runs["decorated"][0]) == params_sha256(runs["plain"][0])
    check_run(model, history, counts)
    check_run(*runs["decorated"])
    assert np.asarray(history[0]["layers/ffw/down/kernel"]["rung"]).shape == (2,)
    assert model.layers.ffw.down.kernel_gather_cache.get_value().exp.shape == (2, 32, 16)


def test_nnx_list_decorated_bitwise_plain():
    """The decorated blocks of an ``nnx.List`` train plain's parameters bitwise through
    compressed steps (the wrapped ones: test_fsdp_beside_tp_explicit_mesh_all_modes_bitwise,
    on the same mesh, tokens and plain run)."""
    runs = gemma_runs((4, 2), True)
    mesh = make_mesh((4, 2), explicit_axes=True)
    decorated = train(functools.partial(DecoratedTransformer, layers=1), mesh,
                      batches(mesh, STEPS), mode="exponent")
    assert params_sha256(decorated[0]) == params_sha256(runs["plain"][0])
    check_run(*decorated)
    wrapped_block = runs["exponent"][0].blocks[0]
    assert type(wrapped_block).__name__ == "ShardedBlock" and isinstance(wrapped_block, Block)
    assert isinstance(decorated[0].blocks[0], DecoratedBlock)


def test_a_step_traced_under_one_mode_never_runs_it_under_another():
    mesh = make_mesh((8, 1))
    toks = batches(mesh, 2)
    with jax.set_mesh(mesh):
        model = fsdp.attach_caches(shard_gemma(Transformer(nnx.Rngs(0), layers=1)))
        traces = []

        @nnx.jit
        def step(model, toks):
            traces.append(1)
            loss = loss_fn(model, toks)
            return fsdp.gather_stats(model), loss

        with fsdp.gather_mode(model, "ciera"):
            step(model, toks[0])
            ciera, _ = step(model, toks[1])
        with fsdp.gather_mode(model, "plain"):  # a static field of the modules: jit retraces
            plain, _ = step(model, toks[1])
        fsdp.set_gather_mode(model, "ciera")  # the mode traced first: no third trace
        again, _ = step(model, toks[1])
    assert len(traces) == 2
    assert all(int(s["rung"]) >= 0 for s in again.values())
    assert all(int(s["rung"]) >= 0 for s in ciera.values())  # compressed
    assert all(int(s["rung"]) == -1 for s in plain.values())  # really plain
    assert all(int(s["sent_bytes"]) == int(s["plain_bytes"]) for s in plain.values())


def test_gather_mode_yields_the_model_and_restores_its_mode():
    with jax.set_mesh(make_mesh((8, 1))):
        model = shard_gemma(Transformer(nnx.Rngs(0), layers=1))
    before = nnx.graphdef(model)
    with fsdp.gather_mode(model, "int8") as same:
        assert same is model and {fsdp.setup_of(m).mode for m in (
            model.blocks[0], model)} == {"int8"}
    assert nnx.graphdef(model) == before  # as it was: a step traced before is reused


def test_auto_mode_plans_per_tensor_within_memory():
    mesh = make_mesh((4, 2))
    with jax.set_mesh(mesh):
        unlimited = fsdp.attach_caches(shard_gemma(Transformer(nnx.Rngs(0))), mode="auto")
        none = fsdp.attach_caches(shard_gemma(Transformer(nnx.Rngs(0))), mode="auto",
                                  memory_gb=0)
    kinds = {type(c).__name__ for c in fsdp.cache_dict(
        nnx.state(unlimited, fsdp.GatherCacheVar)).values()}
    assert kinds <= {"ExponentCache", "WordCache"}
    # no memory for caches: every tensor gathers plain (no cache), and stats exist already
    assert not fsdp.cache_dict(nnx.state(none, fsdp.GatherCacheVar))
    assert sorted(fsdp.gather_stats(none)) == sorted(fsdp.gather_stats(unlimited))


def test_misuse_names_the_fix():
    with jax.set_mesh(make_mesh((4, 2))):
        one, two = (Transformer(nnx.Rngs(0), layers=1) for _ in range(2))
        model = DecoratedTransformer(nnx.Rngs(0), layers=1)
    with pytest.raises(ValueError, match="attach_caches: unknown mode 'bits'"):
        fsdp.attach_caches(one, mode="bits")
    with pytest.raises(ValueError, match="selected no module"):
        fsdp.shard(two, where=lambda p, m: False)
    with pytest.raises(ValueError, match="gathers already"):
        fsdp.shard(model.blocks[0])
    assert fsdp.is_sharded(model.blocks[0]) and not fsdp.is_sharded(model.final_norm)


def test_state_specs_keep_tp_for_params_and_caches():
    """The shard_map programming model: params keep their whole spec, caches are split like
    the gathered weight (per leaf: the flag is replicated)."""
    with jax.set_mesh(make_mesh((4, 2))):
        model = fsdp.attach_caches(shard_gemma(Transformer(nnx.Rngs(0), layers=1)))
    _, params, caches, _ = nnx.split(model, nnx.Param, fsdp.GatherCacheVar, ...)
    p_specs = fsdp.state_specs(model, params, n=4)
    c_specs = fsdp.state_specs(model, caches)
    assert p_specs["blocks"][0]["ffw"]["down"]["kernel"] == jax.P("tp", "fsdp")
    assert p_specs["blocks"][0]["pre_ffw"]["scale"] == jax.P()
    cache = c_specs["blocks"][0]["ffw"]["down"]["kernel_gather_cache"].get_value()
    assert cache.exp == jax.P("tp", None) and cache.primed == jax.P()
    assert fsdp.gathered_tensors(model)["blocks/0/ffw/down/kernel"].spec == ("tp", "fsdp")

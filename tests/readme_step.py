"""The README's Flax example (its ``MLP`` under the user's own jitted train step) as a step
``ciera aot --step`` and ``ciera_models.aot.user_step`` compile: ``build_<gather>(mesh)``
returns the step and its abstract arguments on the mesh it is given."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp, loop
from ciera_jax.fsdp.state.ahead import ahead_of, set_ahead
from ciera_jax.fsdp.state.setup import gathering_modules
from ciera_jax.loop.ahead import ahead_values
from ciera_jax.loop.rungs import rungs_holding

D, F, BATCH = 256, 1024, 64

part = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731


class MLP(nnx.Module):
    def __init__(self, d, f, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, f, kernel_init=part("fsdp", None), rngs=rngs)
        self.down = nnx.Linear(f, d, kernel_init=part(None, "fsdp"), rngs=rngs)

    @ciera_jax.gathered(axis_name="fsdp")
    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Blocks(nnx.Module):
    """``n`` of the README's ``MLP`` called one after another (each gathers on its own)."""

    def __init__(self, n, d, f, rngs):
        self.blocks = nnx.List([MLP(d, f, rngs) for _ in range(n)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Stacked(nnx.Module):
    """``n`` of the README's ``MLP`` stacked with ``nnx.vmap`` and run with ``nnx.scan`` (the
    recipe of docs/flax.md: each layer gathers its own in the scan)."""

    def __init__(self, n, d, f, rngs):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def build(r):
            return MLP(d, f, r)

        self.layers = build(rngs)

    def __call__(self, x):
        return nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                        transform_metadata={nnx.PARTITION_NAME: None})(x, self.layers)


def _placed(state, mesh):
    """Abstract ``state`` placed on ``mesh`` as its partition names say."""
    specs = nnx.get_partition_spec(state)
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, s if isinstance(s, P) else P())), sub),
        specs, state, is_leaf=lambda s: isinstance(s, P) or s is None)


def build(mesh, mode: str | None = "word", d: int = D, f: int = F, batch: int = BATCH,
          rungs=None, blocks: int = 0, layers: int = 0):
    """``(step, (state, x))``: the README's ``train_step`` over the model and optimizer's
    state, abstract and placed as their partition names say; ``mode=None``: no caches (the
    decorator gathers plainly). ``rungs``: the program ``ciera_jax.train_step`` runs at those
    rungs (``ciera_jax.loop.at_rungs``), its inputs made ahead part of the state; None: the
    bare decorator's per-call program. ``blocks``: that many MLPs in a row; ``layers``: that
    many stacked (0 and 0: one, the README's)."""
    def make():
        model = (Blocks(blocks, d, f, nnx.Rngs(0)) if blocks else
                 Stacked(layers, d, f, nnx.Rngs(0)) if layers else MLP(d, f, nnx.Rngs(0)))
        if mode:
            model = fsdp.attach_caches(model, mode=mode)
        else:
            fsdp.set_gather_mode(model, "plain")
        if rungs is not None:
            loop.at_rungs(model, rungs)
            made["ahead"] = loop.ahead_specs(model)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    made = {}

    def state_of():  # the graph kept aside; jax.eval_shape allocates nothing
        made["graphdef"], state = nnx.split(make())
        return state

    state = _placed(jax.eval_shape(state_of), mesh)
    graphdef = made["graphdef"]
    if "ahead" in made:  # the inputs made ahead, split as the encode program leaves them
        model, opt = nnx.merge(graphdef, state)
        for path, m in gathering_modules(model):
            specs = made["ahead"].get("/".join(map(str, path)))
            if specs:
                set_ahead(m, jax.tree.map(lambda spec, sub: jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                   sharding=NamedSharding(mesh, spec)), sub),
                    specs, ahead_of(m), is_leaf=lambda x: isinstance(x, P)))
        graphdef, state = nnx.split((model, opt))

    @jax.jit
    def step(state, x):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(x) - x)))(model)
        opt.update(model, grads)
        return loss, fsdp.gather_stats(model), nnx.state((model, opt))

    x = jax.ShapeDtypeStruct((batch, d), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    return step, (state, x)


def build_encode(mesh, mode: str = "word", d: int = D, f: int = F):
    """The encode program ``ciera_jax.train_step`` runs after each step (the README's MLP
    with ``mode`` caches): ``(program, (model state,))``, abstract and placed."""
    made = {}

    def state_of():
        made["graphdef"], state = nnx.split(
            fsdp.attach_caches(MLP(d, f, nnx.Rngs(0)), mode=mode))
        return state

    state = _placed(jax.eval_shape(state_of), mesh)
    graphdef = made["graphdef"]
    return jax.jit(lambda st: ahead_values(nnx.merge(graphdef, st))), (state,)


build_plain = functools.partial(build, mode=None)
build_word = functools.partial(build, mode="word")
build_exponent = functools.partial(build, mode="exponent")
# the program ciera_jax.train_step runs on the steady path: each tensor at the rung holding
# the steady-state demand (the first program ciera train compiles)
build_word_steady = functools.partial(build, mode="word", rungs=rungs_holding)
build_exponent_steady = functools.partial(build, mode="exponent", rungs=rungs_holding)
build_plain_4 = functools.partial(build, mode=None, blocks=4)
build_word_steady_4 = functools.partial(build, mode="word", rungs=rungs_holding, blocks=4)
build_plain_stacked_4 = functools.partial(build, mode=None, layers=4)
build_word_encode = functools.partial(build_encode, mode="word")
build_exponent_encode = functools.partial(build_encode, mode="exponent")
build_word_steady_stacked_4 = functools.partial(build, mode="word", rungs=rungs_holding,
                                                layers=4)

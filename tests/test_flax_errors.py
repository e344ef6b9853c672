"""No silent no-op: every misuse of the decorator fails at trace time with a message that names
the module and the parameter and says how to fix it."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ciera_jax import fsdp
from flax_nets import MLP, make_mesh, part


class Plain(nnx.Module):
    """A decorated module whose kernel nobody annotated."""

    def __init__(self, rngs, **kw):
        self.lin = nnx.Linear(16, 16, rngs=rngs, **kw)

    @fsdp.gathered()
    def __call__(self, x):
        return self.lin(x)


class Whole(nnx.Module):
    """Annotated, but over other axes only: nothing to gather over fsdp."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, kernel_init=part(None, None), rngs=rngs)

    @fsdp.gathered()
    def __call__(self, x):
        return self.lin(x)


class Meta(nnx.Module):
    """Split by ``fsdp_axis`` metadata (no Flax annotation, so it builds without a mesh)."""

    def __init__(self, rngs, rows=16):
        self.w = nnx.Param(jnp.ones((rows, 16)), fsdp_axis=0)

    @fsdp.gathered()
    def __call__(self, x):
        return x @ self.w[...].T


def trace(model, x, mesh):
    """Trace a call under jit with the mesh set (no compile)."""
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(model)
        return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).trace(state, x)


X = jnp.ones((8, 16))


def test_uncovered_weight_is_an_error_naming_it_and_replicate_opts_in():
    mesh = make_mesh((8,), ("fsdp",))
    with pytest.raises(ValueError, match=r"Plain/lin/kernel: no sharding for this 2-D weight"
                                         r".*with_partitioning.*replicate='lin/kernel'"):
        trace(Plain(nnx.Rngs(0)), X, mesh)

    class Opted(Plain):
        @fsdp.gathered(replicate="lin/kernel")
        def __call__(self, x):
            return self.lin(x)

    # covered now, but then nothing is left to gather: the next error, not a silent no-op
    with pytest.raises(ValueError, match="Opted: decorated .* none of its parameters is split"):
        trace(Opted(nnx.Rngs(0)), X, mesh)


def test_nothing_to_gather_is_an_error():
    with pytest.raises(ValueError, match=r"Whole: decorated with @gathered\(axis_name='fsdp'\) "
                                         r"but none of its parameters is split over 'fsdp'"):
        mesh = make_mesh((8,), ("fsdp",))
        with jax.set_mesh(mesh):
            model = Whole(nnx.Rngs(0))
        trace(model, X, mesh)


def test_axis_not_in_mesh_is_an_error():
    with pytest.raises(ValueError, match=r"Meta: the gather axis 'fsdp' is not an axis of the "
                                         r"mesh \('data',\); name one of them"):
        trace(fsdp.attach_caches(Meta(nnx.Rngs(0))), X, make_mesh((8,), ("data",)))


def test_mesh_not_dividing_a_split_dim_is_an_error():
    with pytest.raises(ValueError, match=r"mesh size fsdp=8 does not divide dimension 0 "
                                         r"\(size 12\) of weight Meta/w"):
        trace(fsdp.attach_caches(Meta(nnx.Rngs(0), rows=12)), X, make_mesh((8,), ("fsdp",)))


def test_missing_cache_is_an_error_naming_the_parameter():
    mesh = make_mesh((8,), ("fsdp",))
    with jax.set_mesh(mesh):
        model = MLP(16, 32, nnx.Rngs(0))  # no attach_caches
    with pytest.raises(ValueError, match=r"MLP/(up|down)/kernel: gather 'ciera' needs a cache "
                                         r".*attach_caches\(model, mode='word'\)"):
        trace(model, X, mesh)
    with fsdp.gather_mode(model, "plain"):  # the plain baseline needs none
        trace(model, X, mesh)

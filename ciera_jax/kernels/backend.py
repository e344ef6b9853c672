"""Which Pallas GPU backend a kernel compiles for, and how a block-streaming kernel is launched
on each: the one place that knows about Mosaic GPU, Triton and their interpreters.

Backends (``BACKENDS``):

* ``"mosaic"`` — Pallas on Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``), launched with
  ``plgpu.kernel`` (the entry point JAX recommends since 0.10: ``pl.pallas_call`` with Mosaic GPU
  compiler params is deprecated there). One CTA of one warpgroup (128 threads) per block; each
  operand's block is read from and written to global memory directly, as a warpgroup-strided
  vector (``WG_STRIDED`` layout, one vector width for every operand of a kernel so the
  elementwise math never relayouts). Our kernels are 1-D bandwidth-bound streams: no TMA, no
  shared memory, no matmul. Targets compute capability 9.0+ (Hopper, Blackwell).
* ``"triton"`` — Pallas on Triton (``pl.pallas_call`` + ``BlockSpec``). JAX 0.11 deprecates it
  (its lowering warns, removal announced); kept for Ampere and for comparison, opt-in only.

Every kernel is written once as a *body*: a pure function from the loaded block values to the
block values to store (see :func:`stream_call`). Both backends run the same body; so does each
backend's CPU interpreter (``interpret``), which is what the tests compare against the jnp
references: the Mosaic GPU interpreter (``InterpretGPUParams``, which simulates the kernel's
threads, global-memory refs and ``axis_index``) and Triton's HLO interpreter (``interpret=True``).

``impl`` -> what runs (:func:`resolve`):

==========  =====================  ========================  ==========================
impl        GPU cc >= 9.0          GPU cc < 9.0 (Ampere)     no GPU (CPU)
==========  =====================  ========================  ==========================
auto        mosaic                 xla (fused jnp)           xla
pallas      mosaic                 triton                    triton, interpreted (*)
mosaic      mosaic                 mosaic (untested there)   mosaic, interpreted
triton      triton                 triton                    triton, interpreted
xla         xla                    xla                       xla
==========  =====================  ========================  ==========================

(*) Triton's HLO interpreter is plain XLA and runs anywhere, inside a multi-device
``shard_map`` too. The Mosaic GPU interpreter runs the kernel through host callbacks that
synchronise the simulated devices; inside an SPMD program on the emulated CPU devices, next to
collectives, that deadlocks XLA's rendezvous (measured: 4 of 8 devices stuck). So on CPU
``"pallas"`` interprets with Triton's interpreter while this JAX has it (Mosaic GPU's
otherwise), and the Mosaic interpreter is for single-device kernel tests (``"mosaic"``).

Lowering for a GPU from a host without one (``jax.export`` for ``platforms=["cuda"]``): inside
``with lowering_for("cuda", capability="9.0"):`` the table's GPU column applies (no
interpretation) whatever the local devices are. The choice is made at trace time and is not
part of ``jax.jit``'s cache key, so entering and leaving the block clears JAX's caches
(``jax.clear_caches()``): a function traced before is traced again inside, and nothing traced
inside leaks out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.runtime import gpu_targets, target
from ciera_jax.runtime.varying import kernel_out_types

IMPLS = ("auto", "xla", "pallas", "mosaic", "triton")
BACKENDS = ("mosaic", "triton")
HOPPER = (9, 0)  # Mosaic GPU's target: Hopper (sm_90) and newer
WARPGROUP = 128  # threads of one Mosaic GPU CTA here
VECTOR_BYTES = 8  # per-thread vector of the widest operand (Mosaic's default strided layout)
TRITON_WARPS = 4

# Custom-call targets the kernels lower to (what jax.export's safety check must be told about).
CUSTOM_CALL = {"mosaic": "mosaic_gpu_v2", "triton": "__gpu$xla.gpu.triton"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What an ``impl`` resolves to: ``kind`` "xla" or "pallas"; for pallas, the backend and
    whether it runs in that backend's CPU interpreter."""

    kind: str
    backend: str | None = None
    interpret: bool = False


@contextlib.contextmanager
def lowering_for(platform: str = "cuda", *, capability: str | tuple[int, int] = "9.0"):
    """Resolve ``impl`` as on a ``platform`` GPU of compute ``capability`` (e.g. "9.0", "8.0")
    inside this block, whatever this host's devices are: for ``jax.export`` to CUDA off-GPU and
    ``ciera aot`` (:func:`ciera_jax.runtime.target.tracing_for_gpu`: the escapes' walk too)."""
    if not gpu_targets.is_gpu(platform):
        raise ValueError(f"lowering_for: only CUDA GPUs have Pallas kernels here, got {platform!r}")
    with target.tracing_for_gpu(_parse_capability(capability)):
        yield


def gpu_capability() -> tuple[int, int] | None:
    """Compute capability of the GPU kernels are built for, or None when there is none:
    the :func:`lowering_for` target if one is set, else the default device's (CUDA only)."""
    forced = target.forced_gpu_capability()
    if forced is not None:
        return forced
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    return _parse_capability(cc) if cc else None  # ROCm devices have none: no Pallas here


def resolve(impl: str) -> Choice:
    """``impl`` -> :class:`Choice` for the current target (the table in this module's doc)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown codec impl {impl!r}; expected one of {IMPLS}")
    if impl == "xla":
        return Choice("xla")
    cc = gpu_capability()
    hopper = cc is not None and cc >= HOPPER
    if impl == "auto":
        return Choice("pallas", "mosaic") if hopper else Choice("xla")
    if impl == "pallas":
        if cc is None:  # interpreted: the deadlock-free interpreter where there is one (*)
            backend = "triton" if "triton" in available_backends() else "mosaic"
        else:
            backend = "mosaic" if hopper else "triton"
    else:
        backend = impl
    return Choice("pallas", backend, interpret=cc is None)


def check_backend(backend: str | None) -> str:
    """``backend`` or, for None, the one ``impl="pallas"`` picks here."""
    if backend is None:
        return resolve("pallas").backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown Pallas backend {backend!r}; expected one of {BACKENDS}")
    return backend


def _parse_capability(cc) -> tuple[int, int]:
    if isinstance(cc, str):
        major, _, minor = cc.partition(".")
        return int(major), int(minor or 0)
    return tuple(int(v) for v in cc)


# --- launching a block-streaming kernel ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Operand:
    """One kernel operand. ``planes=None``: one array over the element axis, the body sees /
    returns one block value. ``planes=P``: P such arrays stacked in front, the body sees /
    returns a list of P block values. ``per_block=S`` (outputs only): shape (programs, S),
    the body returns S scalars per program (block reductions). ``blocks`` (an input of a
    :class:`Flat` layout): program i's block of this operand is block ``blocks(i)`` (a scalar
    function of the traced program index), read in place where it lies, not block i.
    ``groups`` (an input of a :class:`Pairs` layout): group g of this operand is its group
    ``groups(g)``, read in place (a permutation of groups: another layout of the same tensor)."""

    dtype: jnp.dtype
    planes: int | None = None
    per_block: int = 0
    blocks: Callable | None = None
    groups: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Flat:
    """Operands are flat (n_pad,) arrays (or (P, n_pad)); program i owns elements
    [i * block, (i + 1) * block)."""

    n_pad: int

    def programs(self, block: int) -> int:
        return self.n_pad // block

    def element_shape(self) -> tuple[int, ...]:
        return (self.n_pad,)


@dataclasses.dataclass(frozen=True)
class Pairs:
    """Operands are (groups, 2, dist) arrays (or (P, groups, 2, dist)): a flat array cut into
    groups of ``2 * dist`` elements, whose element ``j`` (lo) pairs with ``j + dist`` (hi).
    Program i owns ``block`` lo elements and their hi partners: group ``i // (dist // block)``,
    offset ``(i % (dist // block)) * block``; the body sees / returns (lo, hi) tuples."""

    groups: int
    dist: int

    def programs(self, block: int) -> int:
        return self.groups * (self.dist // block)

    def element_shape(self) -> tuple[int, ...]:
        return (self.groups, 2, self.dist)


@dataclasses.dataclass(frozen=True)
class Block:
    """What a body that asks for it (``with_block=True``) gets first: its program index and
    the lane index 0..block-1 (uint32, laid out like the operands' blocks)."""

    index: jax.Array
    lanes: jax.Array


def stream_call(body: Callable, inputs: Sequence[Operand], outputs: Sequence[Operand], *,
                n_pad: int | None = None, layout: Flat | Pairs | None = None, block: int,
                backend: str, interpret: bool, name: str, with_block: bool = False):
    """A function of the operands that runs ``body`` once per block of elements on
    ``backend`` (in its CPU interpreter if ``interpret``) and returns the outputs.

    ``body(*values)`` gets one value per input and returns one per output, in order (see
    :class:`Operand`); with ``with_block`` it gets a :class:`Block` first.
    """
    layout = layout if layout is not None else Flat(n_pad)
    span = layout.n_pad if isinstance(layout, Flat) else layout.dist
    if span % block:
        raise ValueError(f"{layout} is not a whole number of {block}-element blocks")
    programs = layout.programs(block)

    def out_type(o):
        if o.per_block:
            return jax.ShapeDtypeStruct((programs, o.per_block), o.dtype)
        lead = () if o.planes is None else (o.planes,)
        return jax.ShapeDtypeStruct(lead + layout.element_shape(), o.dtype)

    launch = _mosaic_call if backend == "mosaic" else _triton_call
    out_types = tuple(map(out_type, outputs))

    def call(*args):
        return launch(body, tuple(inputs), tuple(outputs), kernel_out_types(out_types, args),
                      layout=layout, programs=programs, block=block, interpret=interpret,
                      name=name, with_block=with_block)(*args)

    return call


def _vec_size(operands, block: int) -> int:
    """Elements per thread-vector on Mosaic GPU: ``VECTOR_BYTES`` of the widest operand, fewer
    when a block is too small to give every thread of the warpgroup a full vector."""
    widest = max(jnp.dtype(o.dtype).itemsize for o in operands if not o.per_block)
    return max(1, min(VECTOR_BYTES // widest, block // WARPGROUP))


def _mosaic_call(body, inputs, outputs, out_types, *, layout, programs, block, interpret, name,
                 with_block):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    vec = _vec_size(inputs + outputs, block)
    if block % (WARPGROUP * vec):
        raise ValueError(f"Mosaic GPU blocks are whole warpgroups: block {block} must be a "
                         f"multiple of {WARPGROUP * vec} ({WARPGROUP} threads x {vec} elements)")
    strided = plgpu.Layout.WG_STRIDED((block,), vec_size=vec)
    n_in = len(inputs)

    def load(ref):
        value = ref[...]
        # The interpreter has no layouts (and no CPU rule for layout_cast).
        return value if interpret else plgpu.layout_cast(value, strided)

    def kernel(*refs):
        in_refs, out_refs = refs[:n_in], refs[n_in:]
        i = lax.axis_index("blocks")
        if isinstance(layout, Flat):
            def views_of(op):
                j = i if op.blocks is None else op.blocks(i)
                sl = pl.ds(pl.multiple_of(j * block, block), block)
                return lambda r: r.at[sl]
        else:
            per_group = layout.dist // block
            g, sl = i // per_group, pl.ds(pl.multiple_of((i % per_group) * block, block), block)

            def views_of(op):
                h = g if op.groups is None else op.groups(g)
                return lambda r: (r.at[h, 0, sl], r.at[h, 1, sl])

        def each(fn, r, op):  # apply fn to every (plane, half) view of an operand
            one = lambda v: fn(v) if not isinstance(v, tuple) else tuple(map(fn, v))  # noqa: E731
            views = views_of(op)
            if op.planes is None:
                return one(views(r))
            return [one(views(r.at[k])) for k in range(op.planes)]

        values = [each(load, r, op) for r, op in zip(in_refs, inputs)]
        if with_block:
            lanes = jnp.arange(block, dtype=jnp.uint32) if interpret else plgpu.broadcasted_iota(
                jnp.uint32, (block,), 0, layout=strided)
            values = [Block(i, lanes), *values]
        results = body(*values)
        for r, op, v in zip(out_refs, outputs, results):
            if op.per_block:
                for k, s in enumerate(v):
                    r[i, k] = s.astype(op.dtype)
                continue
            for at, val in _leaves(each(_At, r, op), v):
                at.ref[...] = val

    kernel.__name__ = name
    kw = {"interpret": _mosaic_interpret_params()} if interpret else {}
    call = plgpu.kernel(kernel, out_type=out_types, grid=(programs,), grid_names=("blocks",),
                        compiler_params=plgpu.CompilerParams(), **kw)
    return lambda *args: tuple(call(*args))


@dataclasses.dataclass(frozen=True)
class _At:
    """Where one block value of an output goes: ``ref[idx]``."""

    ref: object
    idx: object = Ellipsis


def _leaves(at, values):
    """Pairs up a (nested list/tuple of) :class:`_At` with the body's matching values."""
    if isinstance(at, _At):
        return [(at, values)]
    return [leaf for a, v in zip(at, values) for leaf in _leaves(a, v)]


def _mosaic_interpret_params():
    # The Mosaic GPU interpreter is only reachable through a private module (JAX 0.10-0.11).
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def _triton_call(body, inputs, outputs, out_types, *, layout, programs, block, interpret, name,
                 with_block):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    paired = isinstance(layout, Pairs)
    per_group = layout.dist // block if paired else 1

    def spec(op):
        if op.per_block:
            return pl.BlockSpec((1, op.per_block), lambda i: (i, 0))
        if paired:
            group = (lambda g: g) if op.groups is None else op.groups  # noqa: E731
            where = lambda i: (group(i // per_group), 0, i % per_group)  # noqa: E731
            blk = (None, 2, block)
        elif op.blocks is not None:
            where, blk = lambda i: (op.blocks(i),), (block,)  # noqa: E731
        else:
            where, blk = lambda i: (i,), (block,)  # noqa: E731
        if op.planes is None:
            return pl.BlockSpec(blk, where)
        return pl.BlockSpec((op.planes, *blk), lambda i: (0, *where(i)))

    n_in = len(inputs)

    def each(fn, r, op):  # fn(ref, index) for every (plane, half) of an operand's block
        def one(lead):
            if paired:
                return tuple(fn(r, (*lead, h, slice(None))) for h in (0, 1))
            return fn(r, (*lead, slice(None)))
        return one(()) if op.planes is None else [one((k,)) for k in range(op.planes)]

    def kernel(*refs):
        in_refs, out_refs = refs[:n_in], refs[n_in:]
        # Plain multi-axis indexing: Triton's lowering takes one indexer per access.
        values = [each(lambda ref, idx: ref[idx], r, op) for r, op in zip(in_refs, inputs)]
        if with_block:
            lanes = lax.broadcasted_iota(jnp.uint32, (block,), 0)
            values = [Block(pl.program_id(0), lanes), *values]
        results = body(*values)
        for r, op, v in zip(out_refs, outputs, results):
            if op.per_block:  # one power-of-two row per block (Triton blocks are powers of two)
                slot = lax.broadcasted_iota(jnp.int32, (1, op.per_block), 1)
                row = jnp.zeros((1, op.per_block), op.dtype)
                for k, s in enumerate(v):
                    row = jnp.where(slot == k, s.astype(op.dtype), row)
                r[...] = row
                continue
            for at, val in _leaves(each(_At, r, op), v):
                at.ref[at.idx] = val

    return pl.pallas_call(
        kernel, out_shape=out_types, grid=(programs,),
        in_specs=[spec(op) for op in inputs], out_specs=tuple(spec(op) for op in outputs),
        compiler_params=pltriton.CompilerParams(num_warps=TRITON_WARPS, num_stages=1),
        interpret=interpret, name=name)


@functools.cache
def available_backends() -> tuple[str, ...]:
    """The Pallas GPU backends the installed JAX has (Triton may be removed in a later JAX)."""
    found = []
    for backend, module in (("mosaic", "jax.experimental.pallas.mosaic_gpu"),
                            ("triton", "jax.experimental.pallas.triton")):
        try:
            __import__(module)
        except ImportError:
            continue
        found.append(backend)
    return tuple(found)

"""The GPU program, compiled without a GPU (``ciera aot``): the CUDA plugin's compile-only
H100 topology, XLA:GPU's scheduled HLO and memory count, and the report read from them.

The report's counts are checked against an independent reading of the HLO text; the
scheduled-program reader against small programs whose structure is known.
"""

from __future__ import annotations

import pathlib
import re
import tempfile
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.runtime import gpu_targets, hlo
from ciera_models.aot import schedule

H100 = gpu_targets.get_target("h100-80gb")
TOKENS = 128  # per GPU: tiny's 64-token sequences, 2 per GPU (batch 16 on 8 GPUs)


@pytest.fixture(scope="module")
def mesh8():
    return gpu_targets.compile_only_mesh(H100, 8)


def _compile(f, *args):
    return gpu_targets.compile_with(jax.jit(f).lower(*args), gpu_targets.FSDP_XLA_FLAGS)


def test_target_descriptions_compile_for_the_gpu_they_name(mesh8):
    dev = mesh8.devices.flat[0]
    assert dev.platform == "gpu" and dev.device_kind == H100.description
    assert mesh8.devices.size == 8
    text = gpu_targets.target_config(H100)
    assert f"device_memory_size: {H100.memory_bytes}" in text
    assert "major: 9 minor: 0" in text
    with pytest.raises(ValueError, match="1 to 8 GPUs or a multiple of 8"):
        gpu_targets.compile_only_mesh(H100, 12)
    with pytest.raises(KeyError, match="h100-80gb"):
        gpu_targets.get_target("h101")


def test_schedule_reads_overlap_branches_and_loop_trips(mesh8):
    """A 6-layer scan that gathers each layer's weight next to the previous layer's matmul,
    and a conditional that gathers inside a branch: the reader finds both, says which is in a
    branch, counts the loop's trips, and sees the matmul under the loop's gathers."""
    def body(x, w_DxF):
        full = lax.all_gather(w_DxF, "fsdp", tiled=True)
        return jnp.tanh(x @ full), None

    def f(x, ws, flag):
        y, _ = lax.scan(body, lax.pcast(x, ("fsdp",), to="varying"), ws)
        z = lax.cond(flag > 0, lambda v: lax.all_gather(v, "fsdp", tiled=True)[:v.shape[0]],
                     lambda v: v, y[:, :64])
        return lax.psum(jnp.sum(y) + jnp.sum(z), "fsdp")

    sm = jax.shard_map(f, mesh=mesh8, in_specs=(P(), P(None, "fsdp"), P()), out_specs=P())
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh8, P()))
    ws = jax.ShapeDtypeStruct((6, 512, 512), jnp.bfloat16,
                              sharding=NamedSharding(mesh8, P(None, "fsdp")))
    flag = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh8, P()))
    text = _compile(sm, x, ws, flag).as_text()
    prog = schedule.Program(text)
    gathers = [c for c in prog.collectives() if c.kind == "all-gather"]
    in_branch = [c for c in gathers if c.in_branch]
    loop = [c for c in gathers if not c.in_branch]
    assert len(in_branch) == 1 and in_branch[0].bytes == 8 * 256 * 64 * 2
    assert sum(c.runs for c in loop) == 6  # every layer's gather, peeled or in the loop
    assert all(c.bytes == 512 * 512 * 2 for c in loop)
    assert any(c.overlap == "gemm" for c in loop)
    assert prog.kernels()["conditionals"] == len(re.findall(r" conditional\(", text)) == 1
    assert prog.kernels()["nested_conditionals"] == 0
    assert schedule.overlap_share(gathers) > 0
    # per step: the branch that gathers is off the path; the other passes its operand through
    # (a copy of it on XLA:GPU), once a step
    steady = prog.per_step({c.computation for c in in_branch})
    assert steady["conditionals"] == 1 and steady["branch_copies"] == 1
    assert steady["copy_bytes"] >= 256 * 64 * 2
    every = prog.per_step(set())
    assert every["launches"] >= steady["launches"] > 6  # a layer's kernels, six times


def test_the_backward_reads_each_layer_s_exponents_without_copying_the_whole_stack(mesh8):
    """The backward's :func:`~ciera_jax.fsdp.regather.regather` in a layer scan, as the layer
    loop runs it: the payload gather's result is laid out with its gathered axis major on a
    GPU, and unless the cached exponents keep their own layout XLA:GPU transposes the whole
    exponent stack once, before the loop (a copy of the whole stack at once)."""
    from ciera_jax.fsdp.regather import regather

    L, E, F, D = 6, 8, 512, 512
    tensor = SimpleNamespace(axis=2, dtype=jnp.bfloat16)

    def local(x_TxD, shards_LxExFxd, exps_LxExFxD):
        def layer(x_TxD, i):
            cache = SimpleNamespace(exp=lax.dynamic_index_in_dim(exps_LxExFxD, i, keepdims=False))
            shard = lax.dynamic_index_in_dim(shards_LxExFxd, i, keepdims=False)
            w_ExFxD = regather({"w": tensor}, {"w": shard}, {"w": cache}, (("w",),), "fsdp",
                               8)["w"]
            return jnp.tanh(jnp.einsum("td,efd->tf", x_TxD, w_ExFxD)[:, :D]), None
        return lax.scan(layer, x_TxD, jnp.arange(L))[0]

    sharded, whole = NamedSharding(mesh8, P(None, None, None, "fsdp")), NamedSharding(mesh8, P())
    step = jax.shard_map(local, mesh=mesh8, in_specs=(P(), sharded.spec, P()), out_specs=P(),
                         check_vma=False)
    text = _compile(step, jax.ShapeDtypeStruct((256, D), jnp.bfloat16, sharding=whole),
                    jax.ShapeDtypeStruct((L, E, F, D), jnp.bfloat16, sharding=sharded),
                    jax.ShapeDtypeStruct((L, E, F, D), jnp.uint8, sharding=whole)).as_text()
    # a u8 array of the stack's bytes made anew: the whole stack copied or transposed
    stack_copies = [f"{i.name} = {i.type} {i.op}" for i in schedule.instructions(text)
                    if i.op in ("fusion", "transpose", "copy") and i.type.startswith("u8[")
                    and schedule.type_bytes(i.type) == L * E * F * D]
    assert not stack_copies, stack_copies


@pytest.mark.parametrize("type_text,expect", [
    ("bf16[4096,512]{1,0}", 4096 * 512 * 2),
    ("(u8[16]{0}, u32[4]{0}, pred[3]{0})", 16 + 16 + 3),
    ("f8e4m3fn[10]", 10), ("s4[8]", 8), ("f32[]", 4),
])
def test_hlo_type_bytes(type_text, expect):
    assert schedule.type_bytes(type_text) == expect


@pytest.fixture(scope="module")
def tiny_reports():
    """``ciera aot --config tiny --gpus 8`` in each gather / cache mode, compiled once."""
    from ciera_models.aot.compile import compile_step
    from ciera_models.train.config import TrainConfig

    runs = {"plain": TrainConfig(gather="plain"), "exponent": TrainConfig(cache="exponent"),
            "word": TrainConfig(cache="word")}
    texts = {}

    def compiled(name):
        if name not in texts:
            with tempfile.TemporaryDirectory() as d:
                # the word step's report also counts the PTX modules (one compile more)
                rep = compile_step(runs[name], H100, 8, TOKENS, hlo_out=d,
                                   modules=name == "word")
                (path,) = pathlib.Path(d).glob("*.hlo.txt")
                texts[name] = (rep, path.read_text())
        return texts[name]
    return compiled


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "exponent", "word"])
def test_tiny_step_compiles_for_h100s_and_the_report_counts_its_hlo(tiny_reports, mode):
    rep, text = tiny_reports(mode)
    assert rep["gpus"] == 8 and rep["batch"] == [16, 64]
    assert "cudnn" in rep["trainer"]["attention"]  # a GPU mesh: cuDNN's fused attention
    # an independent count of the scheduled text
    assert rep["fusions"] == len(re.findall(r"= \S.* fusion\(", text))
    # each fusion's kernel: the one XLA deduplicated it to, else its own
    kernels = {dedup or own for own, dedup in re.findall(
        r'%([\w.\-]+) = \S.* fusion\(.*?(?:deduplicated_name="([\w.\-]+)"|$)', text, re.M)}
    assert rep["distinct_fusions"] == len(kernels)
    assert 0 < rep["distinct_fusions"] < rep["fusions"]  # the layer loops' bodies repeat
    if mode == "word":  # XLA:GPU's compiled kernels, each dumped as PTX
        assert 0 < rep["ptx_modules"] < rep["fusions"], rep["ptx_modules"]
    else:
        assert "ptx_modules" not in rep
    # the encode program (once a run, beside the step programs): compiled and counted too
    enc = rep["encode"]
    assert enc["compile_s"] > 0 and 0 < enc["memory_total"] < rep["memory"]["total"]
    assert enc["fusions"] >= enc["distinct_fusions"]
    if mode != "plain":  # plain encodes nothing
        assert enc["fusions"] > 0 and enc["collectives"] >= 1  # the one agreement at least
    if mode == "word":
        assert 0 < enc["ptx_modules"] <= enc["fusions"]
    assert rep["conditionals"] == len(re.findall(r" conditional\(", text))
    starts = len(re.findall(r" (?:all-gather|all-reduce|reduce-scatter|collective-permute)"
                            r"-start\(", text))
    syncs = len(re.findall(r" (?:all-gather|all-reduce|reduce-scatter|all-to-all)\(", text))
    assert len(rep["collectives"]) == starts + syncs
    assert rep["hlo_bytes"] == len(text)
    mem = rep["memory"]
    assert mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] > 0
    assert mem["capacity"] == H100.memory_bytes
    assert mem["allocator"] == H100.allocator_bytes() < mem["capacity"]  # JAX's 75%
    assert mem["memory_bytes"] == mem["allocator"]  # no --memory-gb: the allocator's
    assert mem["headroom"] == mem["memory_bytes"] - mem["total"]
    modes = set(rep["trainer"]["cache_modes"].values())
    assert modes == {"none"} if mode == "plain" else mode in modes <= {mode, "none"}
    if mode == "plain":
        assert rep["conditionals"] == 0 and not any(c["in_branch"] for c in rep["collectives"])


@pytest.mark.slow
def test_tiny_step_gpu_memory_does_not_grow(tiny_reports):
    """A regression bound on XLA's own count, with the blocked expert matmul on GPU meshes
    and the steady program (rungs fixed). The compressed step may add its caches and the
    codec's working set (a layer's unpacked codes, dense and filled words, escape flags), not
    more. The encode program runs after the step, not beside it, so its own count (below the
    step's: test above) adds nothing to the peak."""
    plain, _ = tiny_reports("plain")
    word, _ = tiny_reports("word")
    assert plain["memory"]["total"] < 1.25 * 4.01e6
    extra = word["memory"]["total"] - plain["memory"]["total"]
    assert extra < word["trainer"]["cache_bytes"] + 1.0e6, extra


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exponent", "word"])
def test_the_steady_gpu_program_holds_no_conditional(tiny_reports, mode):
    """On GPUs a step runs a program whose rungs hold its demand (``--fallback program``, the
    default there): no conditional at all, so no host sync and no collective in a branch; its
    kernels and HLO stay within 1.5x and 2x of plain's."""
    rep, text = tiny_reports(mode)
    plain, _ = tiny_reports("plain")
    assert rep["trainer"]["cache_modes"] and any(
        m != "none" for m in rep["trainer"]["cache_modes"].values())
    assert rep["conditionals"] == 0 and rep["steady_conditionals_per_step"] == 0
    assert not [c for c in rep["collectives"] if c["in_branch"]]
    assert " conditional(" not in text
    assert rep["fusions"] <= 1.5 * plain["fusions"]
    assert rep["hlo_bytes"] <= 2 * plain["hlo_bytes"]


def test_plan_memory_limit_puts_xlas_scheduler_at_the_plan():
    """XLA's scheduler limit (slop % of 80% of the GPU less the inputs and outputs) lands on
    the plan's total, within a percent of the base; never above XLA's default 95%."""
    io = 5_190_886_038  # OLMoE-1B-7B plain on 16 H100s: params and AdamW state
    for plan in (12e9, 22e9, 40e9, 60e9):
        slop = gpu_targets.plan_slop_percent(H100, io, int(plan))
        limit = io + gpu_targets.scheduler_limit_bytes(H100, io, slop)
        assert 1 <= slop <= gpu_targets.DEFAULT_SLOP_PERCENT
        if slop < gpu_targets.DEFAULT_SLOP_PERCENT:
            assert plan - 0.01 * H100.memory_bytes < limit <= plan
    assert gpu_targets.plan_slop_percent(H100, io, int(80e9)) == gpu_targets.DEFAULT_SLOP_PERCENT
    assert gpu_targets.plan_slop_percent(H100, io, io // 2) == 1  # a plan below its inputs


def test_compiler_options_carry_the_limit_only_when_given():
    limited = gpu_targets.compiler_options("fsdp", 23)
    assert limited.pop(gpu_targets.SLOP_FLAG) == 23
    assert limited == gpu_targets.compiler_options("fsdp") == gpu_targets.FSDP_XLA_FLAGS
    assert gpu_targets.compiler_options("default") == {}
    with pytest.raises(ValueError, match="fsdp"):
        gpu_targets.compiler_options("fast")


class _NewerXla:
    """A lowered step whose XLA is jaxlib 0.11's as the first GPU run met it: the pipelined-
    collective booleans are no compile options there (``xla_gpu_pipeline_*`` enums are), and
    ``dropped`` is no option at all."""

    def __init__(self):
        self.tries: list[dict] = []

    def compile(self, compiler_options=None):
        opts = dict(compiler_options or {})
        self.tries.append(opts)
        for name, value in opts.items():
            if name.startswith("xla_gpu_enable_pipelined_") or name == "dropped":
                raise jax.errors.JaxRuntimeError(
                    f"INVALID_ARGUMENT: No such compile option: '{name}'")
            if name.startswith("xla_gpu_pipeline_") and not value.startswith("COLLECTIVE_"):
                raise jax.errors.JaxRuntimeError(f"INVALID_ARGUMENT: While setting option "
                                                 f"{name}, '{value}' is not a valid enum value.")
        return opts


def test_options_a_newer_xla_renamed_compile_under_their_new_names(monkeypatch):
    """The FSDP set on jaxlib 0.11's XLA: each pipelined collective's boolean becomes its enum
    (true: on), learned from the compile's own refusal, once per process; an option XLA does
    not know at all is left out with a warning; any other failure is raised as it is."""
    monkeypatch.setattr(gpu_targets, "_unknown_here", set())
    xla = _NewerXla()
    flags = {**gpu_targets.FSDP_XLA_FLAGS, "xla_gpu_enable_pipelined_reduce_scatter": False}
    with pytest.warns(RuntimeWarning, match="XLA option dropped is not known"):
        used = gpu_targets.compile_with(xla, {**flags, "dropped": 1})
    assert used["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"
    assert used["xla_gpu_pipeline_reduce_scatter"] == "COLLECTIVE_PIPELINING_MODE_DEFAULT"
    assert used["xla_gpu_pipeline_all_reduce"] == "COLLECTIVE_PIPELINING_MODE_ON"
    assert not any("enable_pipelined" in k for k in used) and "dropped" not in used
    assert used["xla_gpu_enable_latency_hiding_scheduler"] is True and len(used) == len(flags)
    assert len(xla.tries) == 5  # one refusal per unknown name (3 renamed, 1 dropped), then done
    again = _NewerXla()
    assert gpu_targets.compile_with(again, flags) == used and len(again.tries) == 1  # learned
    assert gpu_targets.for_this_xla(flags) == used
    with pytest.raises(jax.errors.JaxRuntimeError, match="not a valid enum"):
        gpu_targets.compile_with(_NewerXla(), {"xla_gpu_pipeline_all_gather": "on"})


def test_the_fsdp_set_compiles_on_the_installed_xla(mesh8):
    """Whatever the installed jaxlib calls them, the FSDP set compiles a step for the GPU, and
    the names it compiled with are the ones the report shows (``for_this_xla``)."""
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=NamedSharding(mesh8, P("fsdp")))
    lowered = jax.jit(lambda a: a.sum(0)).lower(x)
    gpu_targets.compile_with(lowered, gpu_targets.FSDP_XLA_FLAGS)
    used = gpu_targets.for_this_xla(gpu_targets.FSDP_XLA_FLAGS)
    assert len(used) == len(gpu_targets.FSDP_XLA_FLAGS)
    assert gpu_targets.compile_with(lowered, used) is not None


def test_the_trainer_compiles_gpu_steps_with_the_flags_the_report_names(mesh8):
    """``ciera train`` on GPUs compiles each program with ``--xla-flags``' set, the one ``ciera
    aot`` reports with; on CPU devices with none."""
    import dataclasses

    from ciera_models.train import TrainConfig, build_trainer, make_mesh

    tr = build_trainer(TrainConfig(config="tiny", schedule_steps=4, gather="plain"),
                       make_mesh(8))
    assert tr.compiler_options == {}
    on_gpus = dataclasses.replace(tr, mesh=mesh8)
    assert on_gpus.compiler_options == gpu_targets.FSDP_XLA_FLAGS
    default = dataclasses.replace(on_gpus, tc=dataclasses.replace(tr.tc, xla_flags="default"))
    assert default.compiler_options == {}


@pytest.mark.parametrize("limit,first,second,kept,compiles", [
    ("auto", 35e9, 28e9, 28e9, 2),  # XLA over the room: again at the plan's limit, smaller kept
    ("auto", 35e9, 36e9, 35e9, 2),  # the limit did not help: XLA's default kept
    ("auto", 25e9, None, 25e9, 1),  # over the model but within the room: XLA's own schedule
    ("auto", 18e9, None, 18e9, 1),  # XLA within the plan: one compile
    ("gpu", 35e9, None, 35e9, 1),
    ("plan", 19e9, None, 19e9, 1),
])
def test_auto_limit_compiles_again_only_when_xla_exceeds_the_room(limit, first, second, kept,
                                                                   compiles):
    from ciera_models.train import memory_limit

    io = int(5.2e9)
    sched = memory_limit.SchedulerLimit(H100, io, int(20e9), memory_limit.room_bytes(H100, 34.0))
    assert sched.room_bytes == 30e9  # --memory-gb 34 less the planner's 4 GB of headroom
    assert memory_limit.room_bytes(H100, None) == memory_limit.room_bytes(H100, 1e3) == int(
        H100.memory_bytes - 4e9)  # the GPU's, never more
    assert sched.slop == gpu_targets.plan_slop_percent(H100, io, int(20e9)) < 95
    seen = []

    def compile_at(slop):
        seen.append(slop)
        return first if len(seen) == 1 else second

    got, other = memory_limit.compile_within(sched, limit, compile_at, lambda total: total)
    assert got == kept and len(seen) == compiles
    assert (other is None) == (compiles == 1)
    assert seen[0] == (sched.slop if limit == "plan" else None)
    if compiles == 2:
        assert seen[1] == sched.slop
    with pytest.raises(ValueError, match="memory_limit"):
        memory_limit.compile_within(sched, "none", compile_at, lambda total: total)


@pytest.mark.parametrize("limit,counts,said", [
    ("auto", [36.5e9, 36.5e9], True),  # over the room, and the plan's limit did not help
    ("auto", [35e9, 33.5e9], False),  # the plan's limit made it fit
    ("auto", [33e9, 33e9], False),  # over the room, within the memory: runs
    ("plan", [36.5e9], True),
    ("plan", [33e9], False),
    ("gpu", [36.5e9], True),
])
def test_a_step_that_will_not_fit_says_so_and_the_memory_gb_that_plans_it_smaller(limit, counts,
                                                                                   said):
    """XLA's count of the kept schedule above the memory the step has (the room and the
    planner's headroom: --memory-gb 34 here) is one line, whatever the limit; a step that
    fits says nothing."""
    from ciera_models.train import memory_limit

    sched = memory_limit.SchedulerLimit(H100, int(5.2e9), int(20e9), memory_limit.room_bytes(H100, 34.0))
    assert sched.memory_bytes == 34e9
    lines, seen = [], iter(counts)
    memory_limit.compile_within(sched, limit, lambda slop: next(seen), lambda t: t, lines.append)
    over = [line for line in lines if "will not run" in line]
    assert over == (["ciera: XLA counts 36.5 GB per device for this step, 2.5 GB more than the "
                     "34.0 GB it may hold: it will not run. The memory model counted 20.0 GB; "
                     "--memory-gb 31 plans the caches that much smaller"] if said else [])


@pytest.mark.parametrize("env, share", [
    ({}, 0.75),  # the GPU client's default, preallocated or not
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 0.75),
    ({"XLA_CLIENT_MEM_FRACTION": ".9"}, 0.9),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, 0.5),  # the deprecated name
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_CLIENT_MEM_FRACTION": ".5"}, 1.0),
])
def test_a_compile_without_the_gpu_plans_within_what_jax_s_allocator_may_hold(env, share):
    """``ciera aot`` plans and judges the fit against the allocator's share of the GPU, as
    ``ciera train`` reads it from a run's ``bytes_limit``, not the whole GPU."""
    from ciera_jax.runtime import gpu_targets

    assert gpu_targets.allocator_share(env) == share
    assert H100.allocator_bytes(env) == int(H100.memory_bytes * share)
    with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION must be a number"):
        gpu_targets.allocator_share({"XLA_CLIENT_MEM_FRACTION": "most"})
    with pytest.raises(ValueError, match="must be positive"):
        gpu_targets.allocator_share({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0"})


def test_the_room_on_a_gpu_is_what_this_process_s_allocator_may_hold(monkeypatch):
    """On a GPU without ``--memory-gb`` the plan's memory (the cache budget's, and the room the
    scheduler limit is checked against) is this process's device's allocator limit:
    ``jax.devices()[0]`` is process 0's on a pod, and its stats are not this process's."""
    import types

    from ciera_models.train import memory_limit
    from ciera_models.train import compression
    from ciera_models.train import TrainConfig

    local = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": int(60e9)})
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [local])
    monkeypatch.setattr(jax, "devices", lambda *a, **k: pytest.fail("not this process's"))
    tc = TrainConfig(config="tiny")
    assert compression.memory_gb(tc, "gpu") == 60.0
    assert memory_limit.room_bytes(H100, compression.memory_gb(tc, "gpu")) == 56e9
    assert compression.memory_gb(TrainConfig(config="tiny", memory_gb=24.0), "gpu") == 24.0
    assert compression.memory_gb(tc, "cpu") is None
    local.memory_stats = lambda: None  # a backend that reports nothing: unknown, not zero
    assert compression.memory_gb(tc, "gpu") is None


@pytest.mark.parametrize("limit", ["plan", "gpu"])
def test_the_trainer_compiles_gpu_steps_within_the_limit_the_report_names(monkeypatch, mesh8,
                                                                          limit):
    """``ciera train`` on GPUs passes XLA the scheduler limit ``--memory-limit`` names, derived
    from the plan as ``ciera aot`` derives it (the plan's slop factor, or none for XLA's)."""
    import jax.stages

    from ciera_jax.kernels.backend import lowering_for
    from ciera_models.aot import compile as aot
    from ciera_models.train import memory_limit
    from ciera_models.train import TrainConfig, build_trainer

    assert gpu_targets.target_of(mesh8.devices.flat[0]) == H100
    tc = TrainConfig(config="tiny", schedule_steps=4, gather="plain", memory_limit=limit)
    options = []
    compile_ = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):
        options.append(dict(compiler_options or {}))
        return compile_(self, compiler_options=compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    with lowering_for("cuda", capability=H100.compute_capability):
        tr = build_trainer(tc, mesh8)
        args = tr.at_rungs(aot.abstract_step_args(tr), "priming")
        compiled = tr.compile(args)
    sched = memory_limit.scheduler_limit(tr, args, H100, tc.batch_size * tc.length // 8)
    assert sched.slop < gpu_targets.DEFAULT_SLOP_PERCENT  # tiny plans far below an H100
    assert options[-1:] == [gpu_targets.for_this_xla(gpu_targets.compiler_options(
        "fsdp", sched.slop if limit == "plan" else None))]
    assert len(options) <= 1 + len(gpu_targets.RENAMED_OPTIONS)  # one compile, or each refusal
    assert memory_limit.xla_total(compiled.memory_analysis()) > sched.io_bytes


BUFFER_ASSIGNMENT = """\
allocation 0: size 1024, parameter 0, shape |f32[256]| at ShapeIndex {}:
 value: <0 p0 @0> (size=1024,offset=0): f32[256]{0}
allocation 5: size 41943056, preallocated-temp:
 value: <11 all-gather-start{} @0> (size=16,offset=41943040): (f32[1,1024,256]{2,1,0}, f32[8,1024,256]{2,1,0})
 value: <12 all-gather-start{1} @0> (size=8388608,offset=33554432): f32[8,1024,256]{2,1,0}
 value: <13 gemm_fusion_dot @0> (size=33554432,offset=0): f32[8192,1024]{1,0}
 value: <14 loop_add_fusion @0> (phi) (size=33554432,offset=0): f32[8192,1024]{1,0}
 value: <15 gemm_fusion_dot @0> (size=33554432,offset=0): f32[8192,1024]{1,0}
allocation 6: size 4, output shape is |f32[]|, maybe-live-out:
 value: <16 reduce @0> (size=4,offset=0): f32[]
"""


def test_temp_slots_read_the_preallocated_temp_buffer_largest_first():
    """One slot per (offset, size) of the temporary buffer, the values that reuse it named once
    each in dump order; other allocations are not temporaries."""
    slots = hlo.temp_slots(BUFFER_ASSIGNMENT)
    assert [(s["size"], s["offset"]) for s in slots] == [
        (33554432, 0), (8388608, 33554432), (16, 41943040)]
    assert slots[0]["values"] == ["gemm_fusion_dot", "loop_add_fusion"]
    assert slots[0]["shape"] == "f32[8192,1024]{1,0}" and slots[1]["values"] == [
        "all-gather-start"]
    assert hlo.temp_slots("allocation 0: size 4, parameter 0:\n") == []


def test_largest_temporaries_are_xla_gpus_own(mesh8):
    """``ciera aot --temporaries``: a gathered weight's matmul, compiled for 8 H100s; the
    largest temporary is the product (8192 x 1024 f32, 32 MiB), and no slot is larger than the
    temporaries XLA's memory count gives."""
    from ciera_models.aot import compile as aot

    x = jax.ShapeDtypeStruct((8, 1024, 256), jnp.float32, sharding=NamedSharding(mesh8, P("fsdp")))

    def f(a):
        full = lax.all_gather(a, "fsdp", tiled=True)  # (8, 1024, 256) on every GPU
        return jnp.tanh(full.reshape(8192, 256) @ a[0].T).sum(0)[None]

    lowered = jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P("fsdp"),
                                    out_specs=P("fsdp"))).lower(x)
    slots = aot.largest_temporaries(lowered, gpu_targets.FSDP_XLA_FLAGS, 2)
    temp = gpu_targets.compile_with(lowered, gpu_targets.FSDP_XLA_FLAGS).memory_analysis()
    assert len(slots) == 2 and slots[0]["size"] >= slots[1]["size"]
    assert slots[0]["size"] == 8192 * 1024 * 4 and slots[0]["shape"].startswith("f32[8192,1024]")
    assert slots[0]["size"] <= temp.temp_size_in_bytes

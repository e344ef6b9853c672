"""GPUs that are not there: target descriptions of shipped GPU models, and compile-only meshes of
a cluster of them, so XLA:GPU compiles (fusion, latency-hiding scheduling, async collectives,
buffer assignment) on a machine without a GPU. MaxText's ``train_compile.py`` does the same for
TPU slices; this is what ``ciera aot`` compiles on.

Needs JAX's CUDA plugin (``pip install -e ".[gpu-aot]"``: the plugin equal to the installed
jaxlib). :func:`prepare_environment` must run before JAX starts its backends: the plugin's
version check reads cuPTI, which needs a driver, so it is skipped, and no device is looked for.
CPU devices keep working in the same process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import warnings

# The XLA flags NVIDIA's JAX-Toolbox recommends for FSDP training on GPUs (rosetta/docs/
# GPU_performance.md): the latency-hiding scheduler; pipelined (loop-hoisted) all-gather,
# reduce-scatter and all-reduce; while-loop double buffering, so a layer loop's gather of layer
# l+1 can run under layer l; no combining across dimensions (it serializes FSDP's gathers); the
# collectives' stream first. Both modes of a comparison compile with the same flags: a plain
# step that is poorly scheduled is no baseline.
FSDP_XLA_FLAGS: dict[str, bool] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_all_gather_combine_by_dim": False,
    "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
    "xla_gpu_enable_highest_priority_async_stream": True,
}
FLAG_SETS = {"fsdp": FSDP_XLA_FLAGS, "default": {}}
GPU_PLATFORMS = ("gpu", "cuda")  # what jax.Device.platform says of an NVIDIA GPU
GPUS_PER_HOST = 8

# XLA:GPU's scheduler memory limit (gpu_hlo_schedule.cc, GetSchedulerMemoryLimit): temporaries
# up to slop % of (80% of the GPU's memory less the step's inputs and outputs). The latency-
# hiding scheduler keeps buffers live to overlap collectives until it reaches the limit, so
# XLA's count grows with the room it is given (docs/results.md); the limit bounds it.
SCHEDULER_BASE_SHARE = 0.8
SLOP_FLAG = "xla_gpu_memory_limit_slop_factor"
DEFAULT_SLOP_PERCENT = 95  # XLA's default
# Where a train step sets that limit (ciera_models.train.memory_limit): auto, the plan's, XLA's own.
MEMORY_LIMITS = ("auto", "plan", "gpu")
# The share of a GPU's memory JAX's allocator may hold when the environment names none: the GPU
# client's default, preallocated or not (XLA's BFC allocator is sized to it and only grows to it).
DEFAULT_ALLOCATOR_SHARE = 0.75
# What jaxlib's GPU client reads (xla_client.py); the second name is the deprecated one.
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def allocator_share(env=None) -> float:
    """The share of a GPU's memory JAX's allocator may hold in a process started with ``env``
    (default: this one's): ``XLA_CLIENT_MEM_FRACTION`` (or the deprecated
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``), else :data:`DEFAULT_ALLOCATOR_SHARE`; all of it with
    ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (no pool, no limit). What a run's
    ``memory_stats()["bytes_limit"]`` reports, for a compile without the GPU (``ciera aot``)."""
    env = os.environ if env is None else env
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0
    for var in MEM_FRACTION_VARS:
        if env.get(var):
            try:
                share = float(env[var])
            except ValueError:
                raise ValueError(f"{var} must be a number, got {env[var]!r}") from None
            if not 0 < share:
                raise ValueError(f"{var} must be positive, got {env[var]!r}")
            return share
    return DEFAULT_ALLOCATOR_SHARE


def is_gpu(platform: str) -> bool:
    """Whether devices of ``platform`` (``jax.Device.platform``) are GPUs."""
    return platform in GPU_PLATFORMS


def compiler_options(flags: str, slop_percent: int | None = None) -> dict:
    """XLA:GPU's options for a step: the flag set (:data:`FLAG_SETS`), with the scheduler
    memory limit at ``slop_percent`` (None: XLA's). ``ciera train`` on GPUs and ``ciera aot``
    compile with the same, so the report is the program a pod runs."""
    if flags not in FLAG_SETS:
        raise ValueError(f"unknown XLA flag set {flags!r}; choose one of: {', '.join(FLAG_SETS)}")
    opts = dict(FLAG_SETS[flags])
    if slop_percent is not None:
        opts[SLOP_FLAG] = slop_percent
    return opts


# Options a newer XLA renamed, the old name no longer a compile option there: the new name and
# the old value's meaning in it. jaxlib 0.11's XLA made each pipelined collective an enum
# (DebugOptions.CollectivePipeliningMode); its flag parser maps the old booleans (true: on,
# false: default), but compile options name proto fields, so the old names fail the compile
# ("No such compile option"; found on the first GPU run of `ciera train`, an H100).
_PIPELINE_MODE = {True: "COLLECTIVE_PIPELINING_MODE_ON",
                  False: "COLLECTIVE_PIPELINING_MODE_DEFAULT"}
RENAMED_OPTIONS: dict[str, tuple[str, dict]] = {
    f"xla_gpu_enable_pipelined_{c}": (f"xla_gpu_pipeline_{c}", _PIPELINE_MODE)
    for c in ("all_gather", "reduce_scatter", "all_reduce")}
_UNKNOWN_OPTION = re.compile(r"No such compile option: '([^']+)'")
_unknown_here: set[str] = set()  # options this process's XLA named unknown (one jaxlib each)


def for_this_xla(options: dict) -> dict:
    """``options`` in the names this process's XLA knows, as far as a compile has told:
    renamed ones (:data:`RENAMED_OPTIONS`) under their new name, unknown ones left out."""
    known = {}
    for name, value in options.items():
        if name in _unknown_here and name in RENAMED_OPTIONS:
            new, values = RENAMED_OPTIONS[name]
            name, value = new, values.get(value, value)
        if name not in _unknown_here:
            known[name] = value
    return known


def compile_with(lowered, options: dict | None):
    """``lowered.compile`` with ``options`` (XLA compile options) in this XLA's names. A name
    the compile refuses as unknown is learned (once per process): renamed if
    :data:`RENAMED_OPTIONS` knows its new name, else left out with a warning, and the compile
    runs again. Any other failure is raised as it is."""
    while True:
        opts = for_this_xla(options or {})
        try:
            return lowered.compile(compiler_options=opts or None)
        except Exception as e:  # jax.errors.JaxRuntimeError; JAX is not imported here
            unknown = _UNKNOWN_OPTION.search(str(e))
            if unknown is None or unknown[1] not in opts or unknown[1] in _unknown_here:
                raise
            _unknown_here.add(unknown[1])
            if unknown[1] not in RENAMED_OPTIONS:
                warnings.warn(f"XLA option {unknown[1]} is not known to this jaxlib's XLA; "
                              "compiling without it", RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def compile_only():
    """Compiles for GPUs this process does not have (a compile-only mesh) within: such an
    executable cannot be loaded back from JAX's persistent compilation cache (it has no client
    to load into), so none is written there."""
    import jax  # only here: this module is read without JAX (the planner's tables)

    key = "jax_persistent_cache_min_compile_time_secs"
    was = getattr(jax.config, key)
    jax.config.update(key, float("inf"))
    try:
        yield
    finally:
        jax.config.update(key, was)


def plan_slop_percent(t: "GpuTarget", io_bytes: int, plan_bytes: int) -> int:
    """The slop factor that puts XLA's scheduler limit at ``plan_bytes`` per GPU in all (the
    step's inputs and outputs, ``io_bytes``, included): what the memory model planned, so the
    scheduler does not spend memory the plan gave to caches or headroom. Never more than XLA's
    default (nor below 1)."""
    base = int(t.memory_bytes * SCHEDULER_BASE_SHARE) - io_bytes
    if base <= 0:
        return DEFAULT_SLOP_PERCENT
    return max(1, min(DEFAULT_SLOP_PERCENT, (plan_bytes - io_bytes) * 100 // base))


def scheduler_limit_bytes(t: "GpuTarget", io_bytes: int, slop_percent: int) -> int:
    """XLA's scheduler limit on temporaries at ``slop_percent``."""
    return max(0, int(t.memory_bytes * SCHEDULER_BASE_SHARE) - io_bytes) * slop_percent // 100


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU model as XLA:GPU's ``GpuDeviceInfoProto`` describes it. ``source`` says where
    each number comes from."""

    name: str
    description: str  # what the CUDA driver calls the device
    memory_bytes: int
    memory_bandwidth_Bps: int
    sm_count: int
    compute_capability: tuple[int, int]
    clock_ghz: float
    l2_bytes: int
    shared_per_sm: int
    shared_per_block_optin: int
    source: str
    shared_per_block: int = 48 * 1024
    threads_per_block: int = 1024
    threads_per_sm: int = 2048
    registers_per_sm: int = 64 * 1024
    registers_per_block: int = 64 * 1024
    fp32_per_sm: int = 128

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / 1e9

    def allocator_bytes(self, env=None) -> int:
        """What JAX's allocator may hold of this GPU in a run started with ``env``
        (:func:`allocator_share`): the memory a step and its caches must fit in."""
        return int(self.memory_bytes * allocator_share(env))


_HOPPER = dict(sm_count=132, compute_capability=(9, 0), clock_ghz=1.98, l2_bytes=50 * 1024**2,
               shared_per_sm=228 * 1024, shared_per_block_optin=227 * 1024)
_HOPPER_SOURCE = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (SXM5: 132 SMs, 50 MB "
                  "L2, 228 KB shared memory per SM, 227 KB per block opt-in, 64K registers per "
                  "SM, 1.98 GHz boost) and CUDA's per-compute-capability limits for 9.0")
TARGETS: dict[str, GpuTarget] = {t.name: t for t in (
    GpuTarget("h100-80gb", "NVIDIA H100 80GB HBM3", memory_bytes=81559 * 1024**2,
              memory_bandwidth_Bps=3_350_000_000_000, **_HOPPER,
              source=_HOPPER_SOURCE + "; memory: 81,559 MiB as nvidia-smi reports an H100 SXM5 "
              "80GB; bandwidth 3.35 TB/s (H100 datasheet, SXM)"),
    GpuTarget("h200-141gb", "NVIDIA H200", memory_bytes=143771 * 1024**2,
              memory_bandwidth_Bps=4_800_000_000_000, **_HOPPER,
              source=_HOPPER_SOURCE + "; memory: 143,771 MiB as nvidia-smi reports an H200 SXM "
              "141GB; bandwidth 4.8 TB/s (H200 datasheet)"),
)}


def target_of(device) -> GpuTarget | None:
    """The target whose description is ``device``'s kind (a GPU here, or a compile-only one),
    None for a GPU model not in :data:`TARGETS`."""
    return next((t for t in TARGETS.values() if t.description == device.device_kind), None)


def get_target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise KeyError(f"unknown GPU {name!r}; choose one of: {', '.join(TARGETS)}")
    return TARGETS[name]


def _installed_version(dist: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    try:
        parts = importlib.metadata.version(dist).split(".")
        return tuple(int(p) for p in (parts + ["0", "0"])[:3])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return default


def target_config(t: GpuTarget) -> str:
    """The ``GpuTargetConfigProto`` text the CUDA plugin compiles for. cuDNN and the CUDA
    runtime are the installed ones (what a GPU machine with this install would run)."""
    dnn = _installed_version("nvidia-cudnn-cu13", (9, 8, 0))
    runtime = _installed_version("nvidia-cuda-runtime", (13, 0, 0))
    info = {
        "threads_per_block_limit": t.threads_per_block, "threads_per_warp": 32,
        "shared_memory_per_block": t.shared_per_block, "shared_memory_per_core": t.shared_per_sm,
        "threads_per_core_limit": t.threads_per_sm, "core_count": t.sm_count,
        "fpus_per_core": t.fp32_per_sm, "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": t.memory_bandwidth_Bps, "l2_cache_size": t.l2_bytes,
        "clock_rate_ghz": t.clock_ghz, "device_memory_size": t.memory_bytes,
        "shared_memory_per_block_optin": t.shared_per_block_optin,
        "registers_per_core_limit": t.registers_per_sm,
        "registers_per_block_limit": t.registers_per_block,
    }
    major, minor = t.compute_capability
    lines = ["gpu_device_info {", *(f"  {k}: {v}" for k, v in info.items()),
             f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
             'platform_name: "CUDA"',
             f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}",
             f"runtime_version {{ major: {runtime[0]} minor: {runtime[1]} }}",
             f'device_description_str: "{t.description}"']
    return "\n".join(lines) + "\n"


def plugin_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def prepare_environment() -> None:
    """Before JAX starts: no GPU is looked for, and the plugin's driver check is skipped."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def check_cluster(gpus: int) -> None:
    """One-line errors, before anything compiles: the cluster's shape, and the plugin."""
    if gpus < 1 or (gpus > GPUS_PER_HOST and gpus % GPUS_PER_HOST):
        raise ValueError(f"--gpus {gpus}: use 1 to {GPUS_PER_HOST} GPUs or a multiple of "
                         f"{GPUS_PER_HOST} (hosts of {GPUS_PER_HOST})")
    if not plugin_installed():
        raise ValueError("compiling for a GPU needs JAX's CUDA plugin, equal to the installed "
                         'jaxlib: pip install -e ".[gpu-aot]"')


def compile_only_mesh(t: GpuTarget, gpus: int, axis_names: tuple[str, ...] = ("fsdp",)):
    """A mesh of ``gpus`` compile-only devices of ``t``, hosts of :data:`GPUS_PER_HOST`, all
    on the first of ``axis_names``."""
    check_cluster(gpus)
    from jax.experimental import topologies

    hosts, per_host = max(1, gpus // GPUS_PER_HOST), min(gpus, GPUS_PER_HOST)
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(t),
                                        topology=f"1x{hosts}x{per_host}")
    shape = (gpus,) + (1,) * (len(axis_names) - 1)
    return topologies.make_mesh(topo, shape, tuple(axis_names))

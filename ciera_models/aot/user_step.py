"""A user's own train step compiled for GPUs that are not there, reported as ``ciera aot``
reports the trainer's: pre-flight for the step your own loop runs.

``build(mesh)`` gets a compile-only mesh of the cluster (``gpus`` devices on one ``fsdp``
axis; reshape ``mesh.devices`` for more axes) and returns ``(step, args)``: the step (a
``jax.jit`` function, or any function, which is jitted) and its arguments, abstract
(``jax.ShapeDtypeStruct`` with shardings on that mesh; nothing is allocated). It is called
while the codec's kernels resolve as on the target GPU (``lowering_for``), and the step is
lowered under ``jax.set_mesh(mesh)``. ``ciera aot --step module:function`` calls
:func:`compile_user_step` with an importable ``build``.
"""

from __future__ import annotations

import importlib
import time
from typing import Callable

import jax

from ciera_jax.collective import lowering_for
from ciera_jax.runtime import gpu_targets
from ciera_models.aot.compile import compile_lowered

# the report's keys (beside the counts of ``schedule.Program.kernels``)
REPORT_KEYS = ("gpus", "gpu", "flags", "lower_s", "compile_s", "compile_cpu_s", "fusions",
               "conditionals", "steady_conditionals_per_step", "conditionals_per_step",
               "all_gathers_in_branches", "steady_launches_per_step",
               "all_gather_overlap_share", "memory")


def load_builder(spec: str) -> Callable:
    """``"package.module:function"`` -> that function (``--step``); one-line errors."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--step {spec!r}: write it as module:function (an importable "
                         "module and a function in it that builds the step)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--step {spec!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"--step {spec!r} names {type(fn).__name__}, not a function")
    return fn


@gpu_targets.compile_only()
def compile_user_step(build: Callable, gpus: int = 8, gpu: str = "h100-80gb",
                      xla_flags: str = "fsdp", hlo_out: str | None = None) -> dict:
    """Compile the step ``build`` makes for ``gpus`` x ``gpu`` with XLA:GPU and ``xla_flags``
    (the flag sets ``ciera train`` uses) and report it: kernels (``fusions``,
    ``steady_launches_per_step``), ``conditionals`` in the program, those a step executes
    weighted by its loops' trip counts (``steady_conditionals_per_step``: the steady path;
    ``conditionals_per_step``: every branch's too), all-gathers inside conditional branches,
    the share of all-gather bytes overlapped with compute and XLA's memory count per GPU."""
    target = gpu_targets.get_target(gpu)
    mesh = gpu_targets.compile_only_mesh(target, gpus)
    t0 = time.perf_counter()
    with lowering_for("cuda", capability=target.compute_capability), jax.set_mesh(mesh):
        step, args = build(mesh)
        lowered = (step if hasattr(step, "lower") else jax.jit(step)).lower(*args)
    lower_s = time.perf_counter() - t0
    c = compile_lowered(lowered, gpu_targets.compiler_options(xla_flags))
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(c.text)
    ma = c.memory
    return {"gpus": gpus, "gpu": target.name, "flags": xla_flags, "lower_s": lower_s,
            "compile_s": c.wall_s, "compile_cpu_s": c.cpu_s, **c.kernels,
            "all_gather_overlap_share": c.overlap,
            "memory": {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
                       "temp": ma.temp_size_in_bytes, "total": c.total,
                       "capacity": target.memory_bytes}}

"""``ciera train --inject-cache-fault STEP[:RANK[:TENSOR]]``: a drill of the gathers' self-check.

Before step STEP (first attempt only) a few random bits of one rank's copy of one tensor's
cache are flipped, as an HBM upset would. That step's JSONL row shows ``verify_failed >= 1``,
the step is not applied, the failed caches re-prime, the batch runs again, and the run ends
with the same ``params_sha256`` as one without the fault.
"""

from __future__ import annotations

import dataclasses
import math

from ciera_jax import fsdp
from ciera_models.resilience import corrupt as faults

FLIPPED_BITS = 8  # several, so one landing on an element whose exponent moves anyway still
                  # leaves others that the check must see


@dataclasses.dataclass(frozen=True)
class CacheFault:
    step: int
    rank: int = 0
    tensor: str | None = None  # None: the largest compressed tensor


def parse_fault(text: str | None) -> CacheFault | None:
    """``STEP[:RANK[:TENSOR]]`` -> :class:`CacheFault` (ValueError with the format if bad)."""
    if not text:
        return None
    parts = text.split(":", 2)
    try:
        step = int(parts[0])
        rank = int(parts[1]) if len(parts) > 1 and parts[1] else 0
    except ValueError:
        raise ValueError(f"--inject-cache-fault {text!r}: expected STEP[:RANK[:TENSOR]], "
                         "e.g. 5 or 5:2 or 5:0:layers/mlp/w_up_ExDxF") from None
    if step < 1 or rank < 0:
        raise ValueError(f"--inject-cache-fault {text!r}: STEP must be >= 1 and RANK >= 0")
    return CacheFault(step, rank, parts[2] if len(parts) > 2 and parts[2] else None)


def check_fault_step(fault: CacheFault, steps: int, start: int = 0) -> None:
    """ValueError unless the fault's step is one the run trains and checks: within
    ``start + 2 .. steps``. Step ``start + 1`` (the first step, also after a resume) primes the
    caches with a plain gather, which overwrites them: a fault there is never seen."""
    if fault.step > steps:
        raise ValueError(f"--inject-cache-fault step {fault.step} is past the end (--steps "
                         f"{steps}); pick a step from {start + 2} to {steps}")
    if fault.step <= start:
        raise ValueError(f"--inject-cache-fault step {fault.step} was already trained (the "
                         f"run resumes at step {start + 1}); pick a step from {start + 2} to "
                         f"{steps}")
    if fault.step == start + 1:
        raise ValueError(f"--inject-cache-fault step {fault.step} cannot be checked: it is the "
                         "first step" + (" after the resume" if start else "") + ", whose "
                         "priming gather overwrites every cache; pick a step from "
                         f"{start + 2} to {steps}")


def check_fault(fault: CacheFault, tr) -> str:
    """The tensor the fault hits; a clear error if it cannot hit one."""
    if tr.tc.gather != "ciera":
        raise ValueError("--inject-cache-fault drills the CIERA gather's self-check: it needs "
                         f"--gather ciera (got {tr.tc.gather})")
    if tr.beside:
        raise ValueError("--inject-cache-fault drills the self-check of a compressed step; "
                         "with programs compiled beside the steps (--compile-beside, on by "
                         "default off CPUs) the steps before the compressed program is there "
                         "gather plainly and overwrite the fault unseen: pass --compile-beside "
                         "off")
    if fault.rank >= tr.n:
        raise ValueError(f"--inject-cache-fault: rank {fault.rank} is not among the {tr.n} "
                         "ranks")
    compressed = [k for k, on in tr.compress.items() if on]
    if fault.tensor is None:
        return max(compressed, key=lambda k: math.prod(tr.tensors[k].shape)
                   * (tr.tensors[k].stack or 1))
    if fault.tensor not in compressed:
        raise ValueError(f"--inject-cache-fault: {fault.tensor!r} is not a compressed tensor; "
                         f"choose one of: {', '.join(sorted(compressed))}")
    return fault.tensor


def inject(tr, state, fault: CacheFault, log):
    """``state`` with FLIPPED_BITS random bits of one rank's cache copy flipped."""
    key = check_fault(fault, tr)
    device = tr.mesh.devices.flat[fault.rank]
    cache = fsdp.cache_dict(state.caches)[key]
    broken = faults.flip_cache_bits(cache, device, seed=fault.step, n_bits=FLIPPED_BITS)
    log(f"fault drill: flipped {FLIPPED_BITS} bits of rank {fault.rank}'s cache of {key} "
        f"before step {fault.step}")
    return dataclasses.replace(state, caches=fsdp.with_caches(state.caches, {key: broken}))

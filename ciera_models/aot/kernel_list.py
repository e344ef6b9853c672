"""The kernels a scheduled XLA:GPU program launches on its steady path, each with the HBM bytes
it reads and writes (from its operands' and result's shapes), and what they cost at best.

A kernel here is every instruction that runs work on the GPU: a fusion, a custom call (a Mosaic
GPU or Triton kernel, cuBLAS), a ``copy``, a collective (its ``-start``; NCCL's kernel moves its
bytes through HBM too). Bookkeeping (parameters, tuples, bitcasts, constants) and control
(``while``, ``conditional``) launch nothing; a conditional is counted apart, being a host sync
on a GPU rather than a kernel. A conditional's branch that reaches a fallback's transfer
(``off_path``) is left out, as :meth:`~ciera_models.aot.schedule.Program.per_step` does.

Bytes from shapes: a fusion's operand that its body reads only through slices counts the
slices' bytes; otherwise each operand counts whole, an upper bound where a kernel touches part
of a buffer (a dynamic-update-slice in place, a gather) and a lower bound where it reads twice;
the roofline (each kernel at least :data:`LAUNCH_S`, else its bytes at the GPU's HBM rate) is
what the program would cost with every kernel at HBM speed.
"""

from __future__ import annotations

import dataclasses
import re

from ciera_models.aot import schedule

LAUNCH_S = 4e-6  # a kernel's launch and its shortest run on an H100, about
# what launches nothing, besides schedule's idle instructions
_CONTROL = {"while", "conditional", "call", "async-start", "async-update", "async-done"}
_SLICES = ("slice", "dynamic-slice")
_TARGETS = {"mosaic_gpu": "mosaic", "triton": "triton", "gemm": "gemm", "cudnn": "cudnn"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    kind: str  # fusion, mosaic, triton, gemm, custom-call, copy, or a collective's name
    bytes: int  # HBM bytes read + written per run, from the shapes
    runs: int  # per run of the program (loop trip counts multiplied)
    source: str  # the innermost library frame of its stack ("-" for none)


def kind_of(ins: schedule.Instr) -> str:
    if ins.op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins.rest)
        name = target.group(1) if target else ""
        return next((k for key, k in _TARGETS.items() if key in name.lower()), "custom-call")
    return ins.op.removesuffix("-start")


def _operands_in_order(rest: str) -> list[str]:
    """The instruction names of an instruction's operand list (up to its closing paren), in
    order, repeats kept."""
    depth = 0
    for at, ch in enumerate(rest):
        depth += ch == "("
        if ch == ")":
            if depth == 0:
                return re.findall(r"%([\w.\-]+)", rest[:at])
            depth -= 1
    return []


def _operands(rest: str) -> list[str]:
    return list(dict.fromkeys(_operands_in_order(rest)))


def _sliced_reads(body: list[schedule.Instr]) -> dict[int, int]:
    """``{parameter number: bytes}`` for a fusion's parameters that its body reads only through
    slices (``slice``, ``dynamic-slice``): those bytes are the slices', not the operand's."""
    params = {i.name: int(re.match(r"(\d+)", i.rest).group(1)) for i in body
              if i.op == "parameter"}
    sliced: dict[int, int] = {}
    for name, number in params.items():
        users = [i for i in body if name in _operands(i.rest)]
        if users and all(i.op in _SLICES and _operands(i.rest)[0] == name for i in users):
            sliced[number] = sum(schedule.type_bytes(i.type) for i in users)
    return sliced


def kernel_bytes(ins: schedule.Instr, types: dict[str, str],
                 body: list[schedule.Instr] | None = None) -> int:
    """HBM bytes ``ins`` reads and writes: its result and each distinct operand (``types``: the
    computation's instruction types by name; ``body``: a fusion's computation, whose parameters
    read through slices count the slices' bytes). A collective's ``-start`` types its result
    as the tuple (input, output): that alone."""
    written = schedule.type_bytes(ins.type)
    if ins.op.endswith("-start") and ins.type.startswith("("):
        return written
    sliced = _sliced_reads(body) if body else {}
    read = {}
    for number, name in enumerate(_operands_in_order(ins.rest)):
        full = schedule.type_bytes(types.get(name, ""))
        read[name] = max(read.get(name, 0), min(full, sliced.get(number, full)))
    return written + sum(read.values())


def launching(prog: schedule.Program) -> list[str]:
    """The computations whose instructions launch kernels: ENTRY and what control flow calls
    (loop bodies and conditions, branches, calls, async computations), never a fusion's body or
    a reduction's combiner."""
    entry = re.search(r"^ENTRY %?([\w.\-]+)", prog.text, re.M)
    seen, todo = [], [entry.group(1)] if entry else []
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in prog.comps:
            continue
        seen.append(comp)
        todo += [c for i in prog.comps[comp] if i.op in _CONTROL for c in schedule.called(i)]
    return seen


def steady_kernels(prog: schedule.Program, off_path: set[str]) -> tuple[list[Kernel], int]:
    """``(kernels, conditionals)`` on ``prog``'s steady path, in schedule order per
    computation; ``off_path``: the computations of fallback transfers (their branches are
    left out)."""
    off = prog.off_branches(off_path)
    out, conditionals = [], 0
    for comp in launching(prog):
        instrs, runs = prog.comps[comp], prog.runs.get(comp, 0)
        if not runs or comp in off:
            continue
        types = {i.name: i.type for i in instrs}
        for i in instrs:
            conditionals += runs * (i.op == "conditional")
            if i.op in schedule.IDLE or i.op in _CONTROL or i.op.endswith("-done"):
                continue
            src = prog.sources(i.rest)
            body = prog.comps.get(schedule.called(i)[0]) if i.op == "fusion" else None
            out.append(Kernel(i.name, kind_of(i), kernel_bytes(i, types, body), runs,
                              src[0] if src else "-"))
    return out, conditionals


def totals(kernels: list[Kernel], hbm_Bps: float) -> dict:
    """Kernels (launches), bytes, the launch floor (:data:`LAUNCH_S` per kernel) and the
    roofline (each kernel at its bytes' time at ``hbm_Bps``, at least :data:`LAUNCH_S`)."""
    launches = sum(k.runs for k in kernels)
    return {"kernels": launches,
            "bytes": sum(k.runs * k.bytes for k in kernels),
            "launch_floor_s": launches * LAUNCH_S,
            "roofline_s": sum(k.runs * max(k.bytes / hbm_Bps, LAUNCH_S) for k in kernels)}

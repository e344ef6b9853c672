"""Reading a compiled program's HLO text: its computations, and which run inside branches.

Used to check where the collectives of a compiled step landed (a transfer inside a conditional
branch runs serialized with the compute around it on a GPU): ``benchmarks/compile_time.py``
counts them, the tests assert on them. And to say which source function each fusion came
from (:func:`fusion_sources`), and its kernel's LLVM IR (:func:`ir_sources`), which is where a
compiled step's size, and so its compile time, goes.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
# A loop whose trip count XLA cannot see (``runtime.loops.rolled_scan``) keeps it in its name
# scope: ``<TRIPS_SCOPE><n>``, read back by :func:`scoped_trip_count`.
TRIPS_SCOPE = "ciera_rolled_trips_"
# the loop itself, not one nested in its body, whose name scope holds the outer one's (under
# a transform the scope reads "jvp(<scope>)")
_TRIPS = re.compile(rf'op_name="[^"]*{TRIPS_SCOPE}(\d+)\)*/while"')


def computations(hlo: str) -> dict[str, str]:
    """``{name: body text}`` of every computation in an HLO module's text."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, body = m.group(1), []
        elif line == "}" and name:
            comps[name], name = "\n".join(body), None
        elif name:
            body.append(line)
    return comps


def inside_branches(comps: dict[str, str]) -> set[str]:
    """Names of the computations that run only inside a conditional's branch (transitively:
    fusions and loops called from a branch too)."""
    todo = []
    for text in comps.values():
        for m in re.finditer(r"branch_computations=\{([^}]*)\}", text):
            todo += [b.strip().lstrip("%") for b in m.group(1).split(",")]
        todo += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", text)
    seen = set()
    while todo:
        c = todo.pop()
        if c in comps and c not in seen:
            seen.add(c)
            todo += _CALLS.findall(comps[c])
    return seen


def all_gathers(text: str) -> list[tuple[str, list[int]]]:
    """``(element type, dims)`` of every all-gather result in some HLO text."""
    return [(m.group(1), [int(d) for d in m.group(2).split(",") if d])
            for m in re.finditer(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", text)]


def _table(hlo: str, name: str) -> list[str]:
    """The lines of one of the module's trailing tables (``FileNames``, ``StackFrames``...)."""
    m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", hlo, re.S | re.M)
    return m.group(1).splitlines() if m else []


def _ids(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def stack_sources(hlo: str, package: str = "ciera_jax"):
    """A function from an instruction's text to the ``"file:function"`` frames of its stack
    that lie in ``package``, innermost first (the module's ``StackFrames`` tables: a frame's
    location and its caller)."""
    files = {int(line.split()[0]): line.split('"')[1] for line in _table(hlo, "FileNames")}
    funcs = {int(line.split()[0]): line.split('"')[1] for line in _table(hlo, "FunctionNames")}
    locs = {int(line.split()[0]): _ids(line) for line in _table(hlo, "FileLocations")}
    frames = {int(line.split()[0]): _ids(line) for line in _table(hlo, "StackFrames")}

    def sources(instruction: str) -> tuple[str, ...]:
        m = re.search(r"stack_frame_id=(\d+)", instruction)
        frame, seen, out = (int(m.group(1)) if m else 0), set(), []
        while frame and frame not in seen and frame in frames:
            seen.add(frame)
            loc = locs[frames[frame]["file_location_id"]]
            path = files[loc["file_name_id"]]
            if f"/{package}/" in path:
                out.append(f"{path.split(f'/{package}/')[-1]}:{funcs[loc['function_name_id']]}")
            # the table prints a frame's caller as its id + 1 (1: no caller)
            frame = frames[frame].get("parent_frame_id", 1) - 1
        return tuple(out)

    return sources


def fusion_chains(hlo: str, package: str = "ciera_jax") -> dict[str, tuple[str, ...] | None]:
    """``{fusion name: the frames of its stack in package, innermost first}`` for each fusion
    of a compiled module's text (``compile().as_text()``); None for a fusion with no stack."""
    sources = stack_sources(hlo, package)
    chains: dict[str, tuple[str, ...] | None] = {}
    for line in hlo.splitlines():
        if " fusion(" not in line or "calls=" not in line:
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        chains[m.group(1) if m else line] = (
            sources(line) if re.search(r"stack_frame_id=\d+", line) else None)
    return chains


def _where(chain, package: str) -> str:
    if chain is None:
        return "(no source)"
    return chain[0] if chain else f"(outside {package})"


def fusion_sources(hlo: str, package: str = "ciera_jax") -> collections.Counter:
    """``{"file:function": fusions}``: each fusion of a compiled module's text (``compile().
    as_text()``) counted at the innermost frame of its stack that lies in ``package``;
    ``"(outside <package>)"`` and ``"(no source)"`` for the rest."""
    return collections.Counter(_where(c, package) for c in fusion_chains(hlo, package).values())


def ir_sources(hlo: str, kernel_bytes: dict[str, int], package: str = "ciera_jax",
               inclusive: bool = False) -> collections.Counter:
    """``{"file:function": bytes}``: each kernel's optimized LLVM IR (``kernel_bytes``: by
    fusion name, from an XLA:CPU dump) at the innermost frame of its fusion's stack in
    ``package`` as :func:`fusion_sources` counts fusions, or (``inclusive``) at every frame
    of it; ``"(not a fusion)"`` for kernels of no fusion in ``hlo``. XLA:CPU's compile time
    follows the IR, which LLVM makes large for small fixed-size loops (it unrolls them), not
    the fusion count."""
    chains = fusion_chains(hlo, package)
    out: collections.Counter = collections.Counter()
    for name, size in kernel_bytes.items():
        if name not in chains:
            out["(not a fusion)"] += size
        elif inclusive and chains[name]:
            for frame in set(chains[name]):
                out[frame] += size
        else:
            out[_where(chains[name], package)] += size
    return out


# a kernel's file in an XLA:CPU dump, (after the module's name, before the kernel's; after it),
# in the order read: the optimized LLVM IR (JAX 0.10), else the object file (JAX 0.11)
CPU_KERNEL_FILES = (("", ".ir-with-opt.ll"), ("obj-file.", ".o"))


def cpu_kernel_ir(dump_dir: str) -> tuple[str, dict[str, int]]:
    """What an XLA:CPU compile dumped (``compiler_options={"xla_dump_to": dump_dir}``, one
    module): its optimized HLO text and ``{kernel (fusion) name: bytes of its optimized LLVM
    IR}``, for :func:`ir_sources`. Where the dump holds no IR (JAX 0.11's XLA:CPU writes each
    kernel's object file instead), the bytes are the object files': the same kernels, and
    what LLVM's unrolling makes large shows there too."""
    texts = sorted(Path(dump_dir).glob("*cpu_after_optimizations.txt"))
    if len(texts) != 1:
        raise ValueError(f"expected one XLA:CPU module dumped in {dump_dir}, found "
                         f"{len(texts)}: compile one program with xla_dump_to")
    module = texts[0].name[:-len("cpu_after_optimizations.txt")]  # "module_N.jit_f."
    kernels: dict[str, int] = {}
    for prefix, suffix in CPU_KERNEL_FILES:
        for f in Path(dump_dir).glob(f"{module}{prefix}*{suffix}"):
            name = f.name[len(module) + len(prefix):-len(suffix)]
            name = name.removeprefix("__compute_module_").removesuffix("_kernel_module")
            kernels[name] = kernels.get(name, 0) + f.stat().st_size
        if kernels:
            break
    return texts[0].read_text(), kernels


def scoped_trip_count(instruction: str) -> int | None:
    """The trip count a rolled loop keeps in a ``while`` instruction's name scope (its HLO
    text's ``op_name``: :data:`TRIPS_SCOPE`), else None."""
    m = _TRIPS.search(instruction)
    return int(m.group(1)) if m else None


_TEMP_VALUE = re.compile(r" value: <\d+ (\S+?)(?:\{[^}]*\})? @\d+>(?: \(phi\))? "
                         r"\(size=(\d+),offset=(\d+)\): (.*)")


def temp_slots(buffer_assignment: str) -> list[dict]:
    """XLA's temporaries from a buffer-assignment dump (``*-buffer-assignment.txt``): its
    ``preallocated-temp`` allocation's slots, largest first. A slot is one (offset, size) of
    that buffer, reused by values whose lives do not overlap: ``{"size", "offset", "shape"
    (the first value's), "values" (the instructions that hold it, in dump order)}``."""
    lines = buffer_assignment.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("allocation ") and "preallocated-temp" in line), None)
    if start is None:
        return []
    slots: dict[tuple[int, int], dict] = {}
    for line in lines[start + 1:]:
        if line.startswith("allocation "):
            break
        m = _TEMP_VALUE.match(line)
        if m:
            name, size, offset, shape = m[1], int(m[2]), int(m[3]), m[4].strip()
            slot = slots.setdefault((offset, size), {"size": size, "offset": offset,
                                                     "shape": shape, "values": []})
            if name not in slot["values"]:
                slot["values"].append(name)
    return sorted(slots.values(), key=lambda s: (-s["size"], s["offset"]))

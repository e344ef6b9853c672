"""Reading a scheduled HLO module (``compiled.as_text()`` of an XLA:GPU compile): every
collective, its bytes, how often a step runs it, whether it sits in a conditional's branch, and
what the scheduler put between its start and its done. XLA overlaps an async collective only
with work of the same computation, between its ``-start`` and its ``-done``; a collective with
nothing there (or a synchronous one) runs exposed.
"""

from __future__ import annotations

import dataclasses
import re

from ciera_jax.runtime import hlo

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute",
               "all-to-all", "ragged-all-to-all", "collective-broadcast")
# instructions that do no work of their own (bookkeeping, layout, other transfers)
IDLE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start",
         "copy-done", "after-all", "add-dependency", "opt-barrier", "partition-id",
         "replica-id", "domain"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_BYTES = {"pred": 1, "c64": 8, "c128": 16}


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type: str
    op: str
    rest: str  # operands and attributes


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVES
    name: str
    computation: str
    bytes: int  # the result's bytes (a gather's full tensor, a reduce-scatter's shard)
    runs: int  # per step: the trip counts of the loops around it, multiplied
    in_branch: bool
    overlap: str  # "sync", "nothing", "compute" or "gemm": what runs between start and done
    sources: tuple[str, ...]  # library functions on its stack, innermost first

    @property
    def hidden(self) -> bool:
        return self.overlap in ("compute", "gemm")


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of an HLO element type (``bf16``, ``u8``, ``f8e4m3fn``...)."""
    if dtype in _BYTES:
        return _BYTES[dtype]
    if dtype.startswith("f8"):
        return 1
    return max(1, int(dtype.lstrip("bsuf")) // 8)


def type_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's elements added)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        total += n * dtype_bytes(dtype)
    return total


def instructions(body: str) -> list[Instr]:
    out = []
    for line in body.splitlines():
        m = _INSTR.match(line)
        if m:
            out.append(Instr(m.group(1), m.group(2), m.group(3), m.group(4)))
    return out


def called(ins: Instr) -> list[str]:
    names = re.findall(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                       r"=%?([\w.\-]+)", ins.rest)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.rest):
        names += [b.strip().lstrip("%") for b in group.split(",")]
    return names


def _trip_count(ins: Instr) -> int:
    """A loop's trips per run: XLA's known trip count, else the one a rolled loop keeps in
    its name scope (:func:`~ciera_jax.runtime.hlo.scoped_trip_count`), else 1."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)
    if m:
        return int(m.group(1))
    return hlo.scoped_trip_count(ins.rest) or 1


def _collective_kind(ins: Instr, comps: dict[str, list[Instr]]) -> tuple[str, str] | None:
    """(kind, "start" | "done" | "sync") for a collective instruction, else None."""
    for kind in COLLECTIVES:
        if ins.op == kind:
            return kind, "sync"
        if ins.op in (f"{kind}-start", f"{kind}-done"):
            return kind, ins.op.rsplit("-", 1)[1]
    if ins.op in ("async-start", "async-done"):
        for c in called(ins):
            for inner in comps.get(c, []):
                if inner.op in COLLECTIVES:
                    return inner.op, ins.op.split("-")[1]
    return None


class Program:
    """One scheduled module's computations, with what each instruction calls."""

    def __init__(self, text: str):
        self.text = text
        self.bodies = hlo.computations(text)
        self.comps = {name: instructions(body) for name, body in self.bodies.items()}
        self.branches = hlo.inside_branches(self.bodies)
        self.sources = hlo.stack_sources(text)
        self._gemm: dict[str, bool] = {}
        self.runs = self._runs()

    def _runs(self) -> dict[str, int]:
        """Times per step each computation runs: loop trip counts multiplied from ENTRY."""
        entry = re.search(r"^ENTRY %?([\w.\-]+)", self.text, re.M)
        runs: dict[str, int] = {}
        todo = [(entry.group(1), 1)] if entry else []
        while todo:
            name, n = todo.pop()
            if runs.get(name, 0) >= n:
                continue
            runs[name] = n
            for ins in self.comps.get(name, []):
                k = _trip_count(ins) if ins.op == "while" else 1
                todo += [(c, n * k) for c in called(ins)]
        return runs

    def has_gemm(self, comp: str) -> bool:
        """Does ``comp`` (or anything it calls) run a matrix multiply?"""
        if comp not in self._gemm:
            self._gemm[comp] = False  # recursion guard
            self._gemm[comp] = any(self.is_gemm(i) for i in self.comps.get(comp, []))
        return self._gemm[comp]

    def is_gemm(self, ins: Instr) -> bool:
        if ins.op in ("dot", "convolution"):
            return True
        if ins.op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.rest)
            return bool(target) and bool(re.search(r"gemm|matmul|cudnn|conv", target.group(1),
                                                   re.I))
        if ins.op in ("fusion", "call", "while", "conditional", "async-start"):
            return any("gemm" in c or self.has_gemm(c) for c in called(ins))
        return False

    def overlap_of(self, between: list[Instr]) -> str:
        work = [i for i in between if i.op not in IDLE
                and not (i.op.endswith(("-start", "-done")) and _collective_kind(i, self.comps))]
        if not work:
            return "nothing"
        return "gemm" if any(self.is_gemm(i) for i in work) else "compute"

    def collectives(self) -> list[Collective]:
        out = []
        for comp, instrs in self.comps.items():
            pending: dict[str, tuple[int, Instr, str]] = {}
            for at, ins in enumerate(instrs):
                ck = _collective_kind(ins, self.comps)
                if ck is None:
                    continue
                kind, phase = ck
                if phase == "start":
                    pending[ins.name] = (at, ins, kind)
                    continue
                if phase == "sync":
                    start_at, start, overlap = at, ins, "sync"
                else:
                    operand = re.match(r"%?([\w.\-]+)", ins.rest)
                    if not operand or operand.group(1) not in pending:
                        continue
                    start_at, start, kind = pending.pop(operand.group(1))
                    overlap = self.overlap_of(instrs[start_at + 1:at])
                out.append(Collective(
                    kind, start.name, comp, type_bytes(ins.type), self.runs.get(comp, 1),
                    comp in self.branches, overlap, self.sources(start.rest)))
        return out

    def kernels(self) -> dict[str, int]:
        """Launches as compiled: fusions and custom calls (cuBLAS, cuDNN, Pallas/Triton); and
        ``distinct_fusions``: fusions counted once per ``deduplicated_name`` (XLA:GPU gives a
        fusion identical to an earlier one that one's kernel, so a layer loop's body, its
        double-buffered clone and a repeated shape count once). Not what the compile follows:
        XLA:GPU compiles an LLVM module and a PTX assembly per kernel it emits, and a change can
        move that count one way and this one the other (``docs/aot.md``)."""
        every = [i for instrs in self.comps.values() for i in instrs]
        fusions = [i for i in every if i.op == "fusion"]
        return {"fusions": len(fusions), "distinct_fusions": len({_kernel_of(i) for i in fusions}),
                "custom_calls": sum(i.op == "custom-call" for i in every),
                "conditionals": sum(i.op == "conditional" for i in every),
                # of those, the ones inside another's branch (an overflow exit's switch): a step
                # meets them only where it took that branch
                "nested_conditionals": sum(i.op == "conditional" for c in self.branches
                                           for i in self.comps.get(c, [])),
                "while_loops": sum(i.op == "while" for i in every)}

    def per_step(self, off_path: set[str]) -> dict[str, int]:
        """What a step runs on its steady path, each instruction weighted by its runs per step:
        ``launches`` (fusions), ``copies`` and ``copy_bytes`` (XLA's ``copy`` instructions: a
        device-to-device copy each), ``branch_copies`` (those inside conditional branches: what
        a branch that passes an array made outside through costs, every step), and
        ``conditionals``. A conditional's branch that reaches a computation of ``off_path``
        (where a fallback's transfer sits: :attr:`Collective.computation`) is left out: a step
        takes it only on overflow or priming."""
        off, fused = self.off_branches(off_path), self.fused()
        out = {"launches": 0, "copies": 0, "copy_bytes": 0, "branch_copies": 0,
               "conditionals": 0}
        for comp, instrs in self.comps.items():
            runs = self.runs.get(comp, 0)
            if not runs or comp in off or comp in fused:
                continue
            for i in instrs:
                out["launches"] += runs * (i.op == "fusion")
                out["conditionals"] += runs * (i.op == "conditional")
                if i.op == "copy":
                    out["copies"] += runs
                    out["copy_bytes"] += runs * type_bytes(i.type)
                    out["branch_copies"] += runs * (comp in self.branches)
        return out

    def off_branches(self, off_path: set[str]) -> set[str]:
        """Every computation of a conditional's branch that reaches one of ``off_path`` (a
        fallback's transfer), at any depth: what a step runs only on overflow or priming."""
        off = set()
        for branch in self.branches:
            below = self._reachable(branch)
            if below & off_path:
                off |= below
        return off

    def fused(self) -> set[str]:
        """The computations fusions call: a kernel's body, whose instructions are not
        launches of their own."""
        return {c for instrs in self.comps.values() for i in instrs if i.op == "fusion"
                for c in called(i)}

    def _reachable(self, comp: str) -> set[str]:
        """``comp`` and every computation it calls, at any depth."""
        seen, todo = set(), [comp]
        while todo:
            c = todo.pop()
            if c not in seen:
                seen.add(c)
                todo += [x for i in self.comps.get(c, []) for x in called(i)]
        return seen


def _kernel_of(fusion: Instr) -> str:
    """The kernel a fusion launches: its ``deduplicated_name`` where XLA gave it one, else its
    own name."""
    m = re.search(r'deduplicated_name="([\w.\-]+)"', fusion.rest)
    return m.group(1) if m else fusion.name


def overlap_share(collectives: list[Collective], kind: str = "all-gather") -> float:
    """Of the bytes of ``kind`` collectives outside conditionals (each weighted by its runs per
    step), the share with compute scheduled between start and done."""
    outside = [c for c in collectives if c.kind == kind and not c.in_branch]
    total = sum(c.bytes * c.runs for c in outside)
    return sum(c.bytes * c.runs for c in outside if c.hidden) / total if total else 0.0

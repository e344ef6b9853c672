"""What a run trains (:class:`TrainConfig`) and how it runs (:class:`RunConfig`).

Every field is one ``ciera train`` flag: its default, help and choices live here, in the
field's metadata, and :func:`add_fields` builds the parser from them, so a flag cannot drift
from the library call it configures. ``TrainConfig`` decides the compiled step (the trainer is
memoized on it) and is stored in every checkpoint; ``RunConfig`` is the rest (length, data,
logging, checkpoints).

Light to import (no JAX): building the ``ciera`` parser imports this, so the library's tuples
of choices are looked up when a flag is checked or --help printed (:class:`LazyChoices`).
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import importlib
import typing

from ciera_jax.collective import OVERFLOW_RUNGS
from ciera_jax.runtime.gpu_targets import is_gpu
from ciera_models.model import configs
from ciera_models.train.data import TOKEN_DTYPES
from ciera_models.resilience.watchdog import DEFAULT_TIMEOUT_S as DEFAULT_HANG_TIMEOUT_S


class LazyChoices(collections.abc.Sequence):
    """A tuple of the library's (``module.name``), imported when first read: argparse reads
    choices only to check a value given on the command line, or to print --help."""

    def __init__(self, module: str, name: str, extra: tuple = ()):
        self.module, self.name, self.extra = module, name, extra

    def _values(self) -> tuple:
        return tuple(getattr(importlib.import_module(self.module), self.name)) + self.extra

    def __getitem__(self, i):
        return self._values()[i]

    def __len__(self) -> int:
        return len(self._values())


# Which cache a compressed tensor keeps: the library's modes (exponent, 1 B/param; word, the
# whole word, 2 B/param), or auto: the planner's choice per tensor.
CACHE_MODES = LazyChoices("ciera_jax.collective.cache", "MODES", extra=("auto",))
# Which tensors compress (ciera_models.train.compression): the cost model plus the expert weights, the cost
# model alone, every gathered tensor.
PLANS = ("auto", "cost", "all")
FALLBACKS = ("auto", "program", "branch")  # --fallback


def option(default, help: str, **meta):
    """A dataclass field that is also a flag. ``meta``: ``choices``, ``cli_default`` (the flag's
    default when it differs from the library's, e.g. None = "derived at run time"),
    ``default_text`` (how --help shows the default), ``metavar``, ``flag`` (False: not a
    flag)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    config: str = option("tiny", f"model config: {', '.join(configs.CONFIGS)}", metavar="NAME")
    gather: str = option("ciera", "ciera: lossless, compressed; plain: the lossless baseline "
                         "(same params bitwise); int8: the lossy baseline (ZeRO++ qwZ style)",
                         choices=LazyChoices("ciera_jax.fsdp.state.setup", "GATHER_MODES"),
                         metavar="MODE")
    batch_size: int = option(16, "global batch, in sequences (divisible by the devices)")
    seq_len: int | None = option(None, "tokens per sequence", default_text="the config's")
    lr: float = option(1e-3, "peak learning rate (AdamW)")
    warmup_steps: int = option(10, "linear warm-up steps")
    schedule_steps: int = option(200, "horizon of the cosine decay", cli_default=None,
                                 default_text="--steps, or the checkpoint's on --resume")
    min_lr_ratio: float = option(0.1, "the cosine decays to lr times this")
    weight_decay: float = option(0.1, "AdamW weight decay")
    clip_norm: float = option(1.0, "global gradient-norm clipping threshold")
    lb_coef: float = option(0.01, "router load-balance loss coefficient")
    z_coef: float = option(0.001, "router z-loss coefficient")
    profile: str | None = option(
        None, "cost-model profile for the compress-or-plain plan: a built-in name "
        "(cpu-emulated, h100-nvlink, ...) or a JSON file from `ciera calibrate`",
        default_text="cpu-emulated on CPU, h100-nvlink on GPU", metavar="NAME|FILE")
    plan: str = option("auto", "auto: the cost model plus the expert weights always; cost: "
                       "the cost model alone; all: every gathered tensor (ciera only). With "
                       "--cache auto the cost model prices word caches too (gathered once per "
                       "step), so every tensor whose word cache pays and fits compresses",
                       choices=PLANS)
    cache: str = option("auto", "what each compressed tensor caches: auto (the planner's "
                        "choice per tensor within --memory-gb: word where it fits, exponent "
                        "where only that fits), exponent (1 B/param), word (2 B/param, sends a "
                        "few bits per weight, gathered once per step)", choices=CACHE_MODES,
                        metavar="MODE")
    memory_gb: float | None = option(
        None, "with --cache auto: the device memory the plan must fit (GB per device; caches "
        "get what the training state, gathered layers and activations leave)",
        default_text="the accelerator's memory; unlimited on CPU")
    word_backward: str = option(
        "cache", "how the backward gets compressed weights: cache (a word cache's full "
        "words, as the forward's gather left them: no backward gather; an exponent cache's "
        "exponents: only sign + mantissa are gathered again) or regather (the same exact "
        "compressed gather again); both give params bitwise equal to --gather plain",
        choices=LazyChoices("ciera_jax.fsdp.state.setup", "WORD_BACKWARDS"), metavar="HOW")
    remat: str = option(
        "full", "what the layer scan's forward saves for the backward (MaxText's "
        "remat_policy): full (each layer's input alone; the backward recomputes the layer), "
        "save_dot_except_mlp (also the attention's q, k, v and output projections), none "
        "(all that autodiff keeps); never a gathered weight",
        choices=LazyChoices("ciera_jax.fsdp.state.setup", "REMAT_POLICIES"), metavar="POLICY")
    max_programs: int = option(
        8, "most train-step programs compiled per run (ciera only): each step's gathers send "
        "their escapes at rungs fixed when the step is compiled, picked from the demands the "
        "previous step agreed on; the first step compiles one at the steady-state rungs, and "
        "a new rung vector is compiled (compile_s in the metrics) only once the wire time "
        "the compiled ones lost against each step's ideal (priced on --profile's link) passes "
        "--program-patience compiles' seconds, and only this many times", metavar="N")
    program_patience: float = option(
        1.0, "how many compiles' seconds of lost wire time buy a new program (0: one whenever "
        "a better one exists, up to --max-programs)", metavar="X")
    overflow_rungs: int = option(
        OVERFLOW_RUNGS, "word mode (ciera only): a tensor or bucket whose demand is above its "
        "program's rung by up to this many rungs still sends words (the escapes past the "
        "program's section, in its fallback's conditional) instead of a plain gather; compiled "
        "for the ones carrying at least 1/32 of the word bytes (OLMoE-1B-7B: the 3 expert "
        "tensors; tiny, small: the layer's bucket), so one program follows the demand from "
        "warm-up to decay; 0: every overflow a plain gather, a smaller compile", metavar="N")
    fallback: str = option(
        "auto", "where a step whose demand is above its program's rungs goes (ciera only): "
        "program (the host, which knows each step's demand before it runs, picks a compiled "
        "program whose rungs hold it, or one gathering those tensors plainly: the steady "
        "program holds no conditional, which on a GPU is a host sync each), branch (every "
        "program compiles a fallback conditional per gather: a plain gather, or "
        "--overflow-rungs' words), auto (program where the mesh's devices are GPUs, branch "
        "elsewhere: a CPU's conditional costs nothing)", choices=FALLBACKS)
    compile_beside: str = option(
        "auto", "a step whose program is not compiled yet (the run's first, a new rung vector "
        "the policy bought) runs one that is while it compiles in a thread: the first step "
        "the priming program (every gather plain; about plain's compile), later ones the "
        "cheapest compiled for their demand; the new program runs from the first step it has "
        "compiled on every process (ciera only; the same params bit for bit, more bytes "
        "while it compiles): on, off (each step waits for its program), auto (on where the "
        "mesh's devices are not CPUs: a compile takes minutes, a step seconds)",
        choices=("auto", "on", "off"))
    attention: str = option(
        "auto", "jax.nn.dot_product_attention's implementation: auto (cudnn when the mesh's "
        "devices are GPUs, xla otherwise), xla (materializes the L x L scores), cudnn "
        "(cuDNN's fused flash attention, GPU only)", choices=("auto", "xla", "cudnn"))
    experts_matmul: str = option(
        "auto", "the experts' grouped matmul: auto (blocked when the mesh's devices are GPUs, "
        "ragged otherwise), ragged (lax.ragged_dot; XLA:GPU turns it into a dense matmul over "
        "every expert), blocked (a loop over blocks of 128 rows, ciera_models.model.grouped_matmul)",
        choices=("auto", "ragged", "blocked"))
    xla_flags: str = option(
        "fsdp", "XLA:GPU's flags for the step (ignored on other devices): fsdp (NVIDIA "
        "JAX-Toolbox's FSDP set: latency-hiding scheduler, pipelined collectives, loop double "
        "buffering, so each layer's gathers overlap compute), default (XLA's own)",
        choices=LazyChoices("ciera_jax.runtime.gpu_targets", "FLAG_SETS"))
    memory_limit: str = option(
        "auto", "XLA:GPU's scheduler memory limit (xla_gpu_memory_limit_slop_factor; ignored "
        "on other devices): gpu (XLA's default, 95%% of 80%% of the GPU less the step's "
        "inputs), plan (the memory model's total for the step), auto (XLA's default, compiled "
        "again at the plan's when XLA counts more than the plan; the smaller count kept)",
        choices=LazyChoices("ciera_jax.runtime.gpu_targets", "MEMORY_LIMITS"))

    def rung_policy_options(self) -> dict:
        """Keyword arguments of :class:`ciera_jax.loop.rungs.RungPolicy`."""
        return {"max_programs": self.max_programs, "patience": self.program_patience}

    @property
    def model(self) -> configs.ModelConfig:
        return configs.get_config(self.config)

    @property
    def length(self) -> int:
        return self.seq_len or self.model.seq_len

    def attention_on(self, platform: str) -> str:
        """The attention implementation on devices of ``platform``: ``auto`` resolved."""
        if self.attention != "auto":
            return self.attention
        return "cudnn" if is_gpu(platform) else "xla"

    def experts_on(self, platform: str) -> str:
        """The experts' grouped matmul on devices of ``platform``: ``auto`` resolved."""
        if self.experts_matmul != "auto":
            return self.experts_matmul
        return "blocked" if is_gpu(platform) else "ragged"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    steps: int = option(200, "train until this step (counted from 0, also on --resume)")
    seed: int = option(0, "parameter init and data order")
    devices: int | None = option(None, "fsdp mesh size",
                                 default_text="8 emulated CPU devices, or all accelerators")
    data: str | None = option(None, "flat uint16/uint32 token file", metavar="PATH",
                              default_text="a byte-level corpus of the Python stdlib")
    data_dtype: str | None = option(None, "token dtype of --data", choices=TOKEN_DTYPES,
                                    default_text="uint32 for a .u32 suffix, else uint16")
    metrics_out: str | None = option(None, "per-step JSONL metrics (a header line first)",
                                     metavar="PATH")
    log_every: int = option(10, "print a progress line every N steps (0: never)")
    trace_every: int = option(10, "per-tensor change rates in the JSONL every N steps")
    checkpoint_dir: str | None = option(None, "save checkpoints here (orbax; atomic)",
                                        metavar="DIR")
    checkpoint_every: int = option(0, "save every N steps (0: every --checkpoint-minutes)")
    checkpoint_minutes: float = option(10.0, "with --checkpoint-every 0: save when this many "
                                       "minutes passed since the last save")
    keep_checkpoints: int = option(3, "keep the newest N checkpoints")
    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir")
    verbose: bool = option(False, "also print the compressed gather's internals: each step's "
                           "escape rungs and exponent changes with their legend, the compiled "
                           "programs and their padding in the summary")
    inject_cache_fault: str | None = option(
        None, "flip random bits of one rank's cache before step STEP: STEP[:RANK[:TENSOR]] "
        "(default rank 0, the largest compressed tensor); a drill of the self-check",
        metavar="STEP[:RANK[:TENSOR]]")
    inject_crash: str | None = option(
        None, "raise an error on one process before step STEP: STEP[:PROCESS] (default "
        "process 0); a drill of a crash on one host: every process ends, the others as for a "
        "lost peer", metavar="STEP[:PROCESS]")
    inject_hang: str | None = option(
        None, "stop one process before step STEP, alive, until the watchdog ends the run: "
        "STEP[:PROCESS] (default process 0); a drill of --hang-timeout", metavar="STEP[:PROCESS]")
    hang_timeout: float = option(
        DEFAULT_HANG_TIMEOUT_S, "seconds without progress on any process (a step, an "
        "agreement, a checkpoint's check; compiles excepted) after which every process writes "
        "its threads' stacks to its log and ends in one line (exit 70); 0: never",
        metavar="SECONDS")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_fields(parser: argparse.ArgumentParser, cls, only=None, skip=()) -> None:
    """One flag per field of dataclass ``cls`` (``only``: these fields, in this order, where
    ``cls`` has them; ``skip``: not these); --help shows each default."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = [n for n in (fields if only is None else only) if n in fields and n not in skip]
    for f in (fields[n] for n in names):
        meta = f.metadata
        if meta.get("flag") is False:
            continue
        default = meta.get("cli_default", f.default)
        shown = meta.get("default_text", "none" if default is None else default)
        help_text = f"{meta['help']} (default: {shown})"
        if hints[f.name] is bool:
            parser.add_argument(_flag(f.name), action="store_true", default=default,
                                help=help_text)
            continue
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                    if t is not type(None))
        choices = meta.get("choices")
        if isinstance(choices, LazyChoices):  # argparse shows them at --help time only
            help_text = f"{meta['help']} (one of: %(choices)s; default: {shown})"
        metavar = meta.get("metavar", {int: "N", float: "X"}.get(kind, "VALUE"))
        parser.add_argument(_flag(f.name), type=kind, default=default, help=help_text,
                            choices=choices,
                            metavar=metavar if "metavar" in meta or not choices else None)


def to_argv(cls, args: argparse.Namespace) -> list[str]:
    """The flags of ``cls``'s fields in ``args`` that differ from their defaults, as a command
    line that parses back to the same values (the supervisor starts its child with it)."""
    argv: list[str] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("flag") is False or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value == f.metadata.get("cli_default", f.default) or value is None:
            continue
        argv += [_flag(f.name)] if value is True else [_flag(f.name), str(value)]
    return argv


def from_args(cls, args: argparse.Namespace, **overrides):
    """``cls`` from the parsed flags (fields that are not flags keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name)}
    return cls(**{**values, **overrides})

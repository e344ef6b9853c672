"""The training loop: check the inputs, build or restore the state, step, log, save, stop.

Every bad input fails in :func:`check_inputs`, before anything compiles. A preempted run
(SIGTERM/SIGINT) finishes its step, saves, and returns with ``preempted`` set; the CLI then
exits with ``preemption.EXIT_PREEMPTED``. A checkpoint folder is held by one run at a time
(:mod:`models.run_lock`); a damaged checkpoint is set aside and the previous one used
(:mod:`models.checkpoint`); a write that fails (a full disk) stops the run with
:class:`~models.failures.WriteFailed`, its newest checkpoint intact (:mod:`models.failures`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

from ciera_jax.runtime.devices import make_mesh
from ciera_jax.runtime.outputs import check_output_file
from ciera_models.checkpoint import store as ckpt
from ciera_models.checkpoint import meta as checkpoint_meta
from ciera_models.resilience import crash_drill
from ciera_models.resilience import cache_fault as faults
from ciera_models.train import metrics
from ciera_models.resilience import peers
from ciera_models.resilience import run_lock
from ciera_models.resilience import supervisor
from ciera_models.resilience import watchdog
from ciera_models.resilience.failures import WriteFailed, describe_os_error, everywhere, raised_by_all
from ciera_models.train.data import load_dataset
from ciera_models.checkpoint.params_hash import params_sha256
from ciera_models.resilience.preemption import PreemptionGuard, agree
from ciera_models.train.build import build_trainer
from ciera_models.train.state import TrainState, bytes_per_device
from ciera_models.train.config import CACHE_MODES, RunConfig, TrainConfig


@dataclasses.dataclass
class RunResult:
    sha256: str
    history: list[dict]
    summary: str
    final_step: int
    preempted: str | None = None  # the signal's name when the run stopped early
    checkpoint: str | None = None  # where the last save went


def check_inputs(tc: TrainConfig, run: RunConfig) -> None:
    """One clear ValueError per bad input, before any work."""
    if run.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {run.steps}")
    if run.devices is not None and run.devices < 1:
        raise ValueError(f"--devices must be a positive number of devices, got {run.devices} "
                         "(leave it out for all devices, or 8 emulated on CPU)")
    if tc.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive number of sequences, got "
                         f"{tc.batch_size}")
    if tc.seq_len is not None and tc.seq_len < 1:
        raise ValueError(f"--seq-len must be positive, got {tc.seq_len}")
    if tc.memory_gb is not None and not tc.memory_gb > 0:
        raise ValueError(f"--memory-gb must be a positive number of GB, got {tc.memory_gb:g}")
    if tc.max_programs < 1:
        raise ValueError(f"--max-programs must be >= 1 (the first step's program is one), "
                         f"got {tc.max_programs}")
    if tc.overflow_rungs < 0:
        raise ValueError(f"--overflow-rungs must be >= 0 (0: every overflow a plain gather), "
                         f"got {tc.overflow_rungs}")
    if not tc.program_patience >= 0:
        raise ValueError(f"--program-patience must be >= 0 compiles' seconds, got "
                         f"{tc.program_patience:g}")
    for flag, value in (("--log-every", run.log_every), ("--trace-every", run.trace_every),
                        ("--checkpoint-every", run.checkpoint_every)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 (0: " + {
                "--log-every": "never", "--trace-every": "never",
                "--checkpoint-every": "every --checkpoint-minutes"}[flag] + f"), got {value}")
    if not run.checkpoint_minutes > 0:
        raise ValueError(f"--checkpoint-minutes must be positive, got {run.checkpoint_minutes:g}")
    if run.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be >= 1, got {run.keep_checkpoints}")
    if tc.cache not in CACHE_MODES:
        raise ValueError(f"unknown cache {tc.cache!r}; choose one of: "
                         f"{', '.join(CACHE_MODES)}")
    if run.resume and not run.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if run.data and Path(run.data).is_dir():
        raise ValueError(f"--data {run.data} is a directory; pass a token file")
    if run.checkpoint_dir:
        ckpt.check_dir(run.checkpoint_dir)
    if run.metrics_out:
        check_output_file(run.metrics_out, "--metrics-out")
    faults.parse_fault(run.inject_cache_fault)  # the format; step, rank, tensor: in train()
    crash_drill.parse_crash(run.inject_crash)  # the format; step, process: in train()
    crash_drill.parse_crash(run.inject_hang, "--inject-hang")
    if not run.hang_timeout >= 0:
        raise ValueError(f"--hang-timeout must be >= 0 seconds (0: never), got "
                         f"{run.hang_timeout:g}")


def train(tc: TrainConfig, run: RunConfig | None = None, *, mesh=None,
          log: Callable[[str], None] | None = print, **run_fields) -> RunResult:
    """Train to ``run.steps`` total steps (continuing from the latest checkpoint with
    ``run.resume``). ``run_fields`` override fields of ``run`` (``train(tc, steps=20)``)."""
    run = dataclasses.replace(run or RunConfig(), **run_fields)
    log = log or _silent
    check_inputs(tc, run)
    with contextlib.ExitStack() as stack:
        if run.checkpoint_dir:
            stack.enter_context(_lock(run.checkpoint_dir, log))
        saver = (stack.enter_context(ckpt.Checkpointer(run.checkpoint_dir, run.keep_checkpoints))
                 if run.checkpoint_dir else None)
        # a signal from here on: finish the step, save, stop
        guard = stack.enter_context(PreemptionGuard(log, saves=saver is not None))
        t0, c0 = time.perf_counter(), time.process_time()
        tr, state, dataset, meta = _start(tc, run, mesh, saver, log)
        # what the first step's seconds leave out: data, trainer, state (and the encode
        # program's compile, which starts beside the state's making)
        startup = {"startup_s": time.perf_counter() - t0,
                   "startup_cpu_s": time.process_time() - c0}
        with raised_by_all():  # the drills' arguments, checked still before the step compiles
            fault = faults.parse_fault(run.inject_cache_fault)
            if fault:
                faults.check_fault(fault, tr)
                faults.check_fault_step(fault, run.steps, state.step)
            crash = crash_drill.parse_crash(run.inject_crash)
            if crash:
                crash_drill.check_crash(crash, run.steps, state.step, _process_count())
            hang = crash_drill.parse_crash(run.inject_hang, "--inject-hang")
            if hang:
                crash_drill.check_crash(hang, run.steps, state.step, _process_count(),
                                        "--inject-hang")
        out = stack.enter_context(_metrics_file(run, {**meta, **startup}, log))
        history, last_save, stopped = [], time.monotonic(), None
        retries = 0
        while state.step < run.steps and not stopped:
            if state.priming and not (history and history[-1]["priming"]):
                log(_first_step_note(tr, state.step + 1))
            if fault and state.step + 1 == fault.step and not retries:
                state = faults.inject(tr, state, fault, log)
            crash_drill.crash_if_due(crash, state.step + 1, _process_index())
            crash_drill.hang_if_due(hang, state.step + 1, _process_index())
            watchdog.mark(f"in step {state.step + 1}")
            rec, state = _one_step(tr, state, dataset, run, retried=retries > 0)
            peers.progress["step"] = state.step
            supervisor.report_step(state.step)
            history.append(rec)
            watchdog.mark(f"in the agreement after step {rec['step']}")
            stop, due = _report_agreed(rec, out, run, tc, log, saver, guard, last_save)
            if rec["verify_failed"]:
                retries = _after_failed_check(rec, retries, log)
                continue  # nothing was applied: the same step again, caches re-priming
            retries = 0
            stop = stop and state.step < run.steps  # a signal in the last step: just finish
            if saver and (due or stop or state.step == run.steps):
                watchdog.mark(f"saving checkpoint step {state.step}")
                # in the background, said when complete; the last one (or a stop's) waited for
                saver.save(state.step, state.params, state.opt_state, meta,
                           wait=stop or state.step == run.steps, say=None if stop else log)
                last_save = time.monotonic()
            if stop:
                stopped = guard.signal_name or "a signal on another process"
                log(f"preempted ({stopped}) after step {state.step} of {run.steps}: "
                    + (f"checkpoint saved to {saver.directory} at step {state.step}; run again "
                       "with --resume to continue" if saver else
                       "nothing was saved (no --checkpoint-dir); a new run starts from step 0"))
        if pending := tr.beside_compiles.still_compiling():
            log(f"done; the process exits when the {pending} program(s) still compiling beside "
                "the steps finish (XLA cannot stop a compile; no step will run them)")
    return RunResult(params_sha256(state.params), history,
                     metrics.summarize(history, tc, tc.gather, run.verbose), state.step, stopped,
                     str(saver.directory) if saver else None)


def _silent(line: str) -> None:
    pass


def _start(tc: TrainConfig, run: RunConfig, mesh, saver, log):
    """Data, a checkpoint's fit, the trainer, the state (fresh or restored), the start-up
    lines. Returns ``(trainer, state, dataset, checkpoint meta)``; the meta also heads the
    JSONL (with the memory per device and the start step)."""
    mesh = mesh or make_mesh(run.devices)
    dataset = load_dataset(run.data, tc.model.vocab_size, tc.length, run.data_dtype)
    identity = {**dataclasses.asdict(tc), "seed": run.seed}
    layout = {"devices": int(mesh.devices.size), "processes": _process_count()}
    saved = saver.newest_meta(log) if saver and run.resume else None
    if saved is not None:
        with raised_by_all():  # the checkpoint every process agreed on, against the arguments
            for note in checkpoint_meta.check_resumable(saved, identity, run.checkpoint_dir):
                log(f"note: {note}")
        if (note := checkpoint_meta.layout_note(saved, layout)) is not None:
            log(f"note: {note}")
    # the trainer's and the state's making trace and compile (the model's init runs op by op):
    # a loaded host's slow start-up is no hang (a restore marks its own progress)
    with watchdog.compiling():
        tr = build_trainer(tc, mesh)
        if tr.policy is not None:  # an earlier run in this process: its programs stay compiled
            tr.policy.start_run()
        # The encode program compiles while the state is made or restored; not for a run with
        # nothing to do (Python would wait for the compile at exit), nor beside the steps
        # (--compile-beside: it starts after the first step's program)
        if not tr.beside and not (saved is not None and saved.get("step", 0) >= run.steps):
            tr.start_encode_compile()
        state = tr.init_state(run.seed)
    watchdog.mark("starting")
    if run.resume:
        state = _restore(saver, state, log)
        if state.step >= run.steps:
            log(f"nothing to do: the checkpoint in {saver.directory} is at step {state.step}, "
                f"at or past --steps {run.steps}; pass a larger --steps to train on (exit 0)")
    if tc.gather == "ciera":
        log(tr.plan_summary)
        words = sum(m == "word" for k, m in tr.cache_modes.items() if tr.compress[k])
        log(f"caches (--cache {tc.cache}): word for {words} of the "
            f"{sum(tr.compress.values())} compressed tensors, exponent for the rest")
    memory = {"params": bytes_per_device(state.params),
              "optimizer": bytes_per_device(state.opt_state),
              ("caches" if tc.gather != "ciera" else f"caches ({tc.cache})"):
                  bytes_per_device(state.caches)}
    log(metrics.memory_line(memory, tc.gather))
    if run.verbose and tc.gather == "ciera":
        log("legend: " + metrics.RUNG_LEGEND)
    meta = {"train_config": dataclasses.asdict(tc), "seed": run.seed, "mesh": layout,
            "memory_per_device": memory, "start_step": state.step}
    return tr, state, dataset, meta


def _report_agreed(rec: dict, out, run: RunConfig, tc: TrainConfig, log, saver, guard,
                   last_save: float) -> tuple[bool, bool]:
    """:func:`_report`, then one agreement of every process: ``(stop, a save is due)``. Only
    process 0 writes the metrics, so a write that fails there ends every process here (the
    others with the same exit code), not process 0 alone while the others wait for it in the
    next step's collectives."""
    failed = None
    try:
        _report(rec, out, run, tc, log, saver)
    except WriteFailed as e:
        failed = e
    stop, due, any_failed = agree(guard.signal_name is not None,
                                  _save_due(run, rec["step"], last_save), failed is not None)
    if any_failed:
        raise everywhere(failed or WriteFailed(
            f"another process could not write the metrics after step {rec['step']} (its line "
            "says why); stopped there too"))
    return stop, due


def _report(rec: dict, out, run: RunConfig, tc: TrainConfig, log, saver=None) -> None:
    """The step's JSONL row and progress line; a non-finite loss ends the run, and so does a
    row that cannot be written (:class:`WriteFailed`, naming the newest checkpoint)."""
    if out:
        try:
            _write_line(out, rec)
        except OSError as e:
            newest = saver.latest_step() if saver else None
            raise WriteFailed(
                f"metrics: writing step {rec['step']} to {run.metrics_out} failed "
                f"({describe_os_error(e, run.metrics_out)}); stopped after step {rec['step']}; "
                + (f"the newest checkpoint is step {newest} in {saver.directory}: free space, "
                   "then rerun with --resume (the metrics file is repaired then)"
                   if newest is not None else "nothing was saved")) from None
    if run.log_every and (rec["step"] % run.log_every == 0 or rec["step"] in (1, run.steps)):
        log(metrics.progress_line(rec, run.steps, tc.batch_size * tc.length, tc.gather,
                                  run.verbose))
    if not math.isfinite(rec["loss"]):
        # the loss is the global batch's: every process stops here
        raise everywhere(FloatingPointError(f"loss is {rec['loss']} at step {rec['step']}"))


def _one_step(tr, state: TrainState, dataset, run: RunConfig,
              retried: bool = False) -> tuple[dict, TrainState]:
    """Run the step at ``state.step`` (data position == step) and take its result."""
    batch = tr.batch(dataset, run.seed, state.step)
    priming = state.priming and tr.tc.gather == "ciera"
    t0, c0 = time.perf_counter(), time.process_time()
    new_state, m = tr.step(state, batch, steps_left=run.steps - state.step)
    dt, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    step = state.step + 1
    traced = run.trace_every > 0 and (step % run.trace_every == 0 or step == 1)
    return metrics.step_record(step, m, dt, cpu_s, tr.kinds, traced, priming,
                               retried), new_state


MAX_RETRIES = 3  # a fault that survives re-priming this often is not a transient one


def _after_failed_check(rec: dict, retries: int, log) -> int:
    """Log a failed self-check; stop when the same step keeps failing."""
    retries += 1
    if retries > MAX_RETRIES:
        raise everywhere(RuntimeError(  # verify_failed is the step's, on every process
            f"step {rec['step']}: the gathers' self-check failed {retries} times in a row "
            f"even after the failed caches re-primed; a rank's memory or links are likely "
            f"faulty (see verify_failed in the metrics)"))
    log(f"step {rec['step']}: self-check failed on {rec['verify_failed']} gathered shard(s); "
        f"the step was not applied, the failed caches re-prime, and the same batch runs "
        f"again (retry {retries})")
    return retries


def _first_step_note(tr, step: int) -> str:
    what = [] if tr.compiled else ["compiles the train step"]
    if tr.tc.gather == "ciera":
        what.append("fills the caches (each compressed tensor sent plainly once)")
    return f"step {step} " + " and ".join(what or ["starts"])


def _save_due(run: RunConfig, step: int, last_save: float) -> bool:
    if not run.checkpoint_dir:
        return False
    if run.checkpoint_every:
        return step % run.checkpoint_every == 0
    return time.monotonic() - last_save >= 60 * run.checkpoint_minutes


def _restore(saver, state: TrainState, log) -> TrainState:
    got = saver.restore(state.params, state.opt_state, log)
    if got is None:
        log(f"no checkpoint in {saver.directory}; starting from step 0")
        return state
    params, opt_state, saved = got
    log(f"resumed from {saver.directory} at step {saved['step']} (caches re-prime)")
    return TrainState(int(saved["step"]), params, state.caches, opt_state)  # ahead re-encodes


def _process_count() -> int:
    import jax

    return jax.process_count()


def _process_index() -> int:
    import jax

    return jax.process_index()


@contextlib.contextmanager
def _lock(directory: str, log):
    """The checkpoint folder's lock: process 0 takes it, and every process hears whether it
    could (so none goes on alone)."""
    import jax

    with contextlib.ExitStack() as stack:
        refused = None
        if jax.process_index() == 0:
            try:
                stack.enter_context(run_lock.hold(directory, log))
            except ValueError as e:
                refused = e
        if agree(refused is not None)[0]:
            raise everywhere(refused or ValueError(
                f"--checkpoint-dir {directory} is in use by another run (process 0 could not "
                "take its lock)"))
        yield


def _write_line(out: int, obj: dict) -> None:
    """One JSONL line, appended with one write (O_APPEND): a line is whole or, when the disk
    fills half-way, cut short (and dropped by the repair on --resume)."""
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(out, data):]


def _repair(path: Path, start_step: int, log) -> None:
    """Keep the rows up to ``start_step`` (a resume runs the rest again) and drop lines a full
    disk cut short; the file is replaced whole."""
    keep, cut = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            cut += 1
            continue
        if isinstance(row, dict) and row.get("step", 0) <= start_step:
            keep.append(line)
    if cut:
        log(f"metrics: dropped {cut} line(s) of {path} that a failed write cut short")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


@contextlib.contextmanager
def _metrics_file(run: RunConfig, header: dict, log=None):
    """The JSONL file's descriptor (None without --metrics-out): a header line (``header``),
    then one row per step. On resume, rows past the restored step (logged before a crash) and
    lines a failed write cut short are dropped."""
    if not run.metrics_out:
        yield None
        return
    path = Path(run.metrics_out)
    try:
        if run.resume and path.exists():
            _repair(path, header["start_step"], log or _silent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if run.resume else os.O_TRUNC)
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise WriteFailed(f"metrics: cannot write {path} ({describe_os_error(e, path)}); "
                          "nothing was trained") from None
    try:
        try:
            _write_line(fd, {"header": header})
        except OSError as e:
            raise WriteFailed(f"metrics: cannot write {path} ({describe_os_error(e, path)}); "
                              "nothing was trained") from None
        yield fd
    finally:
        os.close(fd)

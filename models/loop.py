"""The training loop: check the inputs, build or restore the state, step, log, save, stop.

Every bad input fails in :func:`check_inputs`, before anything compiles. A preempted run
(SIGTERM/SIGINT) finishes its step, saves, and returns with ``preempted`` set; the CLI then
exits with ``preemption.EXIT_PREEMPTED``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

from ciera_jax.devices import make_mesh
from models import checkpoint as ckpt
from models import faults, metrics
from models.data import load_dataset
from models.params_hash import params_sha256
from models.preemption import PreemptionGuard, agree
from models.state import TrainState, build_trainer, bytes_per_device
from models.train_config import CACHE_MODES, RunConfig, TrainConfig


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
    if run.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be >= 1, got {run.keep_checkpoints}")
    if tc.cache not in CACHE_MODES:
        raise ValueError(f"unknown cache {tc.cache!r}; choose one of: "
                         f"{', '.join(CACHE_MODES)}")
    if run.resume and not run.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if run.checkpoint_dir:
        ckpt.check_dir(run.checkpoint_dir)
    faults.parse_fault(run.inject_cache_fault)


def train(tc: TrainConfig, run: RunConfig | None = None, *, mesh=None,
          log: Callable[[str], None] | None = print, **run_fields) -> RunResult:
    """Train to ``run.steps`` total steps (continuing from the latest checkpoint with
    ``run.resume``). ``run_fields`` override fields of ``run`` (``train(tc, steps=20)``)."""
    run = dataclasses.replace(run or RunConfig(), **run_fields)
    log = log or _silent
    check_inputs(tc, run)
    with contextlib.ExitStack() as stack:
        saver = (stack.enter_context(ckpt.Checkpointer(run.checkpoint_dir, run.keep_checkpoints))
                 if run.checkpoint_dir else None)
        guard = stack.enter_context(PreemptionGuard(log))  # a signal from here on: save, stop
        tr, state, dataset, meta = _start(tc, run, mesh, saver, log)
        out = stack.enter_context(_metrics_file(run, meta))
        history, last_save, stopped = [], time.monotonic(), None
        fault = faults.parse_fault(run.inject_cache_fault)
        if fault:
            faults.check_fault(fault, tr)
        retries = 0
        while state.step < run.steps and not stopped:
            if state.priming:
                log(_first_step_note(tr, state.step + 1))
            if fault and state.step + 1 == fault.step and not retries:
                state = faults.inject(tr, state, fault, log)
            rec, state = _one_step(tr, state, dataset, run, retried=retries > 0)
            history.append(rec)
            _report(rec, out, run, tc, log)
            if rec["verify_failed"]:
                retries = _after_failed_check(rec, retries, log)
                continue  # nothing was applied: the same step again, caches re-priming
            retries = 0
            stop, due = agree(guard.signal_name is not None,
                              _save_due(run, state.step, last_save))
            stop = stop and state.step < run.steps  # a signal in the last step: just finish
            if saver and (due or stop or state.step == run.steps):
                saver.save(state.step, state.params, state.opt_state, meta)
                last_save = time.monotonic()
                if not stop:
                    log(f"checkpoint: step {state.step} saved to {saver.directory} "
                        f"(keeping the newest {run.keep_checkpoints})")
            if stop:
                stopped = guard.signal_name or "a signal on another process"
                log(f"preempted ({stopped}) after step {state.step} of {run.steps}: "
                    + (f"checkpoint saved to {saver.directory} at step {state.step}; run again "
                       "with --resume to continue" if saver else
                       "nothing saved (no --checkpoint-dir)"))
    return RunResult(params_sha256(state.params), history,
                     metrics.summarize(history, tc, tc.gather), state.step, stopped,
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
    if saver and run.resume and (saved := saver.latest_meta()) is not None:
        for note in ckpt.check_resumable(saved, identity, run.checkpoint_dir):
            log(f"note: {note}")
    tr = build_trainer(tc, mesh)
    state = tr.init_state(run.seed)
    if run.resume:
        state = _restore(saver, state, log)
    if tc.gather == "ciera":
        log(tr.plan_summary)
        words = sum(m == "word" for k, m in tr.cache_modes.items() if tr.compress[k])
        log(f"caches (--cache {tc.cache}): word for {words} of the "
            f"{sum(tr.compress.values())} compressed tensors, exponent for the rest")
    memory = {"params": bytes_per_device(state.params),
              "optimizer": bytes_per_device(state.opt_state),
              f"caches ({tc.cache})": bytes_per_device(state.caches)}
    log(metrics.memory_line(memory))
    log("legend: " + metrics.TIER_LEGEND)
    meta = {"train_config": dataclasses.asdict(tc), "seed": run.seed,
            "memory_per_device": memory, "start_step": state.step}
    return tr, state, dataset, meta


def _report(rec: dict, out, run: RunConfig, tc: TrainConfig, log) -> None:
    """The step's JSONL row and progress line; a non-finite loss ends the run."""
    if out:
        out.write(json.dumps(rec) + "\n")
        out.flush()
    if run.log_every and (rec["step"] % run.log_every == 0 or rec["step"] in (1, run.steps)):
        log(metrics.progress_line(rec, run.steps, tc.batch_size * tc.length))
    if not math.isfinite(rec["loss"]):
        raise FloatingPointError(f"loss is {rec['loss']} at step {rec['step']}")


def _one_step(tr, state: TrainState, dataset, run: RunConfig,
              retried: bool = False) -> tuple[dict, TrainState]:
    """Run the step at ``state.step`` (data position == step) and take its result."""
    batch = tr.batch(dataset, run.seed, state.step)
    priming = state.priming and tr.tc.gather == "ciera"
    t0 = time.perf_counter()
    new_state, m = tr.step(state, batch)
    dt = time.perf_counter() - t0
    step = state.step + 1
    traced = run.trace_every > 0 and (step % run.trace_every == 0 or step == 1)
    return metrics.step_record(step, m, dt, tr.kinds, traced, priming, retried), new_state


MAX_RETRIES = 3  # a fault that survives re-priming this often is not a transient one


def _after_failed_check(rec: dict, retries: int, log) -> int:
    """Log a failed self-check; stop when the same step keeps failing."""
    retries += 1
    if retries > MAX_RETRIES:
        raise RuntimeError(
            f"step {rec['step']}: the gathers' self-check failed {retries} times in a row "
            f"even after the failed caches re-primed; a rank's memory or links are likely "
            f"faulty (see verify_failed in the metrics)")
    log(f"step {rec['step']}: self-check failed on {rec['verify_failed']} gathered shard(s); "
        f"the step was not applied, the failed caches re-prime, and the same batch runs "
        f"again (retry {retries})")
    return retries


def _first_step_note(tr, step: int) -> str:
    what = [] if tr.compiled else ["compiles the train step"]
    if tr.tc.gather == "ciera":
        what.append("primes the caches (a plain gather of each compressed tensor; not counted "
                    "as exponent change)")
    return f"step {step} " + " and ".join(what or ["starts"])


def _save_due(run: RunConfig, step: int, last_save: float) -> bool:
    if not run.checkpoint_dir:
        return False
    if run.checkpoint_every:
        return step % run.checkpoint_every == 0
    return time.monotonic() - last_save >= 60 * run.checkpoint_minutes


def _restore(saver, state: TrainState, log) -> TrainState:
    got = saver.restore(state.params, state.opt_state)
    if got is None:
        log(f"no checkpoint in {saver.directory}; starting from step 0")
        return state
    params, opt_state, saved = got
    log(f"resumed from {saver.directory} at step {saved['step']} (caches re-prime)")
    return TrainState(int(saved["step"]), params, state.caches, opt_state)  # ahead re-encodes


@contextlib.contextmanager
def _metrics_file(run: RunConfig, header: dict):
    """The JSONL file (None without --metrics-out): a header line (``header``), then one row
    per step. On resume, rows past the restored step (logged before a crash) are dropped."""
    if not run.metrics_out:
        yield None
        return
    path = Path(run.metrics_out)
    if run.resume and path.exists():
        keep = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= header["start_step"]]
        path.write_text("".join(line + "\n" for line in keep))
    with open(path, "a" if run.resume else "w") as out:
        out.write(json.dumps({"header": header}) + "\n")
        yield out

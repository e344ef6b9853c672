"""Train the MoE transformer under FSDP with the CIERA gather (or the plain / int8 baselines).

With no flags: config ``tiny`` on 8 emulated CPU devices (all local devices on an accelerator),
the built-in byte-level corpus, 200 steps, ``--gather ciera``. Prints a progress line every few
steps, a per-phase summary table, and ends with ``params_sha256=<hex>``. SIGTERM or Ctrl-C
finishes the step, saves (with ``--checkpoint-dir``) and exits with code 75; ``--resume``
continues bitwise. Every other way a run ends early is one line on stderr and a documented
exit code (:mod:`models.failures`).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import signal
import sys
import traceback

from ciera_models.train.config import (RunConfig, TrainConfig, add_fields, from_args, option,
                                       to_argv)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How the processes of a multi-host run find each other."""

    coordinator: str | None = option(None, "multi-host: coordinator address host:port (with "
                                     "--num-processes, --process-id); also read from the usual "
                                     "cluster environment variables", metavar="HOST:PORT")
    num_processes: int | None = option(None, "multi-host: number of processes")
    process_id: int | None = option(None, "multi-host: this process's index")
    peer_timeout: int = option(60, "multi-host: seconds to wait for every process to join, and "
                               "without a heartbeat from one, before the others give up with "
                               "one line (exit 69)", metavar="SECONDS")


# The flags most runs set: --help shows them first, every other one under "advanced".
COMMON = ("config", "gather", "cache", "steps", "batch_size", "seq_len", "lr", "seed",
          "devices", "data", "metrics_out", "checkpoint_dir", "resume", "verbose")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s [--config NAME] [--gather MODE] [--steps N] [more: see --help]"
    common = p.add_argument_group("what most runs set")
    add_fields(common, TrainConfig, only=COMMON)
    add_fields(common, RunConfig, only=COMMON)
    add_fields(p.add_argument_group("advanced: the training step"), TrainConfig, skip=COMMON)
    add_fields(p.add_argument_group("advanced: the run"), RunConfig, skip=COMMON)
    add_fields(p.add_argument_group("advanced: multi-host processes"), LaunchConfig)


def _check_launch(launch: LaunchConfig) -> None:
    if launch.coordinator:
        if launch.num_processes is None or launch.process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        if launch.peer_timeout < 1:
            raise ValueError(f"--peer-timeout must be a positive number of seconds, got "
                             f"{launch.peer_timeout}")


# Variables that start a multi-process run without --coordinator: what
# ``jax.distributed.initialize()`` reads (Slurm, Open MPI, or the address itself).
CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def launch_from_environment(launch: LaunchConfig) -> LaunchConfig:
    """Without ``--coordinator``, the address, process count and process id that
    ``jax.distributed.initialize()`` would take from a cluster's environment (Slurm, Open MPI,
    ``JAX_COORDINATOR_ADDRESS``), as if given as flags: such a run gets the supervisor, the
    peer watcher and ``--peer-timeout`` like any other. One process, or no cluster that JAX
    recognizes: unchanged (a single-process run)."""
    if launch.coordinator or not any(k in os.environ for k in CLUSTER_VARS):
        return launch
    from jax._src import clusters  # JAX's own cluster detection (no backend starts)

    coordinator, n, pid, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        os.environ.get("JAX_COORDINATOR_ADDRESS"), launch.num_processes, launch.process_id,
        None, None, launch.peer_timeout)
    if (coordinator is None and n is None) or (n is not None and n <= 1):
        return launch  # no cluster JAX knows (say, a Slurm allocation outside srun), or one
    if None in (coordinator, n, pid):
        raise ValueError(
            "the environment starts a multi-process run (" + ", ".join(
                k for k in CLUSTER_VARS if k in os.environ) + " is set) but does not say "
            + " or ".join(what for what, v in (("the coordinator address", coordinator),
                                                ("the number of processes", n),
                                                ("this process's id", pid)) if v is None)
            + "; pass --coordinator, --num-processes and --process-id")
    return dataclasses.replace(launch, coordinator=coordinator, num_processes=n,
                               process_id=pid)


def _init_distributed(launch: LaunchConfig) -> None:
    import jax

    if launch.coordinator:
        # CPU processes exchange collectives over gloo sockets (GPUs use NCCL regardless).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from ciera_models.resilience import peers

        peers.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                         launch.peer_timeout)


def _schedule_steps(tc: TrainConfig, run: RunConfig) -> int:
    """The cosine horizon: the flag, else the checkpoint's on --resume, else --steps."""
    if tc.schedule_steps is not None:
        return tc.schedule_steps
    if run.resume and run.checkpoint_dir:
        from ciera_models.checkpoint import store as checkpoint  # imports orbax: only when resuming

        meta = checkpoint.latest_meta(run.checkpoint_dir) or {}
        saved = meta.get("train_config", meta)  # older checkpoints: top-level keys
        if saved.get("schedule_steps") is not None:
            return int(saved["schedule_steps"])
    return run.steps


def run(args) -> int:
    tc, run_cfg, launch = _checked_configs(args)
    from ciera_models.resilience import supervisor

    if (launch.num_processes or 1) > 1 and launch.coordinator and not supervisor.is_child():
        # the job runs in a child, so that a lost coordinator's C++ abort is one line here
        return supervisor.supervise(supervisor.train_command(
            [a for cls in (TrainConfig, RunConfig, LaunchConfig) for a in to_argv(cls, args)]),
            launch.process_id, launch.num_processes, run_cfg.checkpoint_dir,
            run_cfg.metrics_out)
    _start_process(run_cfg, launch)
    return _train_here(tc, run_cfg, launch)


def _checked_configs(args) -> tuple[TrainConfig, RunConfig, LaunchConfig]:
    """The run's configs from the flags (and a cluster's environment), checked before JAX
    starts: bad input fails here."""
    from ciera_models.model import configs
    from ciera_models.train.loop import check_inputs

    tc, run_cfg = from_args(TrainConfig, args), from_args(RunConfig, args)
    configs.get_config(tc.config)  # unknown config -> KeyError with the choices
    check_inputs(tc, run_cfg)
    launch = launch_from_environment(from_args(LaunchConfig, args))
    _check_launch(launch)
    vars(args).update(coordinator=launch.coordinator, num_processes=launch.num_processes,
                      process_id=launch.process_id)  # for the child's flags
    return tc, run_cfg, launch


def _start_process(run_cfg: RunConfig, launch: LaunchConfig) -> None:
    """Devices, the stack dump on SIGUSR1, the progress the peers see, and the processes'
    rendezvous (a peer lost there: one line, and this process exits)."""
    from ciera_jax.runtime.devices import setup_devices
    from ciera_models.resilience import peers
    from ciera_models.resilience import supervisor
    from ciera_models.resilience.failures import PeerLost

    setup_devices(run_cfg.devices)  # before JAX creates its backends
    _stacks_on_sigusr1()
    peers.progress["checkpoint_dir"] = run_cfg.checkpoint_dir
    peers.progress["log"] = os.environ.get(supervisor.LOG_ENV) if supervisor.is_child() else None
    try:
        _init_distributed(launch)
    except PeerLost as e:  # not JAX's exit-time shutdown: it waits on the absent peer
        line = f"ciera train: {e}"
        peers.last_words(e.exit_code, lambda: print(line, file=sys.stderr))


def _train_here(tc: TrainConfig, run_cfg: RunConfig, launch: LaunchConfig) -> int:
    """Train on this process's share of the mesh; process 0 prints and writes the metrics.
    Returns the exit code."""
    import jax

    from ciera_jax.runtime.devices import make_mesh
    from ciera_models.resilience import peers
    from ciera_models.resilience import watchdog
    from ciera_models.resilience.failures import RunFailure, raised_everywhere
    from ciera_models.resilience.preemption import EXIT_PREEMPTED
    from ciera_models.train.loop import train

    multi = jax.process_count() > 1
    _start_watchdog(jax, run_cfg.hang_timeout)
    n = run_cfg.devices if run_cfg.devices and not multi else len(jax.devices())
    tc = dataclasses.replace(tc, schedule_steps=_schedule_steps(tc, run_cfg))
    is_main = jax.process_index() == 0
    if not is_main:
        run_cfg = dataclasses.replace(run_cfg, metrics_out=None)
    if is_main:
        print(f"ciera train: config={tc.config} gather={tc.gather} mesh fsdp={n} "
              f"({jax.devices()[0].platform}, {jax.process_count()} process(es)) "
              f"batch={tc.batch_size}x{tc.length} steps={run_cfg.steps}", flush=True)
    try:
        res = train(tc, run_cfg, mesh=make_mesh(n),
                    log=(lambda s: print(s, flush=True)) if is_main else None)
    except RunFailure as e:
        who = f" (process {jax.process_index()})" if multi else ""
        line = f"ciera train{who}: {e}"
        if multi and not raised_everywhere(e):
            peers.end_alone(e.exit_code, lambda: print(line, file=sys.stderr))
        print(line, file=sys.stderr, flush=True)
        return e.exit_code
    except Exception as e:
        _end_alone_if_alone(e, jax, launch.peer_timeout)
        raise
    finally:
        watchdog.stop()
    peers.stop_watching()
    if is_main:
        print(res.summary)
        print(f"params_sha256={res.sha256}", flush=True)
    return EXIT_PREEMPTED if res.preempted else 0


def _end_alone_if_alone(e: Exception, jax, peer_timeout: int) -> None:
    """An error raised in a multi-process run: a lost peer is one line naming it (and exits);
    an error of this process alone (a bug here, a file missing on this host) ends it so the
    others see a lost peer, instead of waiting for this one. Otherwise nothing (it is raised
    on)."""
    from ciera_jax.cli.main import BAD_INPUT, EXIT_BAD_INPUT, bad_input_line
    from ciera_models.resilience import peers
    from ciera_models.resilience.failures import raised_everywhere

    if jax.process_count() <= 1:
        return
    if peers.is_peer_failure(e):  # one line, naming the lost process; exits
        peers.lost_peer(e, jax.process_index(), jax.process_count(), peer_timeout)
    if not raised_everywhere(e):
        if isinstance(e, BAD_INPUT):
            line = bad_input_line("train", e, f" (process {jax.process_index()})")
            peers.end_alone(EXIT_BAD_INPUT, lambda: print(line, file=sys.stderr))
        else:
            peers.end_alone(1, traceback.print_exc)


def _start_watchdog(jax, timeout_s: float) -> None:
    """``--hang-timeout``: every process watches every process's progress (through the
    coordination service, with the beats, when there are several); the stacks go to the
    supervisor's log."""
    from ciera_models.resilience import peers
    from ciera_models.resilience import watchdog

    watchdog.start(timeout_s, jax.process_index(), jax.process_count(), peers.progress["log"])


def _stacks_on_sigusr1() -> None:
    """``kill -USR1`` prints every Python thread's stack to stderr (into the log under a
    supervisor, which passes the signal on): how a run that seems stuck shows where it is.
    A stderr without a file descriptor (a caller capturing it) gets the process's own."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # no fileno(): io.UnsupportedOperation
            continue


if __name__ == "__main__":
    from ciera_jax.cli.main import main

    sys.exit(main(["train", *sys.argv[1:]]))

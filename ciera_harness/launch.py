"""Start N local JAX processes that talk over real sockets (gloo), for tests and benchmarks.

Each child runs ``python -m MODULE ARGS`` with ``CIERA_COORDINATOR``, ``CIERA_NUM_PROCESSES``,
``CIERA_PROCESS_ID`` and ``CIERA_LOCAL_DEVICES`` set; it calls :func:`init_from_env` before
touching devices. Ports are picked free and a failed start is retried on a new port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env() -> int:
    """Join the process group described by the environment; returns this process's id."""
    from ciera_jax.runtime.devices import emulate_cpu_devices

    emulate_cpu_devices(int(os.environ["CIERA_LOCAL_DEVICES"]))
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid = int(os.environ["CIERA_PROCESS_ID"])
    jax.distributed.initialize(os.environ["CIERA_COORDINATOR"],
                               num_processes=int(os.environ["CIERA_NUM_PROCESSES"]),
                               process_id=pid, initialization_timeout=120)
    return pid


def run_local(module: str, args: list[str], *, num_processes: int, local_devices: int,
              timeout_s: float = 300, attempts: int = 3, env: dict | None = None) -> list[str]:
    """Run ``module`` in ``num_processes`` processes; returns each one's stdout.

    Raises RuntimeError with the children's output if any exits non-zero on every attempt.
    """
    last = ""
    for _ in range(attempts):
        coordinator = f"127.0.0.1:{free_port()}"
        procs = [subprocess.Popen([sys.executable, "-m", module, *args],
                                  env=child_env(coordinator, num_processes, pid, local_devices,
                                                env),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for pid in range(num_processes)]
        outs, codes = collect(procs, timeout_s)
        if all(c == 0 for c in codes):
            return outs
        last = failure_report(outs, codes)
        if "address already in use" not in last.lower():
            break
    raise RuntimeError(f"local multi-process run of {module} failed:\n{last}")


def child_env(coordinator: str, num_processes: int, pid: int, local_devices: int,
              env: dict | None = None, **extra: str) -> dict:
    """The environment :func:`init_from_env` reads in child ``pid``."""
    out = dict(os.environ, **(env or {}), JAX_PLATFORMS="cpu", CIERA_COORDINATOR=coordinator,
               CIERA_NUM_PROCESSES=str(num_processes), CIERA_PROCESS_ID=str(pid),
               CIERA_LOCAL_DEVICES=str(local_devices), **extra)
    out.pop("XLA_FLAGS", None)  # the child sets its own device count
    return out


def collect(procs, timeout_s: float) -> tuple[list[str], list[int]]:
    """Wait for every child (killing all on a timeout); their outputs and exit codes. If the
    wait itself is interrupted (Ctrl-C, SIGTERM turned into SystemExit), the children are
    killed too, so none outlives the launcher."""
    outs, codes = [], []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
                out += f"\n[timed out after {timeout_s}s]"
            outs.append(out)
            codes.append(p.returncode)
    except BaseException:
        for q in procs:
            q.kill()
        raise
    return outs, codes


def failure_report(outs: list[str], codes: list[int]) -> str:
    return "\n".join(f"--- process {i} (exit {c}) ---\n{o[-3000:]}"
                     for i, (o, c) in enumerate(zip(outs, codes)))

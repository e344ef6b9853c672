"""The supervising parent of a multi-process ``ciera train`` (ciera_models/resilience/supervisor.py), fast: a
stand-in child that aborts like JAX's client ends in the lost-peer line and 69; other exits and
signals pass through; the child's whole output is kept in the log. The real drills (a killed
coordinator or worker) are in test_lost_peer.py's slow lane."""

import argparse
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ciera_models.resilience import peers
from ciera_models.resilience import supervisor
from ciera_models.cli import train as train_cli
from ciera_models.resilience.failures import EXIT_PEER_LOST
from ciera_models.train.config import RunConfig, TrainConfig, to_argv

# what process 1 printed when process 0 was killed (jaxlib 0.10.2), abridged
ABORT = textwrap.dedent("""\
    W1201 20:56:04.503986   18767 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from coordination service: UNAVAILABLE: Socket closed
    Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/GetKeyValue:
    :UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}. This is only expected if one of the tasks is unhealthy.
    E1201 20:56:04.504097   18767 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
    F1201 20:56:04.504104   18767 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died
    Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
    :UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}
    *** Check failure stack trace: ***
        @     0x7f2778340634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
        @     0x7f27870a71f5  (unknown)
    """)

# what process 0 (the coordination service's host) printed when process 1 was killed, abridged:
# the service's own error first, in lines that look like nothing, then the client's abort
SERVICE_ABORT = textwrap.dedent("""\
    E1205 08:07:00.304670   27138 coordination_service.cc:1549] [506278181986372195] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
    1
    The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
    E1205 08:07:00.305525   27149 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
    F1205 08:07:00.305943   27149 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
    1
    The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.

    RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
    *** Check failure stack trace: ***
        @     0x7f886b640634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
        @     0x7f887a6a71f5  (unknown)
    """)


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _supervise(tmp_path, code: str, process_id: int = 1, timeout: float = 60, signal_at=None,
               signum=signal.SIGTERM):
    """Run the supervisor in a fresh Python over a stand-in child, sending it ``signum``
    ``signal_at`` seconds after the child's first line; (rc, stdout, stderr)."""
    driver = (f"import sys; from ciera_models.resilience import supervisor as s; "
              f"sys.exit(s.supervise({_child(code)!r}, {process_id}, 2, {str(tmp_path)!r}, "
              f"None))")
    p = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    first = ""
    if signal_at:
        first = p.stdout.readline()  # the child is ready for the signal
        time.sleep(signal_at)
        p.send_signal(signum)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, first + out, err


def test_the_coordination_abort_is_the_lost_peer_line_and_69(tmp_path):
    rc, out, err = _supervise(tmp_path, f"""
        import os, sys
        from ciera_models.resilience import supervisor
        print("step line", flush=True)
        supervisor.report_step(7)
        sys.stderr.write({ABORT!r}); sys.stderr.flush()
        os.abort()
        """)
    log = tmp_path / "ciera-train-process-1.log"
    assert rc == EXIT_PEER_LOST, err
    assert out == "step line\n"
    assert err.strip().count("\n") == 0, err  # one line, no C++ dump
    assert err.strip() == (
        "ciera train (process 1): lost process 0 (the coordinator) of 2 after step 7; no "
        f"checkpoint was saved: restart all processes; full log: {log}")
    kept = log.read_text()
    assert "client.h:80] Terminating process" in kept and "Check failure stack trace" in kept
    assert "step line" in kept


def test_the_service_hosts_abort_is_one_line_too(tmp_path):
    """Process 0 hosts the coordination service, whose error (in lines that look like nothing:
    ``1``, ``The tasks have crashed...``) comes before its client's abort; none of it reaches
    the terminal. The lines are written as the C++ code writes them: each message at once."""
    messages = SERVICE_ABORT.replace("\nE1205", "\n\0E1205").replace(
        "\nF1205", "\n\0F1205").split("\0")
    rc, out, err = _supervise(tmp_path, f"""
        import os, sys, time
        from ciera_models.resilience import supervisor
        supervisor.report_step(5)
        for message in {messages!r}:
            sys.stderr.write(message); sys.stderr.flush(); time.sleep(0.01)
        os.abort()
        """, process_id=0)
    assert rc == EXIT_PEER_LOST, err
    assert err.strip() == (
        "ciera train (process 0): lost process 1 of 2 after step 5; no checkpoint was saved: "
        f"restart all processes; full log: {tmp_path / 'ciera-train-process-0.log'}")


def test_other_exits_pass_through_with_their_output(tmp_path):
    rc, out, err = _supervise(tmp_path, """
        import sys
        print("hello", flush=True)
        sys.stderr.write("W1201 20:56:04.503986   18767 foo.cc:1] a C++ warning\\n")
        sys.stderr.write("ciera train: something in one line\\n")
        sys.exit(74)
        """)
    assert (rc, out) == (74, "hello\n")
    assert err == "W1201 20:56:04.503986   18767 foo.cc:1] a C++ warning\n" \
                  "ciera train: something in one line\n"  # held C++ lines are released


def test_a_held_cxx_line_reaches_the_terminal_without_an_abort(tmp_path):
    rc, _, err = _supervise(tmp_path, f"""
        import sys, time
        sys.stderr.write("E1201 20:56:04.503986   18767 foo.cc:1] alone\\n"); sys.stderr.flush()
        time.sleep({supervisor.HOLD_S + 1.5})
        sys.stderr.write("I1201 20:56:09.000000   18767 foo.cc:2] later\\n"); sys.stderr.flush()
        import os; os._exit(0)
        """)
    assert rc == 0 and "alone" in err and "later" in err


def test_sigterm_reaches_the_child_once_and_its_code_passes(tmp_path):
    rc, out, err = _supervise(tmp_path, """
        import signal, sys, time
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        print("ready", flush=True)
        t = time.monotonic()
        while not got and time.monotonic() - t < 30:
            time.sleep(0.05)
        time.sleep(0.5)  # a second signal would arrive now
        print(f"signals {len(got)}", flush=True)
        sys.exit(75)
        """, signal_at=1)
    assert rc == 75, err
    assert out == "ready\nsignals 1\n"


def test_sigusr1_reaches_the_child_whose_stacks_go_to_the_log(tmp_path):
    """How a run that seems stuck shows where it is: ``kill -USR1`` on ``ciera train``."""
    rc, _, err = _supervise(tmp_path, """
        import sys, time
        from ciera_models.cli import train as train_cli
        train_cli._stacks_on_sigusr1()
        print("ready", flush=True)
        def waiting_here():
            time.sleep(4)
        waiting_here()
        sys.exit(3)
        """, signal_at=1, signum=signal.SIGUSR1)
    assert rc == 3, err  # the signal did not end the child (nor the supervisor)
    assert "most recent call first" in err and "in waiting_here" in err
    assert "in waiting_here" in (tmp_path / "ciera-train-process-1.log").read_text()


def test_death_by_a_signal_is_128_plus_it(tmp_path):
    rc, _, _ = _supervise(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert rc == 128 + signal.SIGKILL


def test_the_child_gets_the_flags_back():
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    argv = ("--gather plain --steps 60 --devices 4 --checkpoint-dir /x --checkpoint-minutes "
            "2.5 --resume --verbose --coordinator 127.0.0.1:5 --num-processes 2 --process-id 0"
            ).split()
    args = p.parse_args(argv)
    back = [a for c in (TrainConfig, RunConfig, train_cli.LaunchConfig) for a in to_argv(c, args)]
    assert vars(p.parse_args(back)) == vars(args)
    assert sorted(back) == sorted(argv)


@pytest.mark.parametrize("text, who", [
    (ABORT, "lost process 0 (the coordinator)"),
    ("Task 1 heartbeat timeout", "lost process 1"),
    ("something else", "lost a peer process")])
def test_the_line_says_who_from_the_abort(monkeypatch, text, who):
    monkeypatch.setitem(peers.progress, "step", None)
    monkeypatch.setitem(peers.progress, "checkpoint_dir", None)
    monkeypatch.setitem(peers.progress, "log", "/l.log")
    line = peers.lost_line(2 if "Task 1" in text else 1, 3, text)
    assert f"{who} of 3 before training started" in line and line.endswith("; full log: /l.log")


# ---- runs started from a cluster's environment get the supervisor too ------------------

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[007-008]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS")):
            monkeypatch.delenv(k)
    return monkeypatch


def test_a_slurm_run_gets_the_supervisor_with_the_flags_jax_would_read(clean_env):
    from ciera_jax.cli import main as cli

    for k, v in SLURM.items():
        clean_env.setenv(k, v)
    launch = train_cli.launch_from_environment(train_cli.LaunchConfig())
    port = 4242 % 4096 + 65536 - 4096  # JAX's Slurm port: the job id in the top 4096
    assert (launch.coordinator, launch.num_processes, launch.process_id) == (
        f"node007:{port}", 2, 1)
    got = {}
    clean_env.setattr(supervisor, "supervise",
                      lambda cmd, pid, n, ck, m: got.update(cmd=cmd, pid=pid, n=n) or 0)
    assert cli.main(["train", "--steps", "1", "--peer-timeout", "9"]) == 0
    assert (got["pid"], got["n"]) == (1, 2)
    flags = " ".join(got["cmd"])
    assert (f"--coordinator node007:{port} --num-processes 2 --process-id 1 --peer-timeout 9"
            in flags), flags


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_ID": "4242"},  # an allocation, outside srun: one process, as before
    {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"},
])
def test_one_process_from_the_environment_is_left_alone(clean_env, env):
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert train_cli.launch_from_environment(train_cli.LaunchConfig()) == train_cli.LaunchConfig()


def test_a_coordinator_address_alone_is_one_line(clean_env, capsys):
    from ciera_jax.cli import main as cli

    clean_env.setenv("JAX_COORDINATOR_ADDRESS", "h:1234")
    assert cli.main(["train", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "ciera train: error: the environment starts a multi-process run (JAX_COORDINATOR_ADDRESS "
        "is set) but does not say the number of processes or this process's id; pass "
        "--coordinator, --num-processes and --process-id"), err

"""Preemption: a real SIGTERM to a training process mid-run finishes the step, saves, says where,
and exits 75; --resume then ends bitwise where a straight run ends. A second signal exits at
once. In the fast lane the signalled process is this one (``ciera train`` in-process, on the
session's compiled step); the same run as a child process, and the multi-process run (2
processes over gloo, only one of them signalled), are slow: each compiles the step anew.
"""

import builtins
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ciera_jax.cli import main as cli
from ciera_harness.launch import free_port
from ciera_models.cli import train as train_cli
from ciera_models.resilience.preemption import EXIT_PREEMPTED, PreemptionGuard
from ciera_models.train import TrainConfig
from conftest import TINY_PROGRAMS
from processes import child_env, finish  # tests/processes.py

STEPS = 20
# test_train's: the trainer is shared
TC = TrainConfig(config="tiny", schedule_steps=STEPS, **TINY_PROGRAMS)
TRAIN = [sys.executable, "-m", "ciera_jax.cli.main", "train", "--steps", str(STEPS),
         "--schedule-steps", str(STEPS), "--log-every", "1"]


@pytest.fixture(scope="module")
def straight_sha(tiny_run):
    return tiny_run("ciera").sha256  # conftest's: train(TC, steps=STEPS), once per session


def _signal_after(procs, step: int, sig, target=0, timeout_s=600) -> list[str]:
    """Read process ``target``'s output until it reports ``step``, send ``sig`` to it, and
    return every process's full output once all have exited."""
    out = []
    deadline = time.monotonic() + timeout_s
    for line in procs[target].stdout:
        out.append(line)
        if re.search(rf"step +{step}/{STEPS}\b", line):
            procs[target].send_signal(sig)
            break
        assert time.monotonic() < deadline, "".join(out)
    outs = [text for _, text, _ in finish(procs, timeout_s)]
    outs[target] = "".join(out) + outs[target]
    return outs


def _preempted_at(out: str, sig: str, ck) -> int:
    m = re.search(rf"preempted \({sig}\) after step (\d+) of {STEPS}: checkpoint saved to "
                  rf"{re.escape(str(ck))} at step (\d+); run again with --resume", out)
    assert m and m.group(1) == m.group(2), out[-3000:]
    return int(m.group(1))


def _resume_is_bitwise(ck, stopped, straight_sha, capsys):
    assert cli.main(["train", "--steps", str(STEPS), "--checkpoint-dir", str(ck),
                     "--resume"]) == 0  # --schedule-steps comes from the checkpoint
    res = capsys.readouterr().out
    assert f"resumed from {ck} at step {stopped}" in res
    assert res.strip().splitlines()[-1] == f"params_sha256={straight_sha}"


@pytest.mark.slow
def test_sigterm_mid_run_saves_and_resume_is_bitwise(tmp_path, straight_sha, capsys,
                                                     monkeypatch):
    """``ciera train`` in this process; a real SIGTERM to it once step 3 is reported."""
    ck = tmp_path / "ck"

    signalled = []

    def print_then_signal(*args, **kw):  # the command's progress lines go through print
        builtins.print(*args, **kw)
        # once: a second signal ends the process at once (the test's)
        if args and re.search(rf"step +3/{STEPS}\b", str(args[0])) and not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as m:
        m.setattr(train_cli, "print", print_then_signal, raising=False)
        code = cli.main([*TRAIN[3:], "--checkpoint-dir", str(ck)])
    out = capsys.readouterr().out
    assert code == EXIT_PREEMPTED, out[-3000:]
    stopped = _preempted_at(out, "SIGTERM", ck)
    assert stopped == 3  # it finished the step it was in, then stopped
    assert "SIGTERM received: finishing this step" in out
    _resume_is_bitwise(ck, stopped, straight_sha, capsys)


@pytest.mark.slow  # the child compiles the train step anew
def test_sigterm_to_a_child_process_saves_and_resume_is_bitwise(tmp_path, straight_sha, capsys):
    ck = tmp_path / "ck"
    proc = subprocess.Popen([*TRAIN, "--checkpoint-dir", str(ck)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = _signal_after([proc], 3, signal.SIGTERM)[0]
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    stopped = _preempted_at(out, "SIGTERM", ck)
    assert 3 <= stopped < STEPS  # it finished the step it was in, then stopped
    assert "SIGTERM received: finishing this step" in out
    _resume_is_bitwise(ck, stopped, straight_sha, capsys)


def test_first_signal_asks_second_exits_at_once():
    # Whatever the shell gave this process (a background job or nohup ignores SIGINT), the
    # guard must hand back exactly that.
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with PreemptionGuard(log=lambda s: None) as guard:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the guard holds it
        assert guard.signal_name == "SIGINT"
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    code = ("import os, signal, time\n"
            "from ciera_models.resilience.preemption import PreemptionGuard\n"
            "with PreemptionGuard() as g:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    print('asked', g.signal_name, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "print('not reached')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 128 + signal.SIGINT, p.stdout + p.stderr
    assert "asked SIGTERM" in p.stdout and "not reached" not in p.stdout
    assert "second signal (SIGINT): exiting now without saving" in p.stderr


@pytest.mark.slow
def test_multiprocess_sigterm_to_one_process_stops_both_and_resumes_bitwise(tmp_path):
    env = child_env()

    def start(ck, *extra):
        port = free_port()
        return [subprocess.Popen(
            [*TRAIN, "--devices", "4", "--checkpoint-dir", str(ck), *extra,
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
             str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]

    def finished(procs, code=0) -> list[str]:
        outs = [text for _, text, _ in finish(procs, 900)]
        assert [p.returncode for p in procs] == [code] * 2, outs[0][-2000:] + outs[1][-2000:]
        return outs

    straight = finished(start(tmp_path / "straight"))[0].strip().splitlines()[-1]
    assert straight.startswith("params_sha256=")
    # Only process 1 is signalled (it logs nothing: signal it when process 0 reports step 3);
    # both must stop after the same step, and save it together.
    ck = tmp_path / "ck"
    procs = start(ck)
    outs = []
    for line in procs[0].stdout:
        outs.append(line)
        if re.search(rf"step +3/{STEPS}\b", line):
            procs[1].send_signal(signal.SIGTERM)
            break
    out = "".join(outs) + finished(procs, EXIT_PREEMPTED)[0]
    stopped = re.search(r"preempted \((.+)\) after step (\d+)", out)
    assert stopped and stopped.group(1) == "a signal on another process", out[-2000:]
    assert 3 <= int(stopped.group(2)) < STEPS
    out = finished(start(ck, "--resume"))[0]
    assert f"at step {stopped.group(2)}" in out
    assert out.strip().splitlines()[-1] == straight

"""A lost process is one line: a peer killed mid-run (2 processes over gloo) and a peer that never
starts both end the survivor within --peer-timeout with exit 69 and one line on stderr, naming
the lost process, the last step and the newest checkpoint -- not JAX's C++ abort dump."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ciera_harness.launch import free_port
from ciera_models.resilience import peers
from ciera_models.resilience.failures import EXIT_HUNG, EXIT_PEER_LOST
from processes import child_env, finish, kill_all, log_tails  # tests/processes.py

TRAIN = [sys.executable, "-m", "ciera_jax.cli.main", "train", "--schedule-steps", "40",
         "--log-every", "1", "--devices", "4", "--num-processes", "2"]
ENV = child_env()


def test_the_line_names_the_lost_process_and_the_newest_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "5").mkdir()
    (tmp_path / "10").mkdir()
    (tmp_path / "damaged").mkdir()
    (tmp_path / "5.orbax-checkpoint-tmp-1234").mkdir()  # a leftover older than step 10
    monkeypatch.setitem(peers.progress, "step", 12)
    monkeypatch.setitem(peers.progress, "checkpoint_dir", str(tmp_path))
    monkeypatch.setitem(peers.progress, "log", None)
    assert peers.lost_line(0, 2, "unhealthy (stopped sending heartbeats): 1") == (
        f"ciera train (process 0): lost process 1 of 2 after step 12; the newest complete "
        f"checkpoint is step 10 in {tmp_path}: restart all 2 processes with --resume")
    (tmp_path / "12.orbax-checkpoint-tmp-5678").mkdir()  # step 12's save was in flight
    assert peers.lost_line(0, 2, "unhealthy (stopped sending heartbeats): 1").endswith(
        f"the newest complete checkpoint is step 10 in {tmp_path} (the save of step 12 did "
        "not finish): restart all 2 processes with --resume")
    assert "lost process 0 (the coordinator) of 2" in peers.lost_line(
        1, 2, "coordination service unavailable: UNAVAILABLE")
    monkeypatch.setitem(peers.progress, "checkpoint_dir", None)
    assert peers.lost_line(0, 3, "Gloo AllGather failed").endswith(
        "lost a peer process of 3 after step 12; nothing was saved (no --checkpoint-dir): "
        "restart all processes")
    # every peer still beat after the wait: the collective failed on its own, quoted
    assert peers.lost_line(0, 3, "INTERNAL: Gloo connect timed out\nstack", beating_s=60) == (
        "ciera train (process 0): a collective failed after step 12, and all 3 processes still "
        "beat 60 s later (INTERNAL: Gloo connect timed out); nothing was saved (no "
        "--checkpoint-dir): restart all processes")
    line = peers.lost_line(1, 3, "UNAVAILABLE: " + "x" * 500, beating_s=60)  # not process 0's
    assert "a collective failed after step 12" in line and "x" * 180 + "...)" in line
    assert len(line) < 400


def test_a_failed_collective_nobody_is_lost_from_says_so(monkeypatch):
    """lost_peer waits for the watcher; when it names nobody, the line quotes the failure."""
    said = []
    monkeypatch.setattr(peers, "_say_and_exit", lambda *a, **k: said.append((a, k)))
    peers.lost_peer(RuntimeError("Gloo connect timed out"), 1, 2, timeout_s=0)
    assert said == [((1, 2, "Gloo connect timed out"), {"beating_s": 0})]


def test_a_peer_is_lost_after_its_beat_stands_still_while_this_watcher_watches():
    """A peer whose beat stops is named ``limit`` seconds later; a stall of the watcher's own
    (a late round: this process starved) does not count against a peer that beats on."""
    watch = peers.PeerBeats([1, 2], limit=5.0, now=0.0)
    beat = {1: 0, 2: 0}

    def beats(*beating):
        for i in beating:
            beat[i] += 1
        return {f"{peers.BEATS}{i}": str(b) for i, b in beat.items()}

    assert watch.round(beats(1, 2), 1.0) == []
    assert watch.round(beats(), 41.0) == []  # 40 s late, counted as 2 (3 watched in all)
    assert watch.round(beats(2), 42.0) == []  # 1 beats no more: 1 stood still for 3
    assert watch.round(beats(2), 44.0) == []  # 5
    assert watch.round(beats(2), 45.0) == [1]  # 6 watched seconds > 5
    assert watch.round(beats(1, 2), 46.0) == []  # a beat again: fresh


def test_a_peer_that_never_starts_is_one_line_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([*TRAIN, "--steps", "5", "--coordinator", f"127.0.0.1:{free_port()}",
                        "--process-id", "0", "--peer-timeout", "3"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_PEER_LOST == 69, p.stderr[-2000:]
    assert p.stderr.strip().count("\n") == 0, p.stderr[-2000:]
    assert p.stderr.startswith("ciera train (process 0): the process group at 127.0.0.1:")
    assert "did not form within --peer-timeout 3s" in p.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_killed_peer_ends_the_survivor_in_one_line(tmp_path):
    ck, port, timeout_s = tmp_path / "ck", free_port(), 10
    procs = [subprocess.Popen(
        [*TRAIN, "--steps", "40", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
         "--coordinator", f"127.0.0.1:{port}", "--process-id", str(i), "--peer-timeout",
         str(timeout_s)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        for line in procs[0].stdout:
            if re.search(r"step +5/40\b", line):
                procs[1].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                break
        out, err = procs[0].communicate(timeout=300)
        waited = time.monotonic() - killed
    finally:
        kill_all(procs)
    assert procs[0].returncode == EXIT_PEER_LOST, err[-3000:]
    assert err.strip().count("\n") == 0, err[-3000:]  # one line, no C++ abort dump
    m = re.fullmatch(rf"ciera train \(process 0\): lost process 1 of 2 after step (\d+); the "
                     rf"newest complete checkpoint is step (\d+) in {re.escape(str(ck))}"
                     r"(?: \(the save of step \d+ did not finish\))?: restart all 2 "
                     r"processes with --resume; full log: "
                     rf"{re.escape(str(ck / 'ciera-train-process-0.log'))}", err.strip())
    assert m, err
    assert int(m.group(2)) <= int(m.group(1)) and (ck / m.group(2)).is_dir()  # intact, there
    assert waited < timeout_s + 60


# --- the lost coordinator and the cross-process fallback (slow: several 2-process runs) ---

STEPS = 12  # every run below trains towards the same 12-step schedule


def _start(ck, port: int, *extra: str, steps: int = STEPS, env: dict | None = None):
    """Both processes of a run; ``env``: more of the environment, for both. A run that stops
    moving ends in the watchdog's line (where each process was) well before the 400 s limit;
    nothing here waits that long without progress or a compile."""
    return [subprocess.Popen(
        [*TRAIN, "--steps", str(steps), "--checkpoint-dir", str(ck), "--coordinator",
         f"127.0.0.1:{port}", "--process-id", str(i), "--hang-timeout", "150", *extra],
        env={**ENV, "JAX_PLATFORMS": "cpu", **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def _logs(ck) -> list:
    """Both processes' logs, which their supervisors keep in the checkpoint folder ``ck``."""
    return [ck / f"ciera-train-process-{i}.log" for i in range(2)]


def _finish(procs, ck=None) -> list[tuple[int, str, str]]:
    """Every 2-process run here ends within 400 s (about 45 s on an idle 2-core machine);
    ``ck``: the run's checkpoint folder, where each process's log is (shown if it hangs)."""
    return finish(procs, 400, _logs(ck) if ck else None)


def _sha(out: str) -> str:
    m = re.search(r"params_sha256=([0-9a-f]{64})", out)
    assert m, out[-2000:]
    return m.group(1)


@pytest.fixture(scope="module")
def straight_sha(tmp_path_factory):
    """params_sha256 of a straight 2-process run of STEPS steps."""
    (rc0, out, err), (rc1, _, err1) = _finish(_start(tmp_path_factory.mktemp("straight"),
                                                     free_port()))
    assert rc0 == rc1 == 0, err[-2000:] + err1[-2000:]
    return _sha(out)


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_either_lost_process_is_one_line_and_resume_is_bitwise(killed, tmp_path, straight_sha):
    """Kill process ``killed`` (its ``ciera train``: the job dies with it) at step 5: the other
    prints the one line, exits 69, shows no C++ dump and keeps its full log where the line
    says; a resume of both ends bitwise on the straight run."""
    ck, timeout_s = tmp_path / "ck", 10
    procs = _start(ck, free_port(), "--checkpoint-every", "2", "--peer-timeout", str(timeout_s))
    survivor = procs[1 - killed]
    try:
        for line in procs[0].stdout:
            if re.search(rf"step +5/{STEPS}\b", line):
                procs[killed].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                break
        out, err = survivor.communicate(timeout=timeout_s + 120)
        waited = time.monotonic() - killed_at
    finally:
        kill_all(procs)
    s = 1 - killed
    assert survivor.returncode == EXIT_PEER_LOST, err[-3000:]
    assert err.strip().count("\n") == 0, err[-3000:]
    assert "Check failure" not in out + err and "client.h" not in out + err
    log = ck / f"ciera-train-process-{s}.log"
    who = "lost process 0 (the coordinator)" if killed == 0 else "lost process 1"
    m = re.fullmatch(rf"ciera train \(process {s}\): {re.escape(who)} of 2 after step (\d+); "
                     rf"the newest complete checkpoint is step (\d+) in {re.escape(str(ck))}"
                     r"(?: \(the save of step \d+ did not finish\))?: restart "
                     rf"all 2 processes with --resume; full log: {re.escape(str(log))}",
                     err.strip())
    assert m, err
    assert (ck / m.group(2)).is_dir() and log.is_file()
    if killed == 0:  # the abort reached the log, not the terminal
        assert "Terminating process because the JAX distributed service" in log.read_text()
    assert waited < timeout_s + 30
    (rc0, out0, e0), (rc1, _, e1) = _finish(_start(ck, free_port(), "--resume"), ck)
    assert rc0 == rc1 == 0, e0[-2000:] + e1[-2000:]
    assert "resumed from" in out0
    assert _sha(out0) == straight_sha


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["cut arrays", "stale shard digests"])
def test_a_checkpoint_damaged_on_one_process_falls_back_on_both(damage, tmp_path, straight_sha):
    """Step 8 is damaged where only process 1 looks: its array file cut short, as a process
    killed between its writes would leave it; or its shard digests those of step 4 (its
    shards then do not match, which only process 1 checks). Both processes set step 8 aside,
    restore step 4 and end bitwise on the straight run."""
    ck = tmp_path / "ck"
    (rc0, _, e0), (rc1, _, e1) = _finish(_start(ck, free_port(), "--checkpoint-every", "4",
                                                steps=8), ck)
    assert rc0 == rc1 == 0, e0[-2000:] + e1[-2000:]
    if damage == "cut arrays":
        data = sorted(p for p in (ck / "8" / "state" / "ocdbt.process_1").rglob("*")
                      if p.is_file())
        assert data, sorted(p.name for p in (ck / "8" / "state").iterdir())
        for f in data:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        shutil.copy(ck / "4" / "digests" / "process_1.json",
                    ck / "8" / "digests" / "process_1.json")
    (rc0, out0, e0), (rc1, out1, e1) = _finish(_start(ck, free_port(), "--resume"), ck)
    assert rc0 == rc1 == 0, (out0[-3000:] + e0[-2000:] + out1[-3000:] + e1[-2000:]
                             + log_tails(_logs(ck)))
    assert re.search(rf"checkpoint step 8 in {re.escape(str(ck))} is damaged \(.*\): set aside "
                     r"as .*damaged/8; trying step 4", out0), out0[-3000:]
    assert f"resumed from {ck} at step 4" in out0
    assert (ck / "damaged" / "8").is_dir() and not (ck / "8").exists()
    assert _sha(out0) == straight_sha
    # the reads the failed restore left unfinished say nothing when they are collected (their
    # errors, each with its array's whole spec, would fill an undrained pipe and hang the run)
    assert "_read_array_index_and_device_put" not in e0 + e1, e1[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("crashed", [0, 1])
def test_a_crash_on_one_process_ends_it_and_the_other_sees_a_lost_peer(crashed, tmp_path):
    """``--inject-crash 3:<crashed>``: that process raises before step 3, as a bug there alone
    would, while the other goes into the step. The crashed one prints its traceback and ends
    (exit 1) at once, not in JAX's exit-time shutdown, where it would wait for the other while
    the other waits for it in the step: a hang until killed. The other ends in the lost-peer
    line (exit 69). The gather does not matter here: plain compiles fastest."""
    ck, timeout_s = tmp_path / "ck", 10
    results = finish(_start(ck, free_port(), "--gather", "plain", "--peer-timeout",
                            str(timeout_s), "--inject-crash", f"3:{crashed}", steps=6), 300)
    (rc_c, _, err_c), (rc_s, out_s, err_s) = results[crashed], results[1 - crashed]
    assert rc_c == 1, err_c[-3000:]
    assert err_c.strip().splitlines()[-1] == (
        "ciera_models.resilience.crash_drill.InjectedCrash: injected crash (--inject-crash) before step 3 "
        f"on process {crashed}"), err_c[-3000:]
    assert "Traceback (most recent call last)" in err_c
    s = 1 - crashed
    who = "lost process 0 (the coordinator)" if crashed == 0 else "lost process 1"
    assert rc_s == EXIT_PEER_LOST, err_s[-3000:]
    assert err_s.strip() == (
        f"ciera train (process {s}): {who} of 2 after step 2; no checkpoint was saved: restart "
        f"all processes; full log: {ck / f'ciera-train-process-{s}.log'}"), err_s[-3000:]
    assert "Check failure" not in out_s + err_s


@pytest.mark.slow
def test_a_process_stuck_alive_ends_every_process_in_one_line_with_its_stacks(tmp_path):
    """``--inject-hang 3:1``: process 1 stops before step 3, alive (its heartbeats go on, so no
    peer is lost), while process 0 waits for it in step 3. Neither moves for ``--hang-timeout``
    seconds: each writes every thread's stack to its log and ends in one line that names where
    both were and the checkpoint to resume from, exit 70. Without the watchdog: a hang until
    killed."""
    ck, timeout_s = tmp_path / "ck", 15
    procs = _start(ck, free_port(), "--gather", "plain", "--checkpoint-every", "2",
                   "--inject-hang", "3:1", "--hang-timeout", str(timeout_s), steps=6)
    results = _finish(procs, ck)
    for i, (rc, _, err) in enumerate(results):
        log = ck / f"ciera-train-process-{i}.log"
        assert rc == EXIT_HUNG, err[-3000:]
        assert re.fullmatch(
            rf"ciera train \(process {i}\): no progress for {timeout_s} s \(--hang-timeout\): "
            r"process 0 in step 3, process 1 before step 3 \(--inject-hang\); stopped; the "
            rf"newest complete checkpoint is step 2 in {re.escape(str(ck))}"
            r"(?: \(the save of step \d+ did not finish\))?: restart all 2 processes with "
            rf"--resume; the stacks of every thread: in {re.escape(str(log))}",
            err.strip()), err[-3000:]
        stacks = log.read_text().split("--- the watchdog: every thread's stack ---")[-1]
        # process 0 waits in step 3's collective, or (gloo's own connect timed out first)
        # for the peer watcher to name a lost peer, which it cannot: process 1 still beats
        assert ("hang_if_due" in stacks if i == 1 else
                "_one_step" in stacks or "lost_peer" in stacks), stacks[-3000:]


@pytest.mark.slow
def test_a_file_missing_on_one_host_ends_that_process_and_the_other_sees_a_lost_peer(tmp_path):
    """Process 1's ``--data`` does not exist (a file on one host only), which it finds after
    the process group formed: it ends in its bad-input line (exit 2) at once, not in JAX's
    exit-time shutdown waiting for process 0, and process 0 ends in the lost-peer line."""
    ck, missing, port = tmp_path / "ck", tmp_path / "tokens-here-only.bin", free_port()
    procs = [subprocess.Popen(
        [*TRAIN, "--steps", "6", "--gather", "plain", "--checkpoint-dir", str(ck),
         "--coordinator", f"127.0.0.1:{port}", "--process-id", str(i), "--peer-timeout", "10",
         *(["--data", str(missing)] if i == 1 else [])], env={**ENV, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 300)
    assert rc1 == 2, err1[-3000:]
    assert err1.strip() == (f"ciera train (process 1): error: data file not found: "
                            f"{missing}"), err1[-3000:]
    assert rc0 == EXIT_PEER_LOST, err0[-3000:]
    assert re.fullmatch(r"ciera train \(process 0\): lost process 1 of 2 (before training "
                        r"started|after step \d+); .*", err0.strip()), err0[-3000:]
    assert "Check failure" not in out0 + err0


@pytest.mark.slow
@pytest.mark.parametrize("full", [1, 0])
def test_a_save_failing_on_one_host_ends_that_process_and_the_other_sees_a_lost_peer(
        full, tmp_path):
    """Process ``full``'s disk is full (every checkpoint write there fails as orbax's does,
    ``tests/full_disk/sitecustomize.py``), the other's is not: the first save fails on that
    process alone. It ends in its write-failed line (exit 74) at once, not in JAX's exit-time
    shutdown waiting for the other, which was saving beside it; the other ends in the
    lost-peer line (exit 69), and no step is in place that one host did not write."""
    ck = tmp_path / "ck"
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "full_disk")
    env = {"CIERA_TEST_FULL_DISK": str(full),
           "PYTHONPATH": os.pathsep.join(filter(None, [here, ENV.get("PYTHONPATH")]))}
    results = finish(_start(ck, free_port(), "--gather", "plain", "--checkpoint-every", "2",
                            "--peer-timeout", "10", steps=6, env=env), 300)
    (rc_f, _, err_f), (rc_s, out_s, err_s) = results[full], results[1 - full]
    assert rc_f == 74, err_f[-3000:]
    assert re.fullmatch(
        rf"ciera train \(process {full}\): checkpoint: saving step 2 to \S+ failed \(.*No space "
        r"left on device.*\); the newest checkpoint is none: free space \(or fix the folder\), "
        r"then rerun with --resume", err_f.strip()), err_f[-3000:]
    s = 1 - full
    who = "lost process 0 (the coordinator)" if full == 0 else "lost process 1"
    assert rc_s == EXIT_PEER_LOST, err_s[-3000:]
    assert re.fullmatch(rf"ciera train \(process {s}\): {re.escape(who)} of 2 after step 2; "
                        r"no checkpoint was saved: .*", err_s.strip()), err_s[-3000:]
    assert "Check failure" not in out_s + err_s
    assert not (ck / "2").exists()

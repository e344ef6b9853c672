"""Repeats ``ciera train``'s checkpoint and signal endings, optionally beside a training run (the
load), and says of each run whether it ended as documented: the documented exit code, no death
by signal, and nothing after its one line (no traceback, no asyncio report of an exception never
retrieved, no error at exit).

Cases:
  ck_resume_config, ck_resume_seed, ck_resume_gather: ``--resume`` of a saved checkpoint with a
      different --config, --seed or --gather: refused in one line, exit 2.
  disk_ckpt_message: checkpoints onto a tmpfs too small for the second save (root only, it
      mounts one): exit 74.
  sig_term, sig_int: the signal once step 5's checkpoint is saved: exit 75.

    python benchmarks/reliability_drill.py --repeats 20 --load
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import parser, print_table, write_results

CASES = ("ck_resume_config", "ck_resume_seed", "ck_resume_gather", "disk_ckpt_message",
         "sig_term", "sig_int")
RESUME_FLAGS = {"ck_resume_config": ["--config", "small"], "ck_resume_seed": ["--seed", "1"],
                "ck_resume_gather": ["--gather", "plain"]}
NOISE = ("Traceback", "never retrieved", "cannot schedule new futures", "Error in atexit")
TMPFS_SIZE = "3600k"  # holds the first tiny checkpoint, not the second
SAVED_WAIT_S = 600


def _train(*args: str, out: Path | None = None, err: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ciera_jax.cli.main", "train", "--config", "tiny", *args],
        stdout=open(out, "w") if out else subprocess.DEVNULL,
        stderr=open(err, "w") if err else subprocess.DEVNULL)


def _verdict(case: str, rc: int, want: int, err: Path) -> dict:
    text = err.read_text(errors="replace")
    problems = []
    if rc < 0:
        problems.append(f"died of signal {-rc}")
    elif rc != want:
        problems.append(f"exit {rc} (want {want})")
    problems += [f"'{n}' on stderr" for n in NOISE if n in text]
    lines = text.strip().splitlines()
    return {"case": case, "exit": rc, "want": want, "ok": not problems,
            "problems": problems, "last_line": lines[-1][:160] if lines else ""}


def _resume(case: str, saved: Path, work: Path) -> dict:
    shutil.copytree(saved, work / "ck")
    p = _train("--steps", "15", "--checkpoint-dir", str(work / "ck"), "--resume",
               *RESUME_FLAGS[case], out=work / "out", err=work / "err")
    return _verdict(case, p.wait(), 2, work / "err")


def _full_disk(work: Path) -> dict:
    mount = work / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
                   check=True)
    try:
        p = _train("--steps", "10", "--checkpoint-dir", str(mount / "ck"), "--checkpoint-every",
                   "5", out=work / "out", err=work / "err")
        return _verdict("disk_ckpt_message", p.wait(), 74, work / "err")
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _signal(case: str, work: Path) -> dict:
    sig = signal.SIGTERM if case == "sig_term" else signal.SIGINT
    p = _train("--steps", "200", "--checkpoint-dir", str(work / "ck"), "--checkpoint-every", "5",
               out=work / "out", err=work / "err")
    deadline = time.monotonic() + SAVED_WAIT_S
    while (not (work / "ck" / "5").is_dir() and p.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.2)
    p.send_signal(sig)
    return _verdict(case, p.wait(), 75, work / "err")


def run_case(case: str, saved: Path, work: Path) -> dict:
    t0 = time.monotonic()
    if case in RESUME_FLAGS:
        row = _resume(case, saved, work)
    elif case == "disk_ckpt_message":
        row = _full_disk(work)
    else:
        row = _signal(case, work)
    return {**row, "seconds": round(time.monotonic() - t0, 1)}


def _write(args, rows: list[dict], loads: list[float]) -> dict:
    """Write the runs so far to ``args.out``; returns each case's passes out of its runs."""
    summary = {c: {"runs": sum(r["case"] == c for r in rows),
                   "passed": sum(r["case"] == c and r["ok"] for r in rows)} for c in args.cases}
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        write_results(args.out, {"load_beside": args.load, "summary": summary, "runs": rows,
                                 "load_avg_1min": {"min": min(loads, default=None),
                                                   "max": max(loads, default=None)}})
    return summary


def main(argv=None) -> int:
    day = datetime.date.today().isoformat()
    p = parser(__doc__, f"reliability_drill_{day}")
    p.add_argument("--repeats", type=int, default=5, help="runs of each case (default: 5)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                   help="which cases (default: all)")
    p.add_argument("--load", action="store_true",
                   help="keep another training run going beside the drill")
    args = p.parse_args(argv)
    if "disk_ckpt_message" in args.cases and os.geteuid() != 0:
        p.error("disk_ckpt_message mounts a tmpfs: run as root, or leave it out of --cases")
    # SIGTERM runs the clean-ups below too: a drill stopped mid-case unmounts its tmpfs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    root = Path(tempfile.mkdtemp(prefix="ciera-drill-"))
    saved = root / "saved"
    if any(c in RESUME_FLAGS for c in args.cases):
        if _train("--steps", "10", "--checkpoint-dir", str(saved), "--checkpoint-every",
                  "5").wait() != 0:
            print("the checkpoint to resume from could not be made", file=sys.stderr)
            return 1
    beside = _train("--steps", "1000000") if args.load else None
    rows, loads = [], []
    columns = [("repeat", 6, "repeat"), ("case", 18, "case"), ("exit", 4, "exit"),
               ("s", 6, ("seconds", ".1f")), ("verdict", 7, lambda r: "PASS" if r["ok"]
                                                   else "FAIL"),
               ("problems", 0, lambda r: "; ".join(r["problems"]))]
    print_table([], columns)
    try:
        for i in range(1, args.repeats + 1):
            for case in args.cases:
                work = root / f"{case}-{i}"
                work.mkdir()
                row = {"repeat": i, **run_case(case, saved, work),
                       "load_avg": [round(x, 2) for x in os.getloadavg()]}
                rows.append(row)
                loads.append(row["load_avg"][0])
                print_table([row], columns, header=False)
            _write(args, rows, loads)  # after each repeat: an interrupted drill keeps its runs
    finally:
        if beside is not None:
            beside.kill()
            beside.wait()
    for c, s in _write(args, rows, loads).items():
        print(f"{c}: {s['passed']}/{s['runs']} passed")
    print(f"wrote {args.out}")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

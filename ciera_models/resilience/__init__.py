"""What keeps a multi-process run honest: lost peers, hangs, signals, the folder lock, exit
codes, and the drills that exercise them (docs/training.md).

failures.py     exit codes and the failures a run reports in one line
peers.py        lost peers: heartbeats, the one line, restart advice
watchdog.py     ``--hang-timeout``: stacks to the log, one line, exit 70
preemption.py   signals agreed across processes; values every process agrees on
supervisor.py   the parent of a multi-process run
run_lock.py     the checkpoint folder's lock
crash_drill.py  ``--inject-crash`` and ``--inject-hang``
cache_fault.py  ``--inject-cache-fault``: the drill
corrupt.py      corrupting one rank's copy of a replicated cache

Imports :mod:`ciera_models.model` and the library only.
"""

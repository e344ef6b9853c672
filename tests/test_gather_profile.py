"""``benchmarks/gather_profile.py``: a gather's kernels read from JAX's profiler trace (the
check ``gpu_check.sh`` runs on a GPU), here on the host's events."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gather_profile.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))  # its `from common import ...`
    try:
        spec = importlib.util.spec_from_file_location("gather_profile", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_kernel_times_reads_the_device_processes_or_the_host_ones():
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "encode_kernel", "dur": 30.0},
        {"ph": "X", "pid": 1, "name": "encode_kernel", "dur": 10.0},
        {"ph": "X", "pid": 1, "name": "all-gather", "dur": 5.0},
        {"ph": "i", "pid": 1, "name": "an instant, not a span"},
        {"ph": "X", "pid": 2, "name": "PjitFunction(ciera)", "dur": 99.0}]}
    mod = _module()
    assert mod.kernel_times(trace, "device") == {"encode_kernel": [2, 40.0],
                                                 "all-gather": [1, 5.0]}
    assert mod.kernel_times(trace, "host") == {"PjitFunction(ciera)": [1, 99.0]}
    s = mod.summary(mod.kernel_times(trace, "device"), wall_s=100e-6, reps=1, top=1)
    assert s["kernels_per_call"] == 3 and abs(s["kernel_ms_per_call"] - 0.045) < 1e-12
    assert abs(s["uncovered_share"] - 0.55) < 1e-9 and [k["name"] for k in s["top"]] == [
        "encode_kernel"]


def test_the_script_profiles_each_mode_on_one_cpu_device(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, str(SCRIPT), "--devices", "1", "--events", "host",
                    "--shape", "2", "256", "128", "--reps", "2", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300, cwd=ROOT)
    methods = json.loads(out.read_text())["results"]["methods"]
    assert set(methods) == {"exponent", "word", "plain"}
    for r in methods.values():
        assert r["wall_ms_per_call"] > 0 and r["kernels_per_call"] > 0 and r["top"]

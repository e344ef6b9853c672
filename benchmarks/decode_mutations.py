"""Does the suite fail when a mode's exactness breaks? Each mutation flips one bit of the
first element every decode of one mode returns; the tests run on a copy of the tree that has
it (a git worktree of HEAD), and the table lists the tests that failed.

- ``exponent``: ``codec.bitfields.merge``, exponent mode's decode (and the jnp reference the
  kernels are checked against);
- ``word``: ``codec.wordcodec.dense_decode``, word mode's dense rebuild (the same).

The mutations run side by side, each on ``--workers`` pytest workers; ``--lane fast`` runs
``-m "not slow"``, ``all`` every test.

    python benchmarks/decode_mutations.py --out benchmarks/results/decode_mutations.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLIP = "{v} = {v} ^ jnp.zeros_like({v}).reshape(-1).at[0].set(1).reshape({v}.shape)"
MUTATIONS = {
    "exponent": ("ciera_jax/codec/bitfields.py",
                 "    return lax.bitcast_convert_type(word, fmt.dtype)",
                 "    if word.size:\n        " + FLIP.format(v="word")
                 + "\n    return lax.bitcast_convert_type(word, fmt.dtype)"),
    "word": ("ciera_jax/codec/wordcodec.py",
             "    return apply_delta(cached_bits, d)",
             "    out = apply_delta(cached_bits, d)\n    if out.size:\n        "
             + FLIP.format(v="out") + "\n    return out"),
}


def mutated_tree(name: str) -> Path:
    """A worktree of HEAD with mutation ``name`` applied."""
    tree = Path(tempfile.mkdtemp(prefix=f"ciera-mutation-{name}-"))
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), "HEAD"],
                   cwd=ROOT, check=True, capture_output=True)
    path, old, new = MUTATIONS[name]
    text = (tree / path).read_text()
    if text.count(old) != 1:
        raise SystemExit(f"decode_mutations: {path} changed; the {name} mutation needs updating")
    (tree / path).write_text(text.replace(old, new))
    return tree


def start(tree: Path, lane: str, workers: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           "-n", str(workers)] + (["-m", "not slow"] if lane == "fast" else [])
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def outcome(out: str) -> dict:
    # -rfE lists "FAILED <id> - <reason>", and "ERROR <id> - <reason>" for a fixture's failure
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.M)))
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error)", out)}
    return {"failed": failed, "counts": counts, "tail": out[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", nargs="+", choices=sorted(MUTATIONS), default=list(MUTATIONS))
    ap.add_argument("--lane", choices=("fast", "all"), default="fast")
    ap.add_argument("--workers", type=int, default=1, help="pytest workers per mutation")
    ap.add_argument("--out", help="JSON path")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below still runs
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # what is tested
    trees = {m: mutated_tree(m) for m in a.mutations}
    t0 = time.time()
    procs = {m: start(t, a.lane, a.workers) for m, t in trees.items()}
    results = {}
    try:
        for m, p in procs.items():
            out, _ = p.communicate()
            results[m] = {**outcome(out), "returncode": p.returncode,
                          "wall_s": round(time.time() - t0, 1)}
    finally:
        for p in procs.values():
            p.kill()
        for t in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(t)], cwd=ROOT,
                           capture_output=True)
    for m, r in results.items():
        print(f"{m}: {r['counts']} (exit {r['returncode']}, {r['wall_s']:.0f} s); "
              f"{len(r['failed'])} tests failed:")
        for test in r["failed"]:
            print(f"  {test}")
    if a.out:
        Path(a.out).write_text(json.dumps({"commit": commit, "lane": a.lane,
                                           "date": time.strftime("%Y-%m-%d"),
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""What a checkpoint's digests cost at scale: host-side SHA-256 of the whole training state.

    python benchmarks/digest_cost.py [--config olmoe-1b-7b] [--buffer-mb 1024] [--reps 3]

A save records ``params_sha256`` and ``opt_state_sha256`` (models/checkpoint.py): every leaf is
brought whole to the host (``host_array``), copied to bytes (``tobytes``) and hashed, in the
saving process, one core. SHA-256 is a stream: its time is linear in the bytes and does not
depend on their values, so a large buffer, timed as the save does it (copy + hash), gives the
rate, and the state's byte count (``ciera_jax.planning.memory``: float32 params + AdamW's two
float32 moments, whole -- the digest hashes the whole state, on every host) over the rate is
the time. The device-to-host transfer and the cross-process gather come on top and are not
timed here. Prints one line and writes JSON.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from common import parser, write_results  # benchmarks/common.py, beside this script


def state_bytes(config: str) -> dict:
    """The whole training state a save hashes, in bytes (params + optimizer state)."""
    from ciera_jax.planning import memory

    m = memory.memory_per_gpu(config, 1)  # N=1: the whole state, not one GPU's shard
    return {"params": m.params, "optimizer": m.optimizer, "total": m.params + m.optimizer}


def hash_rate(nbytes: int, reps: int) -> dict:
    """Best-of-``reps`` seconds for the save's path (contiguous copy to bytes, then SHA-256) and
    for SHA-256 alone, on a float32 buffer of ``nbytes``."""
    a = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    copy_hash, hash_only = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
        copy_hash.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hashlib.sha256(memoryview(a).cast("B")).hexdigest()
        hash_only.append(time.perf_counter() - t0)
    return {"buffer_bytes": a.nbytes, "copy_and_hash_s": min(copy_hash),
            "hash_only_s": min(hash_only)}


def main(argv=None) -> dict:
    p = parser(__doc__, "digest_cost")
    p.add_argument("--config", default="olmoe-1b-7b")
    p.add_argument("--buffer-mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    size = state_bytes(args.config)
    rate = hash_rate(args.buffer_mb << 20, args.reps)
    gbs = rate["buffer_bytes"] / rate["copy_and_hash_s"] / 1e9
    est = size["total"] / (rate["buffer_bytes"] / rate["copy_and_hash_s"])
    est_hash = size["total"] / (rate["buffer_bytes"] / rate["hash_only_s"])
    print(f"{args.config}: state {size['total'] / 1e9:.1f} GB (params {size['params'] / 1e9:.1f}"
          f" + optimizer {size['optimizer'] / 1e9:.1f}); copy+SHA-256 {gbs:.2f} GB/s on a "
          f"{rate['buffer_bytes'] >> 20} MiB buffer -> {est:.0f} s per save "
          f"({est_hash:.0f} s for the hash alone)", flush=True)
    write_results(args.out, {"config": args.config, "state_bytes": size, **rate,
                             "rate_gb_s": gbs, "estimated_save_digest_s": est,
                             "estimated_hash_only_s": est_hash})
    return {"estimated_save_digest_s": est}


if __name__ == "__main__":
    main()

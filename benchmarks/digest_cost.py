"""What a checkpoint's digests cost at scale, before and after per-shard digests.

    python benchmarks/digest_cost.py [--config olmoe-1b-7b] [--buffer-mb 1024] [--reps 3]
                                     [--gpus 16 --gpus-per-host 8] [--devices 8]

Before (checkpoint format 1): a save recorded ``params_sha256`` and ``opt_state_sha256``: every
leaf brought whole to the host (``host_array``), copied to bytes (``tobytes``) and hashed, in
the saving process, on one core, on the step's critical path. SHA-256 is a stream: its time is
linear in the bytes and does not depend on their values, so a large buffer, timed as the save
did it (copy + hash), gives the rate, and the state's byte count (``ciera_jax.planning.memory``:
float32 params + AdamW's two float32 moments, whole) over the rate is the time. The
device-to-host transfer and the cross-process gather came on top and are not timed here.

After (format 2, ciera_models/checkpoint/shard_digest.py): each process copies the shards it holds to host
memory (``take``: the only part the loop waits for) and hashes them in ``workers()`` threads in
orbax's background commit (``record``). Both are timed here on a float32 state of
``--buffer-mb`` sharded over ``--devices`` emulated devices, as the save runs them, and scaled
to one host's share of the state (``--gpus`` over ``--gpus-per-host``). On CPU devices ``take``
is a memory copy; on GPUs it is the device-to-host transfer instead (not measured here).
Prints two lines and writes JSON.
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


def shard_path(nbytes: int, devices: int, reps: int) -> dict:
    """Best-of-``reps`` seconds for the format-2 save's two parts on a float32 state of
    ``nbytes`` sharded over ``devices`` (a params tree and a moments tree, like a save's)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from ciera_jax.runtime.devices import make_mesh
    from ciera_models.checkpoint import shard_digest

    split = NamedSharding(make_mesh(devices), PartitionSpec("fsdp"))
    rows = nbytes // 4 // 1024 // devices * devices
    leaves = 8  # a few leaves, as a real tree has many
    tree = {f"w{i}": jax.device_put(jnp.full((rows // leaves, 1024), i, jnp.float32), split)
            for i in range(leaves)}
    jax.block_until_ready(tree)
    take, record = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        snap = shard_digest.take(tree)
        take.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        shard_digest.record(snap)
        record.append(time.perf_counter() - t0)
        del snap
    total = sum(x.nbytes for x in tree.values())
    return {"state_bytes": total, "devices": devices, "threads": shard_digest.workers(),
            "take_s": min(take), "record_s": min(record)}


def main(argv=None) -> dict:
    p = parser(__doc__, "digest_cost")
    p.add_argument("--config", default="olmoe-1b-7b")
    p.add_argument("--buffer-mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gpus", type=int, default=16, help="GPUs the state is sharded over")
    p.add_argument("--gpus-per-host", type=int, default=8,
                   help="GPUs per host: one process per host holds their shards")
    p.add_argument("--devices", type=int, default=8, help="emulated devices for the new path")
    args = p.parse_args(argv)
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(args.devices)
    size = state_bytes(args.config)
    rate = hash_rate(args.buffer_mb << 20, args.reps)
    gbs = rate["buffer_bytes"] / rate["copy_and_hash_s"] / 1e9
    est = size["total"] / (rate["buffer_bytes"] / rate["copy_and_hash_s"])
    est_hash = size["total"] / (rate["buffer_bytes"] / rate["hash_only_s"])
    print(f"{args.config}: state {size['total'] / 1e9:.1f} GB (params {size['params'] / 1e9:.1f}"
          f" + optimizer {size['optimizer'] / 1e9:.1f}); copy+SHA-256 {gbs:.2f} GB/s on a "
          f"{rate['buffer_bytes'] >> 20} MiB buffer -> {est:.0f} s per save "
          f"({est_hash:.0f} s for the hash alone)", flush=True)
    shards = shard_path(args.buffer_mb << 20, args.devices, args.reps)
    host = size["total"] * args.gpus_per_host // args.gpus  # one host's share of the state
    blocked = host * shards["take_s"] / shards["state_bytes"]
    background = host * shards["record_s"] / shards["state_bytes"]
    print(f"per-shard digests: one host's share ({args.gpus_per_host} of {args.gpus} GPUs) "
          f"{host / 1e9:.1f} GB; host copy {shards['state_bytes'] / shards['take_s'] / 1e9:.2f} "
          f"GB/s -> {blocked:.0f} s blocking the loop (on CPU devices; a device-to-host copy on "
          f"GPUs); SHA-256 in {shards['threads']} thread(s) "
          f"{shards['state_bytes'] / shards['record_s'] / 1e9:.2f} GB/s -> {background:.0f} s "
          "in the background", flush=True)
    write_results(args.out, {"config": args.config, "state_bytes": size, **rate,
                             "rate_gb_s": gbs, "estimated_save_digest_s": est,
                             "estimated_hash_only_s": est_hash,
                             "per_shard": {**shards, "gpus": args.gpus,
                                           "gpus_per_host": args.gpus_per_host,
                                           "host_state_bytes": host,
                                           "estimated_blocking_s": blocked,
                                           "estimated_background_s": background}})
    return {"estimated_save_digest_s": est, "estimated_blocking_s": blocked,
            "estimated_background_s": background}


if __name__ == "__main__":
    main()

"""One process of the multi-process exactness test (run by tests/test_multiprocess.py)."""

from __future__ import annotations

import sys

from ciera_jax.launch import init_from_env


def main(n_steps: int) -> None:
    pid = init_from_env()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ciera_jax
    from bitdata import BF16, F32, adversarial, bits_of, churn

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    n = jax.device_count()
    for dtype in (BF16, F32):
        rng = np.random.default_rng(0)  # same stream in every process: same global tensor
        x = adversarial(rng, (n * 16, 48), dtype)
        cache = ciera_jax.init_cache(x.shape, dtype)

        def body(x, cache):
            full, c, s = ciera_jax.all_gather(x, cache, "fsdp")
            return full[None], c, s["sent_bytes"][None], s["fallback"][None]

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                                     out_specs=(P("fsdp"), P(), P("fsdp"), P("fsdp"))))
        rep = NamedSharding(mesh, P())
        cache = jax.tree.map(lambda a: jax.make_array_from_callback(
            a.shape, rep, lambda i, a=np.asarray(a): a[i]), cache)
        for t in range(n_steps):
            xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("fsdp")),
                                              lambda i: x[i])
            full, cache, sent, fallback = step(xs, cache)
            for shard in full.addressable_shards:
                got = bits_of(np.asarray(shard.data)[0])
                assert np.array_equal(got, bits_of(x)), f"{dtype} step {t}: bits differ"
            fb = bool(np.asarray(fallback.addressable_shards[0].data)[0])
            assert fb == (t == 0 or t == 3), f"step {t}: fallback={fb}"
            print(f"process {pid} {dtype.name} step {t} exact fallback={fb} "
                  f"sent={int(np.asarray(sent.addressable_shards[0].data)[0])}", flush=True)
            x = churn(rng, x, 1.0 if t == 2 else 0.005)
    print(f"process {pid} OK", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)

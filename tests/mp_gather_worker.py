"""One process of the multi-process exactness test (run by tests/test_multiprocess.py).

``python -m mp_gather_worker N_STEPS [exponent|word]``: gathers through a carried cache of that
mode; exponent mode churns exponents, word mode moves words by a few ulps. Both jump to fresh
adversarial words after step 2, so step 3 (like step 0) is a plain gather.
"""

from __future__ import annotations

import sys

from ciera_harness.launch import init_from_env


def main(n_steps: int, mode: str = "exponent") -> None:
    pid = init_from_env()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ciera_jax
    from bitdata import BF16, F32, adversarial, bits_of, churn, from_bits

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    n = jax.device_count()
    for dtype in (BF16, F32):
        rng = np.random.default_rng(0)  # same stream in every process: same global tensor
        x = adversarial(rng, (n * 16, 48), dtype)
        cache = ciera_jax.init_cache(x.shape, dtype, mode=mode)

        def body(x, cache):
            full, c, s = ciera_jax.all_gather(x, cache, "fsdp")
            return full[None], c, s["sent_bytes"][None], s["fallback"][None], s["mode"][None]

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                                     out_specs=(P("fsdp"), P(), P("fsdp"), P("fsdp"),
                                                P("fsdp"))))
        rep = NamedSharding(mesh, P())
        cache = jax.tree.map(lambda a: jax.make_array_from_callback(
            a.shape, rep, lambda i, a=np.asarray(a): a[i]), cache)
        for t in range(n_steps):
            xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("fsdp")),
                                              lambda i: x[i])
            full, cache, sent, fallback, used = step(xs, cache)
            for shard in full.addressable_shards:
                got = bits_of(np.asarray(shard.data)[0])
                assert np.array_equal(got, bits_of(x)), f"{dtype} step {t}: bits differ"
            fb = bool(np.asarray(fallback.addressable_shards[0].data)[0])
            assert fb == (t == 0 or t == 3), f"step {t}: fallback={fb}"
            used = int(np.asarray(used.addressable_shards[0].data)[0])
            if mode == "word":
                assert np.array_equal(np.asarray(cache.words.addressable_shards[0].data),
                                      bits_of(x)), f"{dtype} step {t}: word cache differs"
                assert fb or used == 2, f"step {t}: mode {used}, expected word mode (2)"
            print(f"process {pid} {dtype.name} step {t} exact fallback={fb} mode={used} "
                  f"sent={int(np.asarray(sent.addressable_shards[0].data)[0])}", flush=True)
            if t == 2:
                x = churn(rng, x, 1.0) if mode == "exponent" else adversarial(rng, x.shape, dtype)
            elif mode == "word":  # every word moves by -3..3 ulps (bits, wrapping: exact anyway)
                bits = bits_of(x)
                x = from_bits(bits + rng.integers(-3, 4, x.shape).astype(bits.dtype), dtype)
            else:
                x = churn(rng, x, 0.005)
    print(f"process {pid} OK", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, *sys.argv[2:3])

"""XLA's memory count of the ``ciera train`` step compiled for GPUs that are not there.

    python benchmarks/step_memory.py --config olmoe-1b-7b --gpus 16 --tokens-per-gpu 4096 \
        [--gather plain] [--remat full] [--attention auto] [--layers N] [--cache exponent]

Compiles the trainer's step for an H100-80GB topology of ``--gpus`` devices (XLA:GPU compiles
without a GPU: the CUDA plugin, ``CUDA_VISIBLE_DEVICES=-1``) and prints
``compiled.memory_analysis()`` per GPU: arguments, outputs, temporaries. ``--layers`` shrinks
the model's layer count, so the per-layer share of the temporaries can be read off two runs.
The experts' matmul is the trainer's (``--set experts_matmul=...``; on GPU meshes ``blocked``,
``ciera_models.model.grouped_matmul``). With ``--set experts_matmul=ragged``, XLA:GPU (jaxlib 0.10.2)
rewrites ``lax.ragged_dot`` into a dense dot over every expert (OLMoE: f32 [64, 32768, 2048]
buffers, 17 GB each); ``--dense-free-experts`` then swaps it, for the measurement only, for
one dot of the same operand and output shapes against expert 0 (a floor for any grouped
matmul). ``compiled.memory_analysis()`` here uses XLA's default flags; ``ciera aot`` compiles
with the FSDP flags, whose latency-hiding scheduler counts more unless its memory limit is the
plan's (``--memory-limit``; docs/results.md, section 7, "Memory").
A measuring tool, not the aot command (``ciera aot``); no GPU needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

H100 = '''gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32
shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
clock_rate_ghz: 1.98 device_memory_size: 85017755648 shared_memory_per_block_optin: 232448
cuda_compute_capability { major: 9 minor: 0 } registers_per_core_limit: 65536
registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 } runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"'''


def gpu_mesh(n: int):
    from jax.experimental import topologies
    hosts, per = (n // 8, 8) if n >= 8 else (1, n)
    topo = topologies.get_topology_desc(platform="cuda", target_config=H100,
                                        topology=f"1x{hosts}x{per}")
    return topologies.make_mesh(topo, (n,), ("fsdp",))


def abstract_args(trainer, batch: int, length: int):
    """The step's arguments as sharded ShapeDtypeStructs on the trainer's mesh."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ciera_models.model.transformer import Transformer
    from ciera_models.train.state import fresh_caches, is_spec
    from ciera_models.train.step import all_words

    mesh = trainer.mesh

    def put(tree, specs):
        specs = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree,
                             is_leaf=is_spec)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, s)), tree, specs)

    model = nnx.eval_shape(lambda: Transformer(trainer.tc.model, nnx.Rngs(0), trainer.attention,
                                               trainer.experts))
    params = nnx.state(model, nnx.Param)
    params = put(params, trainer.param_specs)
    opt = put(jax.eval_shape(trainer.tx.init, params), trainer.opt_specs)
    caches = jax.eval_shape(lambda: fresh_caches(trainer.cache_shapes, trainer.tensors,
                                                 trainer.cache_modes))
    caches = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, P())), caches)
    ahead = jax.eval_shape(trainer.prepare_fn, params, caches, all_words(trainer.tensors))
    tokens = jax.ShapeDtypeStruct((batch, length + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P("fsdp")))
    return params, caches, opt, ahead, tokens


def measure(tc, n: int) -> dict:
    from ciera_models.train.build import build_trainer
    trainer = build_trainer(tc, gpu_mesh(n))
    args = abstract_args(trainer, tc.batch_size, tc.length)
    t0 = time.perf_counter()
    compiled = trainer.step_fn.lower(*args).compile()
    m = compiled.memory_analysis()
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
            "compile_s": time.perf_counter() - t0,
            "caches": sorted(set(trainer.cache_modes.values()))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="olmoe-1b-7b")
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--tokens-per-gpu", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--dense-free-experts", action="store_true",
                    help="measure with a stand-in for lax.ragged_dot (see the docstring)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a TrainConfig field (gather, cache, remat, attention, ...)")
    args = ap.parse_args(argv)
    if args.dense_free_experts:
        import jax
        jax.lax.ragged_dot = lambda x, w, sizes, **kw: jax.lax.dot(  # noqa: E731
            x, w[0], preferred_element_type=kw.get("preferred_element_type"))
    from ciera_jax.planning import shapes
    from ciera_models.train.config import TrainConfig
    if args.layers is not None:  # a registered copy with fewer layers
        cfg = dataclasses.replace(shapes.get_config(args.config), n_layers=args.layers,
                                  name=f"{args.config}-L{args.layers}")
        shapes.CONFIGS[cfg.name] = cfg
    name = f"{args.config}-L{args.layers}" if args.layers is not None else args.config
    seq = args.seq_len or shapes.get_config(name).seq_len
    fields = dict(kv.split("=", 1) for kv in args.set)
    tc = TrainConfig(config=name, seq_len=seq, batch_size=args.gpus * args.tokens_per_gpu // seq,
                     **fields)
    out = {"config": name, "gpus": args.gpus, "tokens_per_gpu": args.tokens_per_gpu,
           "dense_free_experts": args.dense_free_experts, **fields, **measure(tc, args.gpus)}
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    print(json.dumps(out))
    print(f"arguments {gb(out['argument_bytes'])}  temporaries {gb(out['temp_bytes'])}  "
          f"total {gb(out['argument_bytes'] + out['temp_bytes'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

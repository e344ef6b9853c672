"""What a gathering module holds, and the one walk over a model that finds it.

axes.py       where a call gathers (inside shard_map, in the ambient mesh, or nowhere)
discovery.py  which parameters a gathering module gathers, and along which axis
stacking.py   layer stacks (stack, nnx.vmap) and their leading axis
inventory.py  the one walk: every gathering module and the tensors it gathers
setup.py      a module's static gather mode (ciera, plain, int8; prepared or not)
stats.py      GatherStats as module state
caches.py     GatherCacheVar caches as module state, attach_caches
specs.py      state PartitionSpecs, placing host values, re-merging states

Below the gather paths of :mod:`ciera_jax.fsdp` (gather, percall, prepared, ...), which read
it; nothing here imports them.
"""

"""What a gather costs and what fits: the cost model, the memory model and the planner.

costmodel.py  alpha-beta cost formulas and profiles (``profiles/``), shared by the planner,
              the simulator and calibration
memory.py     per-GPU memory: state, caches per mode, gathered layers, activations
planner.py    per-tensor plain / exponent / word under a memory budget (``ciera plan``)
crossover.py  the link rate below which a mode beats plain: modelled, and from measured ratios
shapes.py     model configs and tensor inventories the planner and simulator price
traces.py     measured exponent-change and word-mode traces (``data/``)

Pure Python over the codec's tables: imports :mod:`ciera_jax.codec` and
:mod:`ciera_jax.runtime` only, so ``ciera plan`` prices a cluster without a mesh.
"""

"""Process and platform plumbing, below everything else in the library.

devices.py    emulated CPU devices, make_mesh; XLA flags on GPU
partition.py  which tensor is split on which mesh axis: rule tables, one-axis PartitionSpecs
varying.py    JAX's varying-manual-axes typing across versions
lazy.py       package names that load their module on first use
hlo.py        reading compiled HLO text
outputs.py    output paths checked before any work
units.py      byte formatting and parsing

Imports nothing else of ``ciera_jax``.
"""

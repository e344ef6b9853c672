"""The Flax NNX OLMoE-style MoE transformer that ``ciera train`` trains.

transformer.py     the model
configs.py         the named configs (shapes from :mod:`ciera_jax.planning.shapes`)
grouped_matmul.py  the experts' grouped matmul in blocks of rows
sharding.py        which axis of each weight is split

The bottom layer of ``ciera_models``: imports only the library.
"""

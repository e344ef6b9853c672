"""Checkpoints with digests, and the end-of-run parameter hash.

store.py         save, restore, pick the newest good checkpoint (orbax)
meta.py          what a checkpoint's metadata says: may a run resume from it
shard_digest.py  per-shard digests, hashed in orbax's background commit
params_hash.py   the parameters' sha256, equal across gather modes

Imports :mod:`ciera_models.resilience`, :mod:`ciera_models.model` and the library.
"""

"""What a checkpoint's metadata says and promises: whether a run may resume from it, on which
layout it was saved, its format, and the digests that let a restore trust it (format 2: of the
metadata itself, the shards' own are in :mod:`ciera_models.checkpoint.shard_digest`; format 1: of the
whole params and optimizer state). Pure functions of the metadata and the arrays; orbax and the
folder are :mod:`ciera_models.checkpoint.store`'s.
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

from ciera_models.checkpoint.params_hash import host_array
from ciera_models.checkpoint.shard_digest import Damaged

# A resumed run must agree on these, or the checkpoint does not fit (shapes, data) or is not
# the run it claims to continue.
MUST_MATCH = ("config", "gather", "batch_size", "seq_len", "seed")
# These change what is sent over the wire, which programs compile or how XLA schedules the
# step, never what is computed: free to change.
FREE_ON_RESUME = ("plan", "profile", "cache", "xla_flags", "memory_limit", "max_programs",
                  "program_patience", "overflow_rungs", "compile_beside")
FORMAT = 2  # per-shard digests in digests/; 1: whole-state digests in the metadata
# What a save records about itself (format 2; the shard digests are in digests/).
FORMAT_KEYS = ("checkpoint_format", "digest_processes", "meta_sha256")
# What a format-1 save recorded; a restore still checks all three.
DIGESTS = ("params_sha256", "opt_state_sha256", "meta_sha256")


def check_resumable(meta: dict, train_config: dict, directory: str) -> list[str]:
    """Raise ValueError if the checkpoint (its ``meta``) is from a different run than
    ``train_config`` (a TrainConfig as a dict, plus ``seed``); returns one note per setting
    that differs but may (e.g. a new learning rate: the run no longer equals a straight one)."""
    saved = dict(meta.get("train_config") or {k: meta[k] for k in MUST_MATCH if k in meta})
    saved.setdefault("seed", meta.get("seed"))
    differ = {k: (saved[k], v) for k, v in train_config.items()
              if k in saved and saved[k] != v and k not in FREE_ON_RESUME}
    fatal = {k: d for k, d in differ.items() if k in MUST_MATCH}
    if fatal:
        said = ", ".join(f"--{k.replace('_', '-')} {a} (this run: {b})"
                         for k, (a, b) in fatal.items())
        raise ValueError(f"--resume: the checkpoint in {directory} (step {meta.get('step')}) "
                         f"was trained with {said}; pass the same flags, or use a new "
                         "--checkpoint-dir")
    return [f"--{k.replace('_', '-')} is {b} (the checkpoint's run had {a}): the resumed run "
            "will not equal a straight one" for k, (a, b) in differ.items() if k not in fatal]


def layout_note(meta: dict, mesh: dict) -> str | None:
    """A note when the checkpoint was saved on another mesh than ``mesh`` (``{"devices": n,
    "processes": p}``): the reduction order differs, so bitwise equality with a straight run
    is gone, on either layout. None when they agree or the checkpoint did not record it."""
    saved = meta.get("mesh")
    if not isinstance(saved, dict) or saved == mesh:
        return None
    said = lambda m: (f"{m.get('devices')} devices in {m.get('processes')} "  # noqa: E731
                      f"process{'es' if m.get('processes') != 1 else ''}")
    return (f"the checkpoint (step {meta.get('step')}) was saved on {said(saved)}, this run has "
            f"{said(mesh)}: sums reduce in another order, so the resumed run will not be "
            "bitwise equal to an uninterrupted run on either layout")


def tree_sha256(tree) -> str:
    """One hash of every leaf's path, dtype, shape and bits, in the tree's own order."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = host_array(x)
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def meta_sha256(meta: dict) -> str:
    """The digest of ``meta`` without its own ``meta_sha256`` (as JSON, keys sorted)."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def check_meta(meta) -> dict:
    """``meta`` if it is intact; :class:`Damaged` otherwise. A checkpoint saved before digests
    existed has none of them and passes (its arrays then go unchecked)."""
    if not isinstance(meta, dict) or not meta:
        raise Damaged("its metadata is missing or empty")
    fmt = meta.get("checkpoint_format")
    keys = FORMAT_KEYS if fmt is not None else DIGESTS
    present = [k for k in keys if k in meta]
    if fmt is not None and fmt != FORMAT:
        raise Damaged(f"its format {fmt!r} is not one this version reads ({FORMAT} or older)")
    if (present or fmt is not None) and len(present) < len(keys):
        missing = ", ".join(k for k in keys if k not in meta)
        raise Damaged(f"its metadata lacks {missing}")
    if present and meta["meta_sha256"] != meta_sha256(meta):
        raise Damaged("its metadata does not match its digest (meta_sha256)")
    if "step" not in meta:
        raise Damaged("its metadata has no step")
    return meta


def checkpoint_format(meta: dict) -> int:
    """2: per-shard digests; 1: whole-state digests in the metadata; 0: none."""
    return int(meta.get("checkpoint_format") or (1 if "params_sha256" in meta else 0))

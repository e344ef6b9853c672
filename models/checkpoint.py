"""Orbax checkpoints of the training state: params, optimizer state, step, data position, and
the TrainConfig and seed that produced them.

Exponent caches are not saved: they are derived state, and a restored run starts with fresh
(unprimed) caches whose first gather re-primes them, bitwise exactly. The data position is the
step (batch ``i`` is a pure function of ``(seed, i)``), stored explicitly for readers.

Saves are atomic: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it
when complete, so a run killed during a save leaves the previous checkpoint the latest; the
partial directory is ignored and removed when the next run opens the directory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

# A resumed run must agree on these, or the checkpoint does not fit (shapes, data) or is not
# the run it claims to continue.
MUST_MATCH = ("config", "gather", "batch_size", "seq_len", "seed")
# These change what is sent over the wire, never what is computed: free to change.
FREE_ON_RESUME = ("plan", "profile", "cache")


def check_dir(directory: str) -> None:
    """Fail now, with one line, if ``directory`` cannot hold checkpoints (it is created)."""
    p = Path(directory)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--checkpoint-dir {p} is a file, not a directory; pass a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {p} is not writable ({e.strerror}); pass a "
                         "directory you can write to") from None


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


class Checkpointer:
    """The run's checkpoint directory: periodic and final saves, the newest ``keep`` kept."""

    def __init__(self, directory: str, keep: int = 3, create: bool = True):
        self.directory = Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                            cleanup_tmp_directories=True,
                                            enable_async_checkpointing=False)
        self._mgr = ocp.CheckpointManager(self.directory, options=opts,
                                          item_names=("state", "meta"))

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self._mgr.close()

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        """Save (and finish writing) step ``step``; ``meta`` is small JSON."""
        meta = {**meta, "step": step, "data_position": step}
        tree = {"params": params, "opt_state": opt_state}
        self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
        self._mgr.wait_until_finished()

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def latest_meta(self) -> dict | None:
        """The JSON metadata of the latest checkpoint (None if there is none)."""
        step = self.latest_step()
        if step is None:
            return None
        got = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(got["meta"])

    def restore(self, params, opt_state):
        """The latest ``(params, opt_state, meta)``, into the shapes and shardings of the given
        (fresh) ``params`` and ``opt_state``; None if there is no checkpoint."""
        step = self.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            {"params": params, "opt_state": opt_state})
        got = self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return got["state"]["params"], got["state"]["opt_state"], dict(got["meta"])


def latest_meta(directory: str) -> dict | None:
    """The metadata of the newest checkpoint in ``directory`` (None if there is none)."""
    if not Path(directory).is_dir():
        return None
    with Checkpointer(directory, create=False) as ck:
        return ck.latest_meta()

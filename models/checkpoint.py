"""Orbax checkpoints of the training state: params, optimizer state, step, data position.

Exponent caches are not saved: they are derived state, and a restored run starts with fresh
(unprimed) caches whose first gather re-primes them, bitwise exactly. The data position is the
step (batch ``i`` is a pure function of ``(seed, i)``), stored explicitly for readers.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


def _manager(directory: str, create: bool = True) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, create=create,
                                        enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), options=opts,
                                 item_names=("state", "meta"))


def save(directory: str, state, meta: dict) -> None:
    """Save ``state`` (a models.train.TrainState) at its step; ``meta`` is small JSON."""
    tree = {"params": state.params, "opt_state": state.opt_state}
    meta = {**meta, "step": state.step, "data_position": state.step}
    with _manager(directory) as mgr:
        mgr.save(state.step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
        mgr.wait_until_finished()


def latest_step(directory: str) -> int | None:
    if not Path(directory).is_dir():
        return None
    with _manager(directory, create=False) as mgr:
        return mgr.latest_step()


def restore(directory: str, template):
    """Restore the latest checkpoint into the shardings of ``template`` (a fresh TrainState).

    Returns ``(state, meta)`` with fresh caches, or None if there is no checkpoint.
    """
    from models.train import TrainState

    step = latest_step(directory)
    if step is None:
        return None
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        {"params": template.params, "opt_state": template.opt_state})
    with _manager(directory, create=False) as mgr:
        got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                        meta=ocp.args.JsonRestore()))
    meta = dict(got["meta"])
    state = TrainState(int(meta["step"]), got["state"]["params"], template.caches,
                       got["state"]["opt_state"], ahead=None)  # re-encoded at the first step
    return state, meta


def latest_meta(directory: str) -> dict | None:
    """The JSON metadata of the latest checkpoint (None if there is none)."""
    step = latest_step(directory)
    if step is None:
        return None
    with _manager(directory, create=False) as mgr:
        got = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(got["meta"])

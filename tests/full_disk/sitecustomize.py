"""A full disk on one host, for the multi-process drills: with this folder on ``PYTHONPATH``
and ``CIERA_TEST_FULL_DISK=P`` in the environment, every checkpoint write of process P fails
as orbax's writes fail on a full disk (``OSError`` ENOSPC); the other processes' writes are
untouched. Python imports ``sitecustomize`` at start-up, so it reaches the process that
trains too, which ``ciera train``'s supervisor starts as a child of its own."""

import errno
import os

if os.environ.get("CIERA_TEST_FULL_DISK"):
    import orbax.checkpoint as ocp

    _save = ocp.CheckpointManager.save

    def _save_on_a_full_disk(self, *args, **kwargs):
        import jax

        if jax.process_index() == int(os.environ["CIERA_TEST_FULL_DISK"]):
            raise OSError(errno.ENOSPC, "No space left on device")
        return _save(self, *args, **kwargs)

    ocp.CheckpointManager.save = _save_on_a_full_disk

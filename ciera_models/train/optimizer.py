"""The optimizer of ``ciera train``: AdamW with linear warm-up and cosine decay.

Clipping is not here: under FSDP it needs the global norm over all shards
(``fsdp.clip_by_global_norm`` in the step); AdamW itself is elementwise, so it runs on shards.
"""

from __future__ import annotations

import optax


def make_schedule(tc) -> optax.Schedule:
    """Linear warm-up to ``lr``, cosine decay to ``lr * min_lr_ratio`` at ``schedule_steps``
    (``tc``: a :class:`models.train_config.TrainConfig`)."""
    return optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, max(1, tc.warmup_steps), max(tc.schedule_steps, tc.warmup_steps + 1),
        end_value=tc.lr * tc.min_lr_ratio)


def make_optimizer(tc) -> optax.GradientTransformation:
    return optax.adamw(make_schedule(tc), b1=0.9, b2=0.95, eps=1e-8,
                       weight_decay=tc.weight_decay)

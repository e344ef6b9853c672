"""The sharded train step: one ``jax.jit`` of one ``jax.shard_map`` over the ``fsdp`` axis.

    params (f32 shards)  caches (replicated)  opt state (shards)  ahead (per rank)  tokens
        |
        +-- ``ahead`` holds every compressed tensor's ``Encoded`` and its agreed demand, made
        |          by the encode program after the previous step, each with the rung the host fixed
        |          for it (``Trainer.step``: one program per rung vector, a few per run)
        +-- forward (``fsdp.prepare``): embed; each layer stack under ``lax.scan``, the body
        |          gathering layer l+1 (exchange: one transfer at the fixed rung + decode, a
        |          fallback only above it; or the
        |          plain / int8 gather) next to the compute of layer l; head. Tensors the plan
        |          leaves plain use the plain gather. The layers' forward saves what the
        |          remat policy keeps (``--remat``; never a gathered weight), the backward
        |          recomputes the rest: it reads word-cache tensors' full weights from their
        |          caches (no second gather), gathers exponent-cache tensors' sign + mantissa
        |          bytes only (their caches hold the exponents), the rest plainly;
        |          psum_scatters the cotangents
        +-- grads: the loss is divided by the rank count, so these are grads of the global mean;
        |          replicated params (norms) are psummed by shard_map's autodiff
        +-- global-norm clipping (psum of sharded squares + replicated counted once), AdamW
        +-- count the bf16 words the update changed (for step t+1's metrics)
    -> new params, new caches, new opt state, word counts, metrics (all rank-invariant scalars)

    the encode program (``prepare_fn``, one per run, after every step): encode the new params
        (bf16) against the caches the gathers just updated, agree on every demand with ONE
        pmax, the rung each needs -> ``ahead`` for step t+1 (the host reads ``needed``)

The encode is a program of its own, not the step's tail: XLA compiles it once, beside the step
programs (one per rung vector), instead of inside each of them, and the step program holds the
gathers, the model and the optimizer alone (inside it, the encode is a large share of the
step's PTX modules, compiled again for every rung vector). It runs between two steps, where the step's tail ran it:
nothing waits longer.

All three gather modes run this same code; ciera and plain give bitwise-identical params. The
step only proposes the next state and reports metrics; the loop decides to take it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp
from ciera_jax.collective import bitfields
from ciera_jax.collective import heal
from ciera_jax.fsdp import AXIS
from ciera_jax.collective import agreement_bytes

# ``ahead``: per rank Encoded (a leading rank axis outside shard_map); replicated counts,
# agreed demands and the rungs they need.
AHEAD_SPECS = {"encoded": P(AXIS), "word_changed": P(), "agreed": P(), "needed": P()}


def ranked(tree):
    """Per-rank values -> a leading axis of size 1 (sharded over fsdp outside shard_map)."""
    return jax.tree.map(lambda a: a[None], tree)


def unranked(tree):
    return jax.tree.map(lambda a: a[0], tree)


def word_changes(tensors: dict, old: dict, new: dict) -> dict:
    """bf16 words of each gathered tensor (per layer for stacks) that differ between the
    gathers of ``old`` and ``new`` params: rank-invariant int32 counts."""
    out = {}
    for k, t in tensors.items():
        a = lax.bitcast_convert_type(old[k].astype(jnp.bfloat16), jnp.uint16)
        b = lax.bitcast_convert_type(new[k].astype(jnp.bfloat16), jnp.uint16)
        axes = tuple(range(1 if t.stack else 0, a.ndim))
        out[k] = lax.psum(jnp.sum(a != b, axis=axes, dtype=jnp.int32), AXIS)
    return out


def all_words(tensors: dict) -> dict:
    """Word-change counts of a first gather: every word is new."""
    return {k: (jnp.full((t.stack,), math.prod(t.shape), jnp.int32) if t.stack
                else jnp.int32(math.prod(t.shape))) for k, t in tensors.items()}


def step_bytes(st: dict, backward: str, word: bool, dtype) -> dict:
    """What one rank sends for one tensor in the whole step, next to plain FSDP's: the
    forward gather (``st``), the backward's (``backward``: ``"cache"``, none: a word cache
    served it; ``"payload"``: the sign + mantissa bytes, an exponent cache gave the exponents;
    ``"regather"``: what the forward sent, its agreement excepted) and the gradient's
    reduce-scatter (``plain_bytes``: a ring reduce-scatter moves what a ring all-gather of the
    same tensor moves). ``ciera_jax.planning.planner.step_wire_bytes`` prices it."""
    sent, plain = st["sent_bytes"], st["plain_bytes"]
    agreement = jnp.where(st["rung"] >= 0, agreement_bytes("word" if word else "exponent"), 0)
    if backward == "cache":
        again = 0
    elif backward == "payload":
        fmt = bitfields.word_format(dtype)
        again = plain // fmt.word.itemsize * fmt.payload_bytes
    else:
        again = sent - agreement.astype(sent.dtype)
    return {"step_sent_bytes": sent + again + plain, "step_plain_bytes": 3 * plain}


# The step's stats per tensor, the columns of its packed output (the forward gather's, then
# the step's own): one output buffer per tensor, not one per stat.
STEP_STAT_KEYS = fsdp.STAT_KEYS + ("words_changed", "step_sent_bytes", "step_plain_bytes")


def per_layer_stats(tensors: dict, packed: dict) -> dict:
    """``{tensor key: packed stats stacked over layers}`` (columns :data:`STEP_STAT_KEYS`) ->
    ``{layer key: {stat: value} of that layer}``, on the host (the step returns them packed
    and stacked: split inside it, each layer's scalar is an output buffer of its own, a slice
    kernel on a GPU, hundreds a step)."""
    out = {}
    for k, p in packed.items():
        st = fsdp.stats_from_columns(p, STEP_STAT_KEYS)
        t = tensors[k]
        for layer in range(t.stack or 1):
            out[t.layer_key(layer)] = {s: v[layer] for s, v in st.items()} if t.stack else st
    return out


def failure_vector(tensors: dict, stats: dict) -> jax.Array:
    """Every compressed gather's per-rank ``verify_failed`` (per layer for stacks), flat."""
    parts = [jnp.ravel(stats[k]["verify_failed"]) for k in sorted(stats)]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)


def unflatten_failures(tensors: dict, stats: dict, flat) -> dict:
    """:func:`failure_vector`'s layout back to ``{tensor key: failures (per layer)}``."""
    out, at = {}, 0
    for k in sorted(stats):
        shape = jnp.shape(stats[k]["verify_failed"])
        size = math.prod(shape)
        out[k] = flat[at:at + size].reshape(shape)
        at += size
    return out


def make_step(tc, mesh, graphdef, param_specs, opt_specs, tx, tensors, compress):
    """``(step_fn, prepare_fn)``, both jitted. ``step_fn(params, caches, opt_state, ahead,
    tokens) -> (params, caches, opt_state, word_changed, metrics)`` donates params, caches and
    optimizer state; ``ahead["agreed"]`` comes in with every rung fixed (``fsdp.fix_rungs``:
    the rung vector is part of the input's structure, so each vector is its own program).
    ``prepare_fn(params, caches, word_changed) -> ahead`` encodes what the next step gathers:
    after every step (``word_changed``: what the step returned) and at the start (after a
    restore whose caches are primed: :func:`all_words`)."""
    n = mesh.shape[AXIS]

    def loss_fn(params, caches, encoded, agreed, tokens):
        model = fsdp.prepare(fsdp.merge(graphdef, params, caches), encoded, agreed, tc.gather,
                             word_backward=tc.word_backward, remat=tc.remat)
        loss, parts = model.loss(tokens, tc.lb_coef, tc.z_coef)
        # The gathers' new caches and stats are the model's state after the forward.
        new_caches = fsdp.cache_dict(nnx.state(model, fsdp.GatherCacheVar))
        stats = fsdp.gather_stats(model)
        # Mean over the global batch: each rank's mean over its equal share, divided by n.
        return loss / n, (loss, parts, new_caches, {k: stats[k] for k in tensors})

    def prepare(params, caches, word_changed):
        """What the next step needs: the Encoded, ONE agreement over all of them, the rungs
        they need (read by the host)."""
        encoded = fsdp.encode_tensors(tensors, fsdp.param_dict(params), fsdp.cache_dict(caches),
                                      compress, AXIS)
        agreed = fsdp.agree_tensors(tensors, encoded, AXIS)
        return {"encoded": ranked(encoded), "word_changed": word_changed, "agreed": agreed,
                "needed": fsdp.needed_rungs(tensors, encoded, agreed)}

    def local_step(params, caches, opt_state, ahead, tokens):
        encoded = unranked(ahead["encoded"])
        agreed = ahead["agreed"]  # agreed at the end of the previous step, rungs fixed
        caches_d = fsdp.cache_dict(caches)
        # the backward reads word caches' full words and exponent caches' exponents
        words = {k for k in tensors if compress.get(k, False)
                 and isinstance(caches_d.get(k), ciera_jax.WordCache)}
        backward = {k: ("cache" if k in words else "payload")
                    if compress.get(k, False) and tc.word_backward == "cache" else "regather"
                    for k in tensors}
        grads, (loss, parts, caches_d, stats) = jax.grad(loss_fn, has_aux=True)(
            params, caches, encoded, agreed, tokens)
        # The gathers' self-check failures (per rank) ride on the norm's psum: no extra
        # collective, and after it every rank knows which tensors failed anywhere.
        grads, gnorm, failed_flat = fsdp.clip_by_global_norm(
            grads, param_specs, tc.clip_norm, AXIS,
            also_sum=failure_vector(tensors, stats))
        failed = unflatten_failures(tensors, stats, failed_flat)
        bad = sum(jnp.sum(v) for v in failed.values()) > 0 if failed else jnp.bool_(False)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A failed check: no rank applies the step, every rank forgets the failed tensors'
        # caches (the redo's gathers prime them), and the loop runs the same batch again.
        new_params = heal.keep_if_failed(bad, params, new_params)
        new_opt_state = heal.keep_if_failed(bad, opt_state, new_opt_state)
        caches_d = {k: heal.reset_failed(c, failed[k]) if k in failed else c
                    for k, c in caches_d.items()}
        # What step t+1 reports as changed (its ahead is encoded by prepare_fn).
        word_changed = jax.tree.map(
            lambda again, nxt: jnp.where(bad, again, nxt), ahead["word_changed"],
            word_changes(tensors, fsdp.param_dict(params), fsdp.param_dict(new_params)))
        for k, st in stats.items():
            st["words_changed"] = ahead["word_changed"][k]
            st["verify_failed"] = failed.get(k, jnp.zeros_like(st["rung"]))
            st.update(step_bytes(st, backward[k], k in words, tensors[k].dtype))
        metrics = {"loss": lax.pmean(loss, AXIS), "grad_norm": gnorm,
                   **{k: lax.pmean(v, AXIS) for k, v in parts.items()},
                   "verify_failed": sum((jnp.sum(v) for v in failed.values()), jnp.int32(0)),
                   # per tensor, packed and stacked over layers: the host splits them by
                   # stat and layer (per_layer_stats), where every scalar output is a kernel
                   "gather": {k: fsdp.stat_columns(st, STEP_STAT_KEYS)
                              for k, st in stats.items()}}
        caches = fsdp.with_caches(caches, caches_d)
        return new_params, caches, new_opt_state, word_changed, metrics

    sm = jax.shard_map(local_step, mesh=mesh,
                       in_specs=(param_specs, P(), opt_specs, AHEAD_SPECS, P(AXIS)),
                       out_specs=(param_specs, P(), opt_specs, P(), P()))
    prep = jax.shard_map(prepare, mesh=mesh, in_specs=(param_specs, P(), P()),
                         out_specs=AHEAD_SPECS)
    return jax.jit(sm, donate_argnums=(0, 1, 2)), jax.jit(prep)

"""FSDP training of the MoE transformer: state, the sharded train step, the loop.

The train step is one ``jax.jit`` of one ``jax.shard_map`` over the ``fsdp`` mesh axis:

    params (f32 shards)  caches (replicated)  opt state (shards)  ahead (per rank)  tokens
        |
        +-- agree: ONE pmax over the demands of every layer of every compressed tensor (their
        |          ``Encoded`` came in ``ahead``, made at the end of the previous step)
        +-- forward (``fsdp.Engine``): embed; each layer stack under ``lax.scan``, the body
        |          gathering layer l+1 (exchange: switch on the agreed tier + decode; or the
        |          plain / int8 gather) next to the compute of layer l; head. Tensors the plan
        |          leaves plain use the plain gather. Gathered computes are rematerialized:
        |          backward re-gathers (exact) and psum_scatters the weight cotangents
        +-- grads: the loss is divided by the rank count, so these are grads of the global mean;
        |          replicated params (norms) are psummed by shard_map's autodiff
        +-- global-norm clipping (psum of sharded squares + replicated counted once), AdamW
        +-- prepare step t+1: encode the new params (bf16) against the caches the gathers just
            updated, count the bf16 words that changed -> ``ahead`` (donated back in)
    -> new params, new caches, new opt state, ahead, metrics (all rank-invariant scalars)

All three gather modes run this same code; ciera and plain give bitwise-identical params.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax import fsdp
from ciera_jax.fsdp import AXIS, ExponentCacheVar
from models import configs
from models.data import Dataset, load_dataset
from models.model import Transformer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    config: str = "tiny"
    gather: str = "ciera"
    batch_size: int = 16  # global, sequences
    seq_len: int | None = None  # default: the model config's
    lr: float = 1e-3
    warmup_steps: int = 10
    schedule_steps: int = 200  # horizon of the cosine decay
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    lb_coef: float = 0.01
    z_coef: float = 0.001
    profile: str | None = None  # cost-model profile (name or JSON); None: by platform
    plan: str = "auto"  # auto: planner + expert weights; cost: planner only; all: every tensor

    @property
    def model(self) -> configs.ModelConfig:
        return configs.get_config(self.config)

    @property
    def length(self) -> int:
        return self.seq_len or self.model.seq_len


def make_mesh(n_devices: int | None = None) -> Mesh:
    devs = jax.devices()
    n = n_devices or len(devs)
    if n > len(devs):
        raise ValueError(f"asked for {n} devices but only {len(devs)} are available "
                         f"({devs[0].platform})")
    return Mesh(np.array(devs[:n]), (AXIS,))


def make_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warm-up to ``lr``, cosine decay to ``lr * min_lr_ratio`` at ``schedule_steps``."""
    return optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, max(1, tc.warmup_steps), max(tc.schedule_steps, tc.warmup_steps + 1),
        end_value=tc.lr * tc.min_lr_ratio)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    sched = make_schedule(tc)
    # Clipping is done before (globally, under sharding); AdamW is elementwise, so it is
    # correct on shards.
    return optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=tc.weight_decay)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _full_specs(prefix_specs, tree):
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), prefix_specs, tree,
                        is_leaf=_is_spec)


_put = fsdp.put


@dataclasses.dataclass
class TrainState:
    """``ahead``: what the end of the previous step prepared for this one (``encoded``: the
    ``ciera_jax.Encoded`` of every compressed tensor, per rank; ``word_changed``: bf16 words of
    each gathered tensor that differ from the previous gather). Derived, like the caches: never
    checkpointed; None after init/restore (then :meth:`Trainer.prepare` encodes at the start)."""

    step: int
    params: nnx.State
    caches: nnx.State
    opt_state: object
    ahead: dict | None = None


@dataclasses.dataclass
class Trainer:
    tc: TrainConfig
    mesh: Mesh
    graphdef: object
    param_specs: object  # prefix tree of PartitionSpecs over params
    opt_specs: object
    tx: optax.GradientTransformation
    kinds: dict[str, str]
    step_fn: Callable
    tensors: dict = dataclasses.field(default_factory=dict)  # key -> fsdp.GatheredTensor
    compress: dict = dataclasses.field(default_factory=dict)  # key -> bool (ciera only)
    plan_summary: str = ""
    prepare_fn: Callable | None = None

    @property
    def n(self) -> int:
        return self.mesh.shape[AXIS]

    def prepare(self, state: "TrainState") -> "TrainState":
        """Fill ``state.ahead`` at the start (first step, after a restore): encode against
        the current (unprimed) caches, so the first gather primes them."""
        if state.ahead is not None:
            return state
        caches = fsdp.cache_dict(state.caches)
        if any(np.any(np.asarray(c.primed)) for c in caches.values()):
            return dataclasses.replace(state, ahead=self.prepare_fn(state.params, state.caches))
        # Fresh caches (init, restore): every Encoded only has to say "prime me" (demand =
        # int32 max), and the priming gather sends the shard's own bits, not the payload. So
        # build it on the host instead of compiling the encoder a second time.
        shapes = jax.eval_shape(self.prepare_fn, state.params, state.caches)
        host = {"encoded": {k: ciera_jax.priming_encoded(
                    e, math.prod(self.tensors[k].shape) // self.n)
                    for k, e in shapes["encoded"].items()},
                "word_changed": jax.tree.map(lambda a: np.asarray(a), jax.device_get(
                    _all_words(self.tensors)))}
        return dataclasses.replace(state, ahead=_put(host, AHEAD_SPECS, self.mesh))

    def init_state(self, seed: int) -> TrainState:
        model = fsdp.attach_caches(Transformer(self.tc.model, nnx.Rngs(seed)))
        _, params, caches = nnx.split(model, nnx.Param, ExponentCacheVar)
        params = _put(params, self.param_specs, self.mesh)
        caches = _put(caches, P(), self.mesh)
        opt_state = jax.jit(self.tx.init, out_shardings=jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.opt_specs, is_leaf=_is_spec))(params)
        return TrainState(0, params, caches, opt_state)

    def batch(self, data: Dataset, seed: int, position: int) -> jax.Array:
        toks = data.batch(seed, position, self.tc.batch_size, self.tc.length)
        return _put(toks, P(AXIS), self.mesh)


_TRAINERS: dict = {}


def build_trainer(tc: TrainConfig, mesh: Mesh) -> Trainer:
    """Shapes, shardings and the compiled step for ``tc`` on ``mesh`` (memoized in-process)."""
    key = (tc, tuple(d.id for d in mesh.devices.flat))
    if key in _TRAINERS:
        return _TRAINERS[key]
    cfg = tc.model
    n = mesh.shape[AXIS]
    if tc.gather not in fsdp.GATHER_MODES:
        raise ValueError(f"unknown gather {tc.gather!r}; choose one of: {', '.join(fsdp.GATHER_MODES)}")
    abstract = nnx.eval_shape(lambda: fsdp.attach_caches(Transformer(cfg, nnx.Rngs(0))))
    graphdef, params, caches = nnx.split(abstract, nnx.Param, ExponentCacheVar)
    # The rule table's specs; raises if the mesh does not divide a split dimension.
    param_specs = fsdp.state_specs(abstract, params, AXIS, n=n)
    if tc.batch_size % n:
        raise ValueError(f"batch size {tc.batch_size} is not divisible by the {n} devices")
    tx = make_optimizer(tc)
    opt_abs = jax.eval_shape(tx.init, params)
    opt_specs = optax.tree_map_params(
        tx, lambda _, s: s, opt_abs, _full_specs(param_specs, params),
        transform_non_params=lambda _: P(), is_leaf=_is_spec)
    tensors = fsdp.gathered_tensors(abstract)
    kinds = _kinds(cfg, tensors)
    compress, plan_summary = make_plan(tc, tensors, n, mesh.devices.flat[0].platform)
    if tc.gather != "ciera":
        compress = {k: False for k in compress}
    step_fn, prepare_fn = _make_step(tc, mesh, graphdef, param_specs, opt_specs, tx, tensors,
                                     compress)
    tr = Trainer(tc, mesh, graphdef, param_specs, opt_specs, tx, kinds, step_fn, tensors,
                 compress, plan_summary, prepare_fn)
    _TRAINERS[key] = tr
    return tr


def _kinds(cfg: configs.ModelConfig, tensors: dict) -> dict[str, str]:
    """Tensor path as the gather stats name it (per layer) -> TensorSpec.kind."""
    by_name = {t.name: t.kind for t in configs.tensor_inventory(cfg)}
    out = {}
    for key, t in tensors.items():
        kind = by_name.get(key.rsplit("/", 1)[-1], "other")
        for layer in range(t.stack or 1):
            out[t.layer_key(layer)] = kind
    return out


# ----------------------------------------------------------------------------- the plan

PLANS = ("auto", "cost", "all")
EXPERT_WEIGHT = re.compile(r"w_(gate|up|down)_Ex\w+")


def default_profile(platform: str) -> str:
    return "cpu-emulated" if platform == "cpu" else "h100-nvlink"


def make_plan(tc: TrainConfig, tensors: dict, n: int, platform: str) -> tuple[dict, str]:
    """Compress-or-plain per gathered tensor, from the cost model (``ciera_jax.planner``).

    ``cost``: the planner alone (``plan_tree`` with the profile); ``auto`` (default): the
    planner, plus the routed expert weights always (the tensors CIERA exists for: in the toy
    configs they are too small for the saving to beat the codec launch and latency on any
    profile, and the runs are there to exercise the codec); ``all``: every tensor of a codec
    dtype. Returns ``({key: bool}, one-line summary)``.
    """
    from ciera_jax import planner

    if tc.plan not in PLANS:
        raise ValueError(f"unknown plan {tc.plan!r}; choose one of: {', '.join(PLANS)}")
    profile = tc.profile or default_profile(platform)
    tree = {f"{k}#{layer}": jax.ShapeDtypeStruct(t.shape, t.dtype)
            for k, t in tensors.items() for layer in range(t.stack or 1)}
    decided = planner.plan_tree(tree, n, profile)
    by_cost = {k: decided[f"{k}#0"] for k in tensors}
    forced = {k: tc.plan == "all" or (tc.plan == "auto"
                                       and bool(EXPERT_WEIGHT.fullmatch(k.rsplit("/", 1)[-1])))
              for k in tensors}
    compress = {k: bool(by_cost[k] or forced[k]) for k in tensors}
    size = {k: math.prod(t.shape) * (t.stack or 1) for k, t in tensors.items()}
    frac = sum(size[k] for k in tensors if compress[k]) / max(sum(size.values()), 1)
    n_cost = sum(by_cost.values())
    n_forced = sum(1 for k in tensors if compress[k] and not by_cost[k])
    summary = (f"plan: profile={getattr(planner.cm.get_profile(profile), 'name', profile)} "
               f"ranks={n} --plan {tc.plan}: compress {sum(compress.values())}/{len(tensors)} "
               f"tensors ({100 * frac:.1f}% of gathered bytes): {n_cost} by the cost model"
               + (f", {n_forced} forced ({'expert weights' if tc.plan == 'auto' else 'all'})"
                  if n_forced else ""))
    return compress, summary


# ----------------------------------------------------------------------------- the step

AHEAD_SPECS = {"encoded": P(AXIS), "word_changed": P()}


def _ranked(tree):
    """Per-rank values -> a leading axis of size 1 (sharded over fsdp outside shard_map)."""
    return jax.tree.map(lambda a: a[None], tree)


def _unranked(tree):
    return jax.tree.map(lambda a: a[0], tree)


def _word_changes(tensors: dict, old: dict, new: dict) -> dict:
    """bf16 words of each gathered tensor (per layer for stacks) that differ between the
    gathers of ``old`` and ``new`` params: rank-invariant int32 counts."""
    out = {}
    for k, t in tensors.items():
        a = lax.bitcast_convert_type(old[k].astype(jnp.bfloat16), jnp.uint16)
        b = lax.bitcast_convert_type(new[k].astype(jnp.bfloat16), jnp.uint16)
        axes = tuple(range(1 if t.stack else 0, a.ndim))
        out[k] = lax.psum(jnp.sum(a != b, axis=axes, dtype=jnp.int32), AXIS)
    return out


def _all_words(tensors: dict) -> dict:
    """Word-change counts of a first gather: every word is new."""
    return {k: (jnp.full((t.stack,), math.prod(t.shape), jnp.int32) if t.stack
                else jnp.int32(math.prod(t.shape))) for k, t in tensors.items()}


def _make_step(tc: TrainConfig, mesh: Mesh, graphdef, param_specs, opt_specs, tx, tensors,
               compress):
    """The compiled step and the compiled ``prepare`` (first step / after restore).

    Step t, one jit of one shard_map:
      agree   one pmax over the demands of every layer of every compressed tensor (their
              Encoded came in with the state, prepared at the end of step t-1)
      forward embed; per layer stack a scan whose body gathers layer l+1 (exchange: switch on
              the agreed tier, decode) next to the compute of layer l; head. Each gathered
              compute is rematerialized: backward re-gathers instead of keeping full weights
      update  grads (psum_scatter of the weight cotangents), global-norm clipping, AdamW
      encode  the new params (bf16) against the caches the gathers just updated: the Encoded
              for step t+1, and the word-change counts; out with the state (donated)
    """
    n = mesh.shape[AXIS]
    ahead_specs = AHEAD_SPECS

    def loss_fn(params, caches, caches_d, encoded, agreed, tokens):
        model = fsdp.merge(graphdef, params, caches)
        engine = fsdp.Engine(tc.gather, tensors, caches=caches_d, encoded=encoded, agreed=agreed)
        with engine.active():
            loss, parts = model.loss(tokens, tc.lb_coef, tc.z_coef)
        # Mean over the global batch: each rank's mean over its equal share, divided by n.
        return loss / n, (loss, parts, engine.new_caches, engine.stats)

    def prepare(params, caches):
        encoded = fsdp.encode_tensors(tensors, fsdp.param_dict(params), fsdp.cache_dict(caches),
                                      compress, AXIS)
        return {"encoded": _ranked(encoded), "word_changed": _all_words(tensors)}

    def local_step(params, caches, opt_state, ahead, tokens):
        encoded = _unranked(ahead["encoded"])
        agreed = fsdp.agree_tensors(tensors, encoded, AXIS)  # the step's one agreement
        caches_d = fsdp.cache_dict(caches)
        grads, (loss, parts, new_caches, stats) = jax.grad(loss_fn, has_aux=True)(
            params, caches, caches_d, encoded, agreed, tokens)
        caches_d = {**caches_d, **new_caches}
        grads, gnorm = fsdp.clip_by_global_norm(grads, param_specs, tc.clip_norm, AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # Prepare step t+1 while everything it needs is final (off its critical path).
        old_d, new_d = fsdp.param_dict(params), fsdp.param_dict(new_params)
        ahead_next = {
            "encoded": _ranked(fsdp.encode_tensors(tensors, new_d, caches_d, compress, AXIS)),
            "word_changed": _word_changes(tensors, old_d, new_d)}
        for k, st in stats.items():
            st["words_changed"] = ahead["word_changed"][k]
        per_layer = {}
        for k, st in stats.items():
            t = tensors[k]
            for layer in range(t.stack or 1):
                per_layer[t.layer_key(layer)] = ({s: v[layer] for s, v in st.items()}
                                                 if t.stack else st)
        metrics = {"loss": lax.pmean(loss, AXIS), "grad_norm": gnorm,
                   **{k: lax.pmean(v, AXIS) for k, v in parts.items()}, "gather": per_layer}
        return new_params, fsdp.with_caches(caches, new_caches), opt_state, ahead_next, metrics

    sm = jax.shard_map(local_step, mesh=mesh,
                       in_specs=(param_specs, P(), opt_specs, ahead_specs, P(AXIS)),
                       out_specs=(param_specs, P(), opt_specs, ahead_specs, P()))
    prep = jax.shard_map(prepare, mesh=mesh, in_specs=(param_specs, P()), out_specs=ahead_specs)
    return jax.jit(sm, donate_argnums=(0, 1, 2, 3)), jax.jit(prep)


# ----------------------------------------------------------------------------- params hash

def _host(x) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def flat_params(params: nnx.State) -> list[tuple[str, jax.Array]]:
    """(path, array) for every parameter, sorted by path: the fixed order of the hash."""
    items = [("/".join(str(getattr(k, "key", k)) for k in path), x)
             for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    return sorted(items)


def params_sha256(params: nnx.State) -> str:
    h = hashlib.sha256()
    for name, x in flat_params(params):
        a = _host(x)
        h.update(name.encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the loop

@dataclasses.dataclass
class RunResult:
    sha256: str
    history: list[dict]
    summary: str
    final_step: int


def _step_record(step: int, m: dict, dt: float, kinds: dict, with_tensors: bool) -> dict:
    g = m["gather"]
    sent = sum(float(s["sent_bytes"]) for s in g.values())
    plain = sum(float(s["plain_bytes"]) for s in g.values())
    changed = sum(float(s["changed"]) for s in g.values())
    words = sum(float(s["words_changed"]) for s in g.values())
    elems = sum(float(s["elements"]) for s in g.values())
    tiers: dict[str, int] = {}
    for s in g.values():
        tiers[str(int(s["tier"]))] = tiers.get(str(int(s["tier"])), 0) + 1
    rec = {"step": step, "loss": float(m["loss"]), "ce": float(m["ce"]),
           "lb_loss": float(m["lb_loss"]), "z_loss": float(m["z_loss"]),
           "grad_norm": float(m["grad_norm"]), "sent_bytes": int(sent), "plain_bytes": int(plain),
           "exp_changed_frac": changed / max(elems, 1.0),
           "word_changed_frac": words / max(elems, 1.0),
           "fallbacks": int(sum(int(s["fallback"]) for s in g.values())),
           "tiers": tiers, "step_time_s": dt}
    if with_tensors:
        rec["exp_change_by_tensor"] = {k: float(s["changed"]) / float(s["elements"])
                                       for k, s in sorted(g.items())}
        by_kind: dict[str, list[float]] = {}
        for k, s in g.items():
            kind = kinds.get(k, "other")
            acc = by_kind.setdefault(kind, [0.0, 0.0, 0.0])
            acc[0] += float(s["changed"])
            acc[1] += float(s["words_changed"])
            acc[2] += float(s["elements"])
        rec["exp_change_by_kind"] = {k: c / max(e, 1.0)
                                     for k, (c, _, e) in sorted(by_kind.items())}
        rec["word_change_by_kind"] = {k: w / max(e, 1.0)
                                      for k, (_, w, e) in sorted(by_kind.items())}
    return rec


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b:.1f} GB"


def _progress_line(rec: dict, steps: int, tokens: int) -> str:
    width = 20
    done = int(width * rec["step"] / max(steps, 1))
    bar = "#" * done + "." * (width - done)
    ratio = rec["sent_bytes"] / max(rec["plain_bytes"], 1)
    tiers = ",".join(f"{k}:{v}" for k, v in sorted(rec["tiers"].items(), key=lambda kv: int(kv[0])))
    return (f"[{bar}] step {rec['step']:>4}/{steps} loss {rec['loss']:.4f} | "
            f"{tokens / max(rec['step_time_s'], 1e-9):,.0f} tok/s | wire {ratio:.3f}x plain "
            f"({_fmt_bytes(rec['sent_bytes'])}/{_fmt_bytes(rec['plain_bytes'])}) | exp changed "
            f"{100 * rec['exp_changed_frac']:.3f}% | tiers {tiers} fallbacks {rec['fallbacks']}")


def summarize(history: list[dict], tc: TrainConfig, gather: str) -> str:
    """Per-phase table: first step (priming), warm-up, after warm-up, whole run."""
    if not history:
        return "(no steps run)"
    w = tc.warmup_steps
    first = history[0]["step"]
    phases = [("first step", [r for r in history if r["step"] == first]),
              (f"warm-up (<= {w})", [r for r in history if first < r["step"] <= w]),
              ("after warm-up", [r for r in history if r["step"] > max(w, first)]),
              ("last 25%", history[len(history) - max(1, len(history) // 4):]),
              ("all", history)]
    lines = [f"summary: config={tc.config} gather={gather} steps {first}..{history[-1]['step']}",
             f"{'phase':<18}{'steps':>6}{'loss':>9}{'wire/plain':>12}{'exp chg %':>11}"
             f"{'fallbacks':>10}{'step s':>9}"]
    for name, rs in phases:
        if not rs:
            continue
        sent = sum(r["sent_bytes"] for r in rs)
        plain = sum(r["plain_bytes"] for r in rs)
        times = sorted(r["step_time_s"] for r in rs)
        lines.append(f"{name:<18}{len(rs):>6}{rs[-1]['loss']:>9.4f}{sent / max(plain, 1):>12.4f}"
                     f"{100 * np.mean([r['exp_changed_frac'] for r in rs]):>11.4f}"
                     f"{sum(r['fallbacks'] for r in rs):>10}{times[len(times) // 2]:>9.3f}")
    return "\n".join(lines)


def train(tc: TrainConfig, *, steps: int, seed: int = 0, mesh: Mesh | None = None,
          data: str | None = None, data_dtype: str | None = None,
          metrics_out: str | None = None, checkpoint_dir: str | None = None,
          checkpoint_every: int = 0, resume: bool = False, log_every: int = 10,
          trace_every: int = 10, log: Callable[[str], None] | None = print) -> RunResult:
    """Train to ``steps`` total steps (continuing from the latest checkpoint with ``resume``)."""
    from models import checkpoint as ckpt

    log = log or (lambda s: None)
    mesh = mesh or make_mesh()
    dataset = load_dataset(data, tc.model.vocab_size, tc.length, data_dtype)
    tr = build_trainer(tc, mesh)
    state = tr.init_state(seed)
    if resume:
        if not checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        restored = ckpt.restore(checkpoint_dir, state)
        if restored is None:
            log(f"no checkpoint in {checkpoint_dir}; starting from step 0")
        else:
            state, meta = restored
            if meta.get("config", tc.config) != tc.config:
                raise ValueError(f"checkpoint in {checkpoint_dir} is for config "
                                 f"{meta['config']!r}, not {tc.config!r}")
            if meta.get("seed", seed) != seed:
                raise ValueError(f"checkpoint was trained with seed {meta['seed']}, not {seed}")
            log(f"resumed from {checkpoint_dir} at step {state.step} (caches re-prime)")

    if tc.gather == "ciera":
        log(tr.plan_summary)
    tokens_per_step = tc.batch_size * tc.length
    meta_out = {"seed": seed, "config": tc.config, "gather": tc.gather,
                "schedule_steps": tc.schedule_steps, "batch_size": tc.batch_size}
    history: list[dict] = []
    if metrics_out and resume and Path(metrics_out).exists():
        # Keep the records up to the restored step (a crashed run may have logged past it).
        keep = [line for line in Path(metrics_out).read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= state.step]
        Path(metrics_out).write_text("".join(line + "\n" for line in keep))
    out = open(metrics_out, "a" if resume else "w") if metrics_out else None
    try:
        while state.step < steps:
            batch = tr.batch(dataset, seed, state.step)  # data position == step
            t0 = time.perf_counter()
            state = tr.prepare(state)  # first step / after restore: encode at the start
            params, caches, opt_state, ahead, m = tr.step_fn(
                state.params, state.caches, state.opt_state, state.ahead, batch)
            m = jax.device_get(m)
            dt = time.perf_counter() - t0
            state = TrainState(state.step + 1, params, caches, opt_state, ahead)
            rec = _step_record(state.step, m, dt, tr.kinds,
                               with_tensors=trace_every > 0 and (state.step % trace_every == 0
                                                                or state.step == 1))
            history.append(rec)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if log_every and (state.step % log_every == 0 or state.step == steps or state.step == 1):
                log(_progress_line(rec, steps, tokens_per_step))
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss is {rec['loss']} at step {state.step}")
            if checkpoint_dir and checkpoint_every and state.step % checkpoint_every == 0:
                ckpt.save(checkpoint_dir, state, meta_out)
        if checkpoint_dir and history and (not checkpoint_every
                                           or state.step % checkpoint_every != 0):
            ckpt.save(checkpoint_dir, state, meta_out)
    finally:
        if out:
            out.close()
    summary = summarize(history, tc, tc.gather)
    sha = params_sha256(state.params)
    return RunResult(sha, history, summary, state.step)


__all__ = ["TrainConfig", "Trainer", "TrainState", "build_trainer", "make_mesh", "train",
           "params_sha256", "summarize", "RunResult"]

"""FSDP training of the MoE transformer: state, the sharded train step, the loop.

The train step is one ``jax.jit`` of one ``jax.shard_map`` over the ``fsdp`` mesh axis:

    params (f32 shards)  caches (replicated)  opt state (shards)  tokens (batch over fsdp)
        |                    |
        +-- loss_fn: nnx.merge -> model.loss; every @gathered layer casts its shards to bf16
        |            and gathers them just before use (ciera / plain / int8), updating its
        |            exponent caches; the caches and gather stats leave through the aux
        +-- grads: sharded params get the psum_scatter of the gather's backward (summed over
        |          ranks); replicated params (norms) are psummed by shard_map's autodiff.
        |          The loss is divided by the rank count, so both are grads of the global mean.
        +-- global-norm clipping (psum of sharded squares + replicated counted once), AdamW
    -> new params, new caches, new opt state, metrics (all rank-invariant scalars)

All three gather modes run this same code; ciera and plain give bitwise-identical params.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, max(1, tc.warmup_steps), max(tc.schedule_steps, tc.warmup_steps + 1),
        end_value=tc.lr * tc.min_lr_ratio)
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
    step: int
    params: nnx.State
    caches: nnx.State
    opt_state: object


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

    @property
    def n(self) -> int:
        return self.mesh.shape[AXIS]

    def init_state(self, seed: int) -> TrainState:
        model = fsdp.attach_caches(Transformer(self.tc.model, nnx.Rngs(seed)))
        _, params, caches = nnx.split(model, nnx.Param, ExponentCacheVar)
        params = _put(params, self.param_specs, self.mesh)
        caches = _put(caches, P(), self.mesh)
        opt_state = jax.jit(self.tx.init, out_shardings=jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.opt_specs, is_leaf=_is_spec))(params)
        return TrainState(0, params, caches, opt_state)

    def fresh_caches(self, state: TrainState) -> nnx.State:
        return _put(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state.caches), P(), self.mesh)

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
    kinds = _kinds(cfg)
    step_fn = _make_step(tc, mesh, graphdef, param_specs, opt_specs, tx)
    tr = Trainer(tc, mesh, graphdef, param_specs, opt_specs, tx, kinds, step_fn)
    _TRAINERS[key] = tr
    return tr


def _kinds(cfg: configs.ModelConfig) -> dict[str, str]:
    """Tensor path as the gather stats name it -> TensorSpec.kind."""
    out = {}
    mods = {"embed_VxD": "embed", "head_DxV": "head"}
    for t in configs.tensor_inventory(cfg):
        if t.layer is None:
            if t.name in mods:
                out[f"{mods[t.name]}/{t.name}"] = t.kind
        else:
            sub = "attn" if t.kind in ("attention",) else "mlp"
            out[f"layers/{t.layer}/{sub}/{t.name}"] = t.kind
    return out


def _make_step(tc: TrainConfig, mesh: Mesh, graphdef, param_specs, opt_specs, tx):
    n = mesh.shape[AXIS]

    def loss_fn(params, caches, tokens):
        model = fsdp.merge(graphdef, params, caches)  # caches are updated in place
        with fsdp.gather_mode(tc.gather) as ctx:
            loss, parts = model.loss(tokens, tc.lb_coef, tc.z_coef)
        new_caches = nnx.state(model, ExponentCacheVar)
        # Mean over the global batch: each rank's mean over its equal share, divided by n.
        return loss / n, (loss, parts, new_caches, ctx.stats)

    def local_step(params, caches, opt_state, tokens):
        grads, (loss, parts, caches, stats) = jax.grad(loss_fn, has_aux=True)(params, caches, tokens)
        grads, gnorm = fsdp.clip_by_global_norm(grads, param_specs, tc.clip_norm, AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": lax.pmean(loss, AXIS), "grad_norm": gnorm,
                   **{k: lax.pmean(v, AXIS) for k, v in parts.items()}, "gather": stats}
        return params, caches, opt_state, metrics

    sm = jax.shard_map(local_step, mesh=mesh,
                       in_specs=(param_specs, P(), opt_specs, P(AXIS)),
                       out_specs=(param_specs, P(), opt_specs, P()))
    return jax.jit(sm, donate_argnums=(0, 1, 2))


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
    elems = sum(float(s["elements"]) for s in g.values())
    tiers: dict[str, int] = {}
    for s in g.values():
        tiers[str(int(s["tier"]))] = tiers.get(str(int(s["tier"])), 0) + 1
    rec = {"step": step, "loss": float(m["loss"]), "ce": float(m["ce"]),
           "lb_loss": float(m["lb_loss"]), "z_loss": float(m["z_loss"]),
           "grad_norm": float(m["grad_norm"]), "sent_bytes": int(sent), "plain_bytes": int(plain),
           "exp_changed_frac": changed / max(elems, 1.0),
           "fallbacks": int(sum(int(s["fallback"]) for s in g.values())),
           "tiers": tiers, "step_time_s": dt}
    if with_tensors:
        rec["exp_change_by_tensor"] = {k: float(s["changed"]) / float(s["elements"])
                                       for k, s in sorted(g.items())}
        by_kind: dict[str, list[float]] = {}
        for k, s in g.items():
            kind = kinds.get(k, "other")
            acc = by_kind.setdefault(kind, [0.0, 0.0])
            acc[0] += float(s["changed"])
            acc[1] += float(s["elements"])
        rec["exp_change_by_kind"] = {k: c / max(e, 1.0) for k, (c, e) in sorted(by_kind.items())}
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
              (f"after warm-up", [r for r in history if r["step"] > max(w, first)]),
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
            params, caches, opt_state, m = tr.step_fn(state.params, state.caches,
                                                      state.opt_state, batch)
            m = jax.device_get(m)
            dt = time.perf_counter() - t0
            state = TrainState(state.step + 1, params, caches, opt_state)
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

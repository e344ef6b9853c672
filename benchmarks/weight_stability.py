"""Weight-stability study: what exponent mode and word mode send per step, per tensor kind.

Trains ``small`` (and/or ``tiny``) with the project's schedule (linear warm-up over 5% of the
steps, peak LR, cosine decay to 10%) under a plain gather: the weights are the same in every
mode, so the two modes are priced on the same step pairs. After each sampled step, for every
gathered tensor (each layer of a stack on its own), it takes the previous and the current bf16
words on the host, splits them into the 8 FSDP shards along the tensor's FSDP axis, and prices:

- exponent mode: ``b - 1`` payload bytes per weight plus the escape section of the rung that
  holds the MAX over shards of changed exponents (:class:`ciera_jax.codec.wire.ExponentWire`; above
  the top rung the main plane and then a plain gather), as ``ciera_jax.collective.gather`` sends it;
- word mode: ``d = ord(new) - ord(cached)``; escapes per code width ``b`` (``|d| >
  code_limit(b)``) and raw words (``|d| > 127``), MAX over shards, priced by
  :class:`ciera_jax.codec.wire.WordWire` at each width (``word_b2``..``word_b4``); ``word`` is the
  width the gather uses (``wire.DEFAULT_CODE_BITS``);
- the entropy bound: the empirical entropy of ``d`` per tensor, in bits per weight.

Costs are bytes per weight of what one rank sends for its shard (plain bf16: 2.0), summed
over tensors; the 4-byte agreement demand per tensor is left out of both modes. Phases:
warm-up (update t <= warm-up steps), peak (warm-up < t <= 25% of the run), steady (the second
half), late (the last 25%). Prints the tables, checks the word-mode targets, writes
JSON (``--out``), a PNG of bytes/weight vs step for both modes (``--png``), and optionally:

``--word-trace PATH``: word mode's bytes per weight (the ``chosen`` cost) per tensor kind and
phase, for the simulator (from the last config run)::

    {"format": "ciera-word-trace/1",
     "source": "<what was measured, how>",
     "phases": {"warmup" | "peak" | "steady" | "late":
                {"bytes_per_weight": {kind: float}, "overall": float}}}

``--counts-out PATH`` (.npz): the per-tensor, per-step shard-max counts, enough to price any
other wire table (``--from-counts PATH`` re-prices them without training).

    python benchmarks/weight_stability.py    # small, 300 steps: 20-60 min on 2 busy CPU cores
    python benchmarks/weight_stability.py --configs tiny --steps 100 --word-trace ''
    python benchmarks/weight_stability.py --word-trace ciera_jax/planning/data/word_trace.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from common import parser, write_results  # benchmarks/common.py, beside this script
from ciera_jax.codec import word_ladder as wl
from ciera_jax.codec.wire import CODE_BITS_CHOICES, DEFAULT_CODE_BITS, ExponentWire, WordWire

N_SHARDS = 8  # the FSDP split the study prices, whatever mesh trains
PHASES = ("warmup", "peak", "steady", "late")
DEFAULT_STEPS = {"tiny": 600, "small": 300}
# counts per tensor-layer, in this column order
COLS = ("n_local", "esc2", "esc3", "esc4", "raw", "exp", "ent_bits")


def parse_args(argv=None):
    p = parser(__doc__, "weight_stability", png=True)
    p.add_argument("--configs", nargs="+", default=["small"])
    p.add_argument("--steps", type=int, default=None,
                   help="steps per config (default: tiny 600, small 300)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5%%, >= 10)")
    p.add_argument("--sample-every", type=int, default=1,
                   help="price every k-th step pair (plus the --dense windows)")
    p.add_argument("--dense", default="",
                   help="extra step windows priced every step, e.g. '10-30,280-300'")
    p.add_argument("--devices", type=int, default=8, help="fsdp mesh of the training run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--word-trace", default="",
                   help="write the simulator's word-mode trace here (from the last config)")
    p.add_argument("--counts-out", default="", help="per-tensor counts (.npz) of the last config")
    p.add_argument("--from-counts", default="",
                   help="re-price a --counts-out file instead of training (--configs ignored)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- pricing

def ord_words(w: np.ndarray) -> np.ndarray:
    """Monotone integer of each word (int64): magnitude, or ``-magnitude - 1`` if negative."""
    bits = w.dtype.itemsize * 8
    w = w.astype(np.int64)
    mag = w & ((1 << (bits - 1)) - 1)
    return np.where(w >> (bits - 1), -mag - 1, mag)


def exponent_bits(w: np.ndarray) -> np.ndarray:
    mant = {2: 7, 4: 23}[w.dtype.itemsize]
    return (w >> mant) & 0xFF


def shard_view(x_LxS: np.ndarray, axis: int) -> np.ndarray:
    """(L, *shape) words of L layers -> (L, N_SHARDS, n_local), split along ``axis`` of a layer."""
    x = np.moveaxis(x_LxS, axis + 1, 1)
    if x.shape[1] % N_SHARDS:
        raise ValueError(f"dimension {axis} (size {x.shape[1]}) does not split into "
                         f"{N_SHARDS} shards")
    return x.reshape(x.shape[0], N_SHARDS, -1)


def entropy_bits(d: np.ndarray) -> float:
    """Empirical entropy of the integer array ``d``, bits per element."""
    if d.size == 0:
        return 0.0
    lo = int(d.min())
    if int(d.max()) - lo < (1 << 20):
        counts = np.bincount((d - lo).ravel())
        counts = counts[counts > 0]
    else:
        counts = np.unique(d, return_counts=True)[1]
    p = counts / d.size
    return float(-(p * np.log2(p)).sum())


def pair_counts(old_LxS: np.ndarray, new_LxS: np.ndarray, axis: int) -> np.ndarray:
    """Per layer (rows) the :data:`COLS` of one step pair: shard-max escape counts per code
    width, raw words and changed exponents, and the entropy of d over the whole tensor."""
    old, new = shard_view(old_LxS, axis), shard_view(new_LxS, axis)
    d = ord_words(new) - ord_words(old)
    a = np.abs(d)
    L, _, n_local = a.shape
    out = np.empty((L, len(COLS)), np.float64)
    out[:, 0] = n_local
    for j, limit in enumerate((wl.code_limit(2), wl.code_limit(3), wl.code_limit(4),
                               wl.LEVEL1_LIMIT)):
        out[:, 1 + j] = (a > limit).sum(axis=2).max(axis=1)
    out[:, 5] = (exponent_bits(old) != exponent_bits(new)).sum(axis=2).max(axis=1)
    out[:, 6] = [entropy_bits(d[i]) for i in range(L)]
    return out


def exponent_bytes(n_local: int, changed: int, word_bytes: int) -> int:
    """Bytes one rank sends in exponent mode (the main plane and plain above the top rung)."""
    return ExponentWire(n_local, word_bytes).sent_bytes(changed)


@dataclasses.dataclass(frozen=True)
class Priced:
    """Bytes one rank sends, per tensor-layer, for every way of sending it."""

    plain: np.ndarray
    exponent: np.ndarray
    word_b: dict  # code bits -> word mode at that width (the main plane and plain above the top)
    fallback: np.ndarray  # word mode at the default width falls back to plain
    entropy: np.ndarray  # the entropy bound, bytes

    @property
    def word(self) -> np.ndarray:
        """Word mode as the gather sends it (the default code width)."""
        return self.word_b[DEFAULT_CODE_BITS]


def price(counts: np.ndarray, word_bytes: int = 2) -> Priced:
    """Price the tensor-layers (rows of :data:`COLS`) of one step."""
    rows = [dict(zip(COLS, r)) for r in counts]
    n = np.array([r["n_local"] for r in rows])
    expo = np.array([exponent_bytes(int(r["n_local"]), int(r["exp"]), word_bytes) for r in rows],
                    np.float64)
    word_b = {b: np.array([WordWire(int(r["n_local"]), word_bytes, b).sent_bytes(
        int(r[f"esc{b}"]), int(r["raw"])) for r in rows], np.float64) for b in CODE_BITS_CHOICES}
    fallback = np.array([WordWire(int(r["n_local"]), word_bytes).rung(
        int(r[f"esc{DEFAULT_CODE_BITS}"]), int(r["raw"])) is None for r in rows])
    entropy = n * np.array([r["ent_bits"] for r in rows]) / 8
    return Priced(n * word_bytes, expo, word_b, fallback, entropy)


# ----------------------------------------------------------------------------- training

def train_and_count(name: str, args) -> dict:
    """Train ``name`` under a plain gather; per sampled step pair, the counts of every
    gathered tensor-layer. Returns the counts, the tensor-layer keys and kinds, and the LRs."""
    # JAX (and the trainer, which imports it) only after main() has set up the devices.
    import jax
    from jax import lax
    import jax.numpy as jnp

    from ciera_jax import fsdp
    from ciera_models import train as train_mod
    from ciera_models.train.data import load_dataset

    steps = args.steps or DEFAULT_STEPS.get(name, 300)
    warmup = args.warmup if args.warmup is not None else max(10, steps // 20)
    tc = train_mod.TrainConfig(config=name, gather="plain", lr=args.lr, warmup_steps=warmup,
                               schedule_steps=steps)
    mesh = train_mod.make_mesh(args.devices)
    tr = train_mod.build_trainer(tc, mesh)
    schedule = train_mod.make_schedule(tc)
    dataset = load_dataset(None, tc.model.vocab_size, tc.length, None)
    tensors = tr.tensors
    uint = {2: jnp.uint16, 4: jnp.uint32}

    @jax.jit
    def words(params):
        pd = fsdp.param_dict(params)
        return {k: lax.bitcast_convert_type(pd[k].astype(t.dtype),
                                            uint[jnp.dtype(t.dtype).itemsize])
                for k, t in tensors.items()}

    def host_words(params):
        return {k: (w if t.stack else w[None]) for (k, t), w in
                zip(tensors.items(), (np.asarray(v) for v in
                                      jax.device_get(list(words(params).values()))))}

    layer_keys = [t.layer_key(i) for t in tensors.values() for i in range(t.stack or 1)]
    kinds = [tr.kinds.get(k, "other") for k in layer_keys]
    wbytes = {jnp.dtype(t.dtype).itemsize for t in tensors.values()}
    if len(wbytes) != 1:
        raise ValueError(f"gathered tensors mix word sizes {sorted(wbytes)}; price them apart")
    sample = sampled_steps(steps, args.sample_every, args.dense)
    state = tr.init_state(args.seed)
    prev = host_words(state.params)
    out_steps, lrs, counts, losses = [], [], [], []
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        state, m = tr.step(state, tr.batch(dataset, args.seed, state.step))
        loss = float(jax.device_get(m["loss"]))
        if not math.isfinite(loss):
            raise FloatingPointError(f"{name}: loss is {loss} at step {t}")
        if t in sample or t + 1 in sample:
            cur = host_words(state.params)
            if t in sample:
                counts.append(np.concatenate([pair_counts(prev[k], cur[k], tt.axis)
                                              for k, tt in tensors.items()]))
                out_steps.append(t)
                lrs.append(float(schedule(t - 1)))
                losses.append(loss)
            prev = cur
        if t % max(1, steps // 20) == 0 or t == 1:
            el = time.perf_counter() - t0
            print(f"{name}: step {t}/{steps} loss {loss:.4f} ({el:.0f} s, "
                  f"{el / t:.2f} s/step)", flush=True)
    return {"config": name, "steps": steps, "warmup_steps": warmup, "lr_peak": args.lr,
            "devices": args.devices, "wall_s": time.perf_counter() - t0,
            "final_loss": losses[-1] if losses else None, "word_bytes": wbytes.pop(),
            "layer_keys": layer_keys, "kinds": kinds, "sample_steps": out_steps, "lr": lrs,
            "loss": losses, "counts": np.stack(counts)}


def sampled_steps(steps: int, every: int, dense: str) -> set[int]:
    """Step pairs to price: every k-th, the first and last, and the dense windows."""
    s = set(range(every, steps + 1, max(1, every))) | {1, steps}
    for part in filter(None, (x.strip() for x in dense.split(","))):
        lo, _, hi = part.partition("-")
        s |= set(range(max(1, int(lo)), min(steps, int(hi or lo)) + 1))
    return s


# ----------------------------------------------------------------------------- summary

def phase_of(t: int, steps: int, warmup: int) -> list[str]:
    out = []
    if t <= warmup:
        out.append("warmup")
    elif t <= steps // 4:
        out.append("peak")
    if t > steps // 2:
        out.append("steady")
    if t > steps - steps // 4:
        out.append("late")
    return out


METHODS = ("plain", "exponent", "word_b2", "word_b3", "word_b4", "word", "entropy")


def method_arrays(p: Priced) -> dict:
    return {"plain": p.plain, "exponent": p.exponent, "word_b2": p.word_b[2],
            "word_b3": p.word_b[3], "word_b4": p.word_b[4], "word": p.word,
            "entropy": p.entropy}


def summarize(run: dict) -> dict:
    """Per step, per phase and per kind bytes/weight of every method; the target checks."""
    counts, kinds, wb = run["counts"], run["kinds"], run["word_bytes"]
    kind_names = sorted(set(kinds))
    kind_idx = {k: np.array([i for i, x in enumerate(kinds) if x == k]) for k in kind_names}
    n = counts[0][:, 0]
    series = {m: [] for m in METHODS}
    by_kind_series = {k: {m: [] for m in ("exponent", "word", "entropy")} for k in kind_names}
    choice = {"word": 0, "fallback": 0}
    for c in counts:
        p = price(c, wb)
        arrs = method_arrays(p)
        for m in METHODS:
            series[m].append(float(arrs[m].sum() / n.sum()))
        for k, idx in kind_idx.items():
            for m in by_kind_series[k]:
                by_kind_series[k][m].append(float(arrs[m][idx].sum() / n[idx].sum()))
        choice["fallback"] += int(p.fallback.sum())
        choice["word"] += int((~p.fallback).sum())
    steps = run["sample_steps"]
    phases = {}
    for ph in PHASES:
        sel = [i for i, t in enumerate(steps)
               if ph in phase_of(t, run["steps"], run["warmup_steps"])]
        if not sel:
            continue
        phases[ph] = {
            "steps": [steps[sel[0]], steps[sel[-1]]], "samples": len(sel),
            "mean_lr": float(np.mean([run["lr"][i] for i in sel])),
            "bytes_per_weight": {m: float(np.mean([series[m][i] for i in sel])) for m in METHODS},
            "by_kind": {k: {m: float(np.mean([v[m][i] for i in sel])) for m in v}
                        for k, v in by_kind_series.items()},
        }
    excess = [a - b for a, b in zip(series["word"], series["exponent"])]
    worst = int(np.argmax(excess))
    targets = {}
    if "steady" in phases:
        r = phases["steady"]["bytes_per_weight"]["word"] / 2
        targets["steady_word_over_plain"] = {"value": r, "target": 0.29, "ok": r <= 0.29}
    if "peak" in phases:
        r = phases["peak"]["bytes_per_weight"]["word"] / 2
        targets["peak_word_over_plain"] = {"value": r, "target": 0.5, "ok": r <= 0.5}
    targets["max_step_word_minus_exponent"] = {
        "value": excess[worst], "step": steps[worst], "target": 0.02, "ok": excess[worst] <= 0.02}
    return {"phases": phases, "targets": targets, "choices": choice,
            "series": {"step": steps, "lr": run["lr"], "loss": run["loss"], **series,
                       "by_kind": by_kind_series}}


# ----------------------------------------------------------------------------- output

def print_tables(res: dict) -> None:
    s = res["summary"]
    print(f"\n{res['config']}: {res['steps']} steps, warm-up {res['warmup_steps']}, peak lr "
          f"{res['lr_peak']}, {len(res['summary']['series']['step'])} step pairs priced; "
          "bytes per weight one rank sends (plain bf16 = 2.00)")
    print(f"{'phase':<8}{'steps':>10}{'lr':>9}{'exponent':>10}{'word 2b':>9}{'3b':>7}{'4b':>7}"
          f"{'word':>8}{'/plain':>8}{'H bits':>8}")
    for ph, v in s["phases"].items():
        b = v["bytes_per_weight"]
        print(f"{ph:<8}{'%d-%d' % tuple(v['steps']):>10}{v['mean_lr']:>9.1e}{b['exponent']:>10.3f}"
              f"{b['word_b2']:>9.3f}{b['word_b3']:>7.3f}{b['word_b4']:>7.3f}"
              f"{b['word']:>8.3f}{b['word'] / 2:>8.3f}{8 * b['entropy']:>8.2f}")
    kinds = sorted(next(iter(s["phases"].values()))["by_kind"])
    print(f"\nper kind: exponent / word mode at {DEFAULT_CODE_BITS} bits (B/weight), entropy of d "
          "(bits/weight)")
    print(f"{'phase':<8}" + "".join(f"{k:>22}" for k in kinds))
    for ph, v in s["phases"].items():
        cells = (v["by_kind"][k] for k in kinds)
        print(f"{ph:<8}" + "".join(
            f"{'%.3f / %.3f / %.2f' % (c['exponent'], c['word'], 8 * c['entropy']):>22}"
            for c in cells))
    print(f"\nchoices (tensor-steps): {s['choices']}")
    for name, t in s["targets"].items():
        print(f"target {name}: {t['value']:.3f} (<= {t['target']}) "
              f"{'ok' if t['ok'] else 'MISSED'}" + (f" at step {t['step']}" if "step" in t else ""))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(7 * len(results), 8), squeeze=False)
    for j, res in enumerate(results):
        s = res["summary"]["series"]
        ax = axes[0][j]
        ax.plot(s["step"], s["exponent"], label="exponent mode", lw=1.2)
        ax.plot(s["step"], s["word"], label=f"word mode, {DEFAULT_CODE_BITS}-bit codes", lw=1.4)
        ax.plot(s["step"], s["entropy"], label="entropy bound of d",
                lw=1, color="grey", ls=":")
        ax.axhline(2.0, color="k", lw=0.8, ls="-.", label="plain bf16")
        ax.set_ylim(0, 2.1)
        ax.set_xlabel("step")
        ax.set_ylabel("bytes per weight (all gathered tensors)")
        st = res["summary"]["phases"].get("steady", {}).get("bytes_per_weight", {})
        ax.set_title(f"{res['config']}: steady exponent {st.get('exponent', math.nan):.3f}, "
                     f"word {st.get('word', math.nan):.3f} B/weight")
        lr_ax = ax.twinx()
        lr_ax.plot(s["step"], s["lr"], color="grey", alpha=0.4, lw=1.5)
        lr_ax.set_ylabel("learning rate", color="grey")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1][j]
        for i, (kind, v) in enumerate(sorted(s["by_kind"].items())):
            color = f"C{i}"
            ax.plot(s["step"], v["word"], color=color, lw=1.2, label=f"{kind} word")
            ax.plot(s["step"], v["exponent"], color=color, lw=0.8, ls=":")
        ax.set_ylim(0, 2.1)
        ax.set_xlabel("step")
        ax.set_ylabel("bytes per weight (solid: word, dotted: exponent)")
        ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def word_trace(res: dict) -> dict:
    ph = res["summary"]["phases"]
    return {"format": "ciera-word-trace/1",
            "source": f"measured by benchmarks/weight_stability.py: {res['config']}, "
                      f"{res['steps']} steps, warm-up {res['warmup_steps']}, peak lr "
                      f"{res['lr_peak']}, cosine to 10%; word mode as ciera_jax.codec.wire prices it "
                      f"({DEFAULT_CODE_BITS}-bit codes, the plain fallback included, per tensor "
                      f"and step, max over {N_SHARDS} FSDP shards), bytes one rank sends per "
                      f"bf16 weight",
            "phases": {p: {"bytes_per_weight": {k: v["word"]
                                                for k, v in ph[p]["by_kind"].items()},
                           "overall": ph[p]["bytes_per_weight"]["word"]}
                       for p in PHASES if p in ph}}


RUN_SCALARS = ("config", "steps", "warmup_steps", "lr_peak", "devices", "wall_s", "final_loss",
               "word_bytes")
RUN_LISTS = ("layer_keys", "kinds", "sample_steps", "lr", "loss")


def save_counts(path: str, run: dict) -> None:
    np.savez_compressed(path, counts=run["counts"], cols=np.array(COLS),
                        scalars=json.dumps({k: run[k] for k in RUN_SCALARS}),
                        **{k: np.array(run[k]) for k in RUN_LISTS})
    print(f"wrote {path}")


def load_counts(path: str) -> dict:
    z = np.load(path)
    if tuple(z["cols"]) != COLS:
        raise ValueError(f"{path}: columns {tuple(z['cols'])}, expected {COLS}; re-run the study")
    return {**json.loads(str(z["scalars"])), "counts": z["counts"],
            **{k: z[k].tolist() for k in RUN_LISTS}}


def main(argv=None) -> int:
    args = parse_args(argv)
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(max(args.devices, 1))
    results, runs = [], []
    for name in ([None] if args.from_counts else args.configs):
        run = load_counts(args.from_counts) if args.from_counts else train_and_count(name, args)
        runs.append(run)
        res = {k: v for k, v in run.items() if k not in ("counts", "layer_keys", "kinds",
                                                          "sample_steps", "lr", "loss")}
        res["code_bits"] = DEFAULT_CODE_BITS
        res["summary"] = summarize(run)
        results.append(res)
        print_tables(res)
    last = runs[-1]
    if args.counts_out:
        save_counts(args.counts_out, last)
    write_results(args.out, results)
    if args.png:
        plot(results, Path(args.png))
    if args.word_trace:
        out = Path(args.word_trace)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(word_trace(results[-1]), indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

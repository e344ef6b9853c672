"""Lossless end to end: FSDP training with the CIERA gather is bitwise plain FSDP training.

One TrainConfig for all runs, so the compiled step is shared in-process (it is memoized by
``build_trainer``); 20 steps of ``tiny`` on the 8 emulated devices of conftest, each gather
mode's run trained once per session (conftest's ``tiny_run``).
"""

import json
import re

import jax
import pytest
from flax import nnx

import ciera_jax
import ciera_jax.collective.cache as cache_lib
from ciera_jax import fsdp
from ciera_jax.cli import main as cli
from ciera_models.train import data, metrics
from ciera_models.model.transformer import Transformer, abstract_model
from ciera_models.train.compression import NO_CACHE, cache_modes
from ciera_models.train.state import bytes_per_device
from ciera_models.train import TrainConfig, build_trainer, make_mesh, choose_compressed, train
from ciera_jax.loop.rungs import program_key
from conftest import TINY_PROGRAMS

STEPS = 20
TC = TrainConfig(config="tiny", schedule_steps=STEPS, **TINY_PROGRAMS)  # horizon 20


class _Runs(dict):
    """{gather mode: RunResult} of the session's shared 20-step runs, trained on first use."""

    def __init__(self, tiny_run):
        super().__init__()
        self._run = tiny_run

    def __missing__(self, mode):
        return self._run(mode)


@pytest.fixture(scope="module")
def runs(tiny_run):
    return _Runs(tiny_run)  # conftest's tiny_run: TC with gather=mode, 20 steps, seed 0


def test_ciera_is_bitwise_plain_and_sends_less(runs):
    """The defaults (--cache auto --plan auto): on CPU word caches on every tensor, the same
    step as ``--plan all --cache word``."""
    c, p = runs["ciera"], runs["plain"]
    assert c.sha256 == p.sha256
    assert [r["loss"] for r in c.history] == [r["loss"] for r in p.history]
    assert [r["grad_norm"] for r in c.history] == [r["grad_norm"] for r in p.history]
    sent_c = sum(r["sent_bytes"] for r in c.history)
    sent_p = sum(r["sent_bytes"] for r in p.history)
    assert sum(r["plain_bytes"] for r in c.history) == sent_p
    assert sent_c < sent_p
    late = c.history[STEPS // 2:]  # near peak learning rate: words still move a lot
    assert sum(r["sent_bytes"] for r in late) < sum(r["plain_bytes"] for r in late)
    assert c.history[0]["fallbacks"] > 0  # the first gather primes the caches
    # every gather decoded what was sent: the Encoded each step carries to the next (encoded
    # at the end of the previous step) matched the receivers' caches
    assert all(r["verify_failed"] == 0 and not r["retried"] for r in c.history)
    assert all(r["fallbacks"] == 0 and r["exp_changed_frac"] == 0 for r in p.history)


def test_each_step_runs_a_program_whose_rungs_were_fixed_for_it(runs):
    """The first step runs the first program (rungs for the steady state; compiled then,
    unless a test before compiled it on the shared trainer) and primes the caches through its
    fallback (every tensor-layer plain); later steps buy a few more as the demand moves (the
    suite prices a compile like a plain step's bytes: ``TINY_PROGRAMS``), each compiled once
    (``compile_s`` on the step that did); the bytes count every program's padding and
    fallbacks."""
    hist = runs["ciera"].history
    first = hist[0]
    tr = build_trainer(TC, make_mesh(8))  # the run's trainer: its first program is the steady one
    assert list(tr.programs)[0] == program_key(tr.policy.first) and first["program"] == 0
    assert first["rungs"] and all(int(t) >= 0 for t in first["rungs"])
    assert first["fallbacks"] == sum(first["rungs"].values())  # every tensor-layer plain
    assert first["overflows"] > 0  # fresh caches: above every rung
    assert first["sent_bytes"] >= first["plain_bytes"]
    seen = set()
    for r in hist:
        assert (r["program"] not in seen) or r["compile_s"] == 0, r["step"]
        # an overflow goes plain unless an overflow rung sent it as words
        assert r["overflows"] - r["overflow_words"] <= r["fallbacks"]
        seen.add(r["program"])
    assert 2 <= len(seen) <= TC.max_programs
    assert any(r["fallbacks"] == 0 for r in hist)  # some steps compress every tensor


def test_the_default_price_compiles_one_program_on_the_emulated_link(runs):
    """``--program-patience`` 1 (the default): no second program pays for its compile on
    the emulated CPU link (priced by --profile cpu-emulated), so a run compiles one; its
    params stay bitwise plain's."""
    tc = TrainConfig(**{**TC.__dict__, "program_patience": 1.0, "max_programs": 8})
    res = train(tc, steps=4, seed=0, mesh=make_mesh(8), log=None)
    assert [r["program"] for r in res.history] == [0] * 4
    # The trainer is memoized: a CLI test with the same flags may have compiled its one
    # program earlier in this process, so step 1 compiles it or finds it compiled.
    assert [r["compile_s"] > 0 for r in res.history][1:] == [False] * 3
    assert len(build_trainer(tc, make_mesh(8)).programs) == 1
    plain = train(TrainConfig(**{**TC.__dict__, "gather": "plain"}), steps=4, seed=0,
                  mesh=make_mesh(8), log=None)
    assert res.sha256 == plain.sha256
    assert re.match(r"compiles: [\d.]+ s waited(; the train step compiled once)?",
                    res.summary.splitlines()[-1])
    assert "program" not in res.summary  # the internals: --verbose
    verbose = metrics.summarize(res.history, tc, "ciera", verbose=True)
    assert re.search(r"^programs: [01] compiled", verbose, re.M)


@pytest.mark.slow
def test_overflow_rungs_send_words_above_the_program_and_stay_bitwise_plain(runs):
    """``--overflow-rungs 3`` with one program: the steps whose demand is up to 3 rungs above
    it still send words (``overflow_words``), none of those goes plain (``fallbacks`` counts
    what the device sent plainly), every self-check passes, and the params are plain's."""
    tc = TrainConfig(**{**TC.__dict__, "overflow_rungs": 3, "max_programs": 1})
    res = train(tc, steps=STEPS, seed=0, mesh=make_mesh(8), log=None)
    assert res.sha256 == runs["plain"].sha256
    assert all(r["verify_failed"] == 0 and not r["retried"] for r in res.history)
    assert all(r["overflow_words"] <= r["overflows"] for r in res.history)
    exits_only = [r for r in res.history if 0 < r["overflow_words"] == r["overflows"]]
    assert exits_only and all(r["fallbacks"] == 0 for r in exits_only)
    assert re.search(r"overflows \d+ tensor-layers above their program's rung \(\d+ of them "
                     r"sent as words", metrics.summarize(res.history, tc, "ciera", verbose=True))


@pytest.mark.slow
def test_no_overflow_rungs_send_every_overflow_plainly_and_stay_bitwise_plain(runs):
    """``--overflow-rungs 0`` (the smaller compile): every overflow is a plain gather."""
    tc = TrainConfig(**{**TC.__dict__, "overflow_rungs": 0, "max_programs": 1})
    res = train(tc, steps=STEPS, seed=0, mesh=make_mesh(8), log=None)
    assert res.sha256 == runs["plain"].sha256
    assert all(r["overflow_words"] == 0 for r in res.history)
    assert sum(r["overflows"] for r in res.history) > 0


def test_loss_falls(runs):
    losses = [r["loss"] for r in runs["ciera"].history]
    assert losses[-1] < losses[0] - 0.8, losses


@pytest.mark.slow
def test_int8_runs_and_is_lossy(runs):
    q = runs["int8"]
    assert q.sha256 != runs["plain"].sha256
    assert q.history[-1]["loss"] < q.history[0]["loss"]
    assert q.history[-1]["sent_bytes"] < 0.6 * q.history[-1]["plain_bytes"]


def test_sharded_loss_is_the_unsharded_model_loss(runs):
    # Step 1: params at init, batch 0; the same math as the unsharded model (up to summation
    # order; the load-balance term is per rank, so compare the cross-entropy).
    ds = data.load_dataset(None, 256, TC.length)
    toks = ds.batch(0, 0, TC.batch_size, TC.length)
    ce = jax.jit(lambda t: Transformer(TC.model, nnx.Rngs(0)).loss(t)[1]["ce"])(toks)
    assert abs(runs["plain"].history[0]["ce"] - float(ce)) < 1e-3


def test_cli_resume_is_bitwise_and_writes_metrics(runs, tmp_path, capsys):
    ck, metrics = tmp_path / "ckpt", tmp_path / "run.jsonl"
    common = ["train", "--schedule-steps", str(STEPS), "--checkpoint-dir", str(ck),
              "--metrics-out", str(metrics), "--log-every", "5", "--trace-every", "5"]
    assert cli.main([*common, "--steps", "10"]) == 0
    first = capsys.readouterr().out
    assert cli.main([*common, "--steps", str(STEPS), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step   20/20" in out
    assert out.strip().splitlines()[-1] == f"params_sha256={runs['ciera'].sha256}"
    assert "summary:" in out and "wire/plain" in out and "params_sha256=" in first
    assert "plan: profile=cpu-emulated ranks=8" in first  # the plan, once, at the start
    assert first.count("plan: profile=") == 1
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    headers = [r["header"] for r in lines if "header" in r]
    assert [h["start_step"] for h in headers] == [0, 10]  # one per start, the resume's too
    assert headers[0]["train_config"]["gather"] == "ciera"
    assert set(headers[0]["memory_per_device"]) == {"params", "optimizer", "caches (auto)"}
    recs = [r for r in lines if "header" not in r]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for key in ("step", "loss", "sent_bytes", "plain_bytes", "exp_changed_frac", "fallbacks",
                "step_time_s", "step_cpu_s", "word_changed_frac"):
        assert key in recs[0]
    assert all(r["step_cpu_s"] > 0 for r in recs)  # every step computes on the host's CPU
    # a first gather: every word is new; later a word changes at least as often as its exponent
    assert recs[0]["word_changed_frac"] == 1.0 and recs[10]["word_changed_frac"] == 1.0
    assert all(r["exp_changed_frac"] <= r["word_changed_frac"] <= 1 for r in recs)
    assert 0 < recs[5]["word_changed_frac"] < 1
    traced = [r for r in recs if "exp_change_by_kind" in r]
    assert traced and {"expert_gate", "expert_up", "expert_down", "attention", "embed", "head",
                        "router"} <= set(traced[-1]["exp_change_by_kind"])
    assert all(0 <= v <= 1 for v in traced[-1]["exp_change_by_tensor"].values())
    assert set(traced[-1]["word_change_by_kind"]) == set(traced[-1]["exp_change_by_kind"])
    assert "layers/1/mlp/w_gate_ExDxF" in traced[-1]["exp_change_by_tensor"]
    # the resumed run's first step re-primed its fresh caches
    assert recs[10]["fallbacks"] > 0


INTERNALS = ("cache", "rung", "program", "escape", "fallback", "exp chg", "exp changed",
             "legend", "padding", "overflow", "encode", "tier", "prim")


def test_a_plain_run_prints_nothing_about_the_compressed_gathers_internals(runs, capsys):
    """The step is ``runs["plain"]``'s (the same TrainConfig: the trainer is memoized), so
    this run compiles nothing new."""
    runs["plain"]
    argv = ["train", "--gather", "plain", "--steps", "3", "--schedule-steps", str(STEPS),
            "--program-patience", str(TC.program_patience), "--log-every", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "step    3/3 loss" in out and "summary:" in out and "compiles:" in out
    said = [w for w in INTERNALS if w in out.lower()]
    assert not said, (said, out)


def test_a_compressed_runs_lines_say_loss_throughput_wire_and_why_plainly(runs):
    res = runs["ciera"]
    tokens = TC.batch_size * TC.length
    for rec in res.history:
        line = metrics.progress_line(rec, STEPS, tokens)
        assert re.search(r"loss [\d.]+ \| [\d,]+ tok/s \| wire [\d.]+x plain \(", line), line
        assert not [w for w in INTERNALS if w in line.lower()], line
        verbose = metrics.progress_line(rec, STEPS, tokens, verbose=True)
        assert f"{rec['fallbacks']} sent plainly" in verbose and "rungs " in verbose
    said = re.search(r"^sent plainly: (\d+) of (\d+) gathers of a compressed tensor-layer: "
                     r"(\d+) filling the caches \(the first step\)", res.summary, re.M)
    assert said, res.summary
    assert int(said.group(1)) == sum(r["fallbacks"] for r in res.history)
    assert int(said.group(3)) == res.history[0]["fallbacks"] > 0
    if int(said.group(1)) > int(said.group(3)):
        assert "whose weights moved more than the step was compiled to send compressed" in (
            res.summary)
    assert "program" not in res.summary and "rung" not in res.summary


@pytest.mark.parametrize("argv,msg", [
    (["--config", "nope"], "unknown config 'nope'"),
    (["--devices", "3", "--batch-size", "3"], "does not divide"),
    (["--data", "/nonexistent/tokens.bin"], "data file not found"),
    (["--batch-size", "12"], "not divisible by the 8 devices"),
])
def test_bad_input_one_clear_line(argv, msg, capsys):
    assert cli.main(["train", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_plan_compresses_expert_weights_by_default():
    model = fsdp.attach_caches(abstract_model(TC.model))
    tensors = fsdp.gathered_tensors(model)
    # the default (--cache auto): the cost model prices word caches (gathered once per step),
    # and on CPU (no memory limit) every tensor's pays
    default, _ = choose_compressed(TC, tensors, 8, "cpu")
    assert all(default.values())
    assert set(cache_modes(TC, tensors, default, 8, "cpu").values()) == {"word"}
    auto, summary = choose_compressed(TrainConfig(cache="exponent"), tensors, 8, "cpu")
    assert {k for k, v in auto.items() if v} == {
        "layers/mlp/w_gate_ExDxF", "layers/mlp/w_up_ExDxF", "layers/mlp/w_down_ExFxD"}
    assert "profile=cpu-emulated" in summary and "forced (expert weights)" in summary
    # tiny's tensors are too small for the cost model on any built-in profile
    cost, _ = choose_compressed(TrainConfig(plan="cost", profile="h100-nvlink", cache="exponent"),
                        tensors, 8, "gpu")
    assert not any(cost.values())
    every, _ = choose_compressed(TrainConfig(plan="all"), tensors, 8, "cpu")
    assert all(every.values())
    with pytest.raises(ValueError, match="unknown plan"):
        choose_compressed(TrainConfig(plan="most"), tensors, 8, "cpu")


def test_cache_modes_per_tensor():
    tensors = fsdp.gathered_tensors(fsdp.attach_caches(abstract_model(TC.model)))
    exponent = TrainConfig(cache="exponent")
    compress, _ = choose_compressed(exponent, tensors, 8, "cpu")
    assert not all(compress.values())  # the expert weights only
    # a tensor gathered plainly gets no cache bytes
    expect = {k: "exponent" if c else NO_CACHE for k, c in compress.items()}
    assert cache_modes(exponent, tensors, compress, 8, "cpu") == expect
    word = cache_modes(TrainConfig(cache="word"), tensors, compress, 8, "cpu")
    assert {k for k, m in word.items() if m == "word"} == {k for k, c in compress.items() if c}
    auto = cache_modes(TrainConfig(cache="auto"), tensors, compress, 8, "cpu")
    assert all(m == NO_CACHE for k, m in auto.items() if not compress[k])
    assert {m for k, m in auto.items() if compress[k]} <= {"exponent", "word"}


def test_init_allocates_only_the_caches_the_plan_uses(monkeypatch):
    """A plain run's state holds one-byte placeholder caches and never makes a full-size one,
    even for a moment (an exponent cache for every tensor is ~7 GB per device on OLMoE); and no
    array of its state is zero-size (JAX 0.11's partitioner crashes compiling a shard_map that
    takes one: every plain and int8 step did, 8 devices, CPU and GPU alike)."""
    tr = build_trainer(TrainConfig(config="tiny", schedule_steps=STEPS, gather="plain"),
                       make_mesh(8))  # conftest's plain run: the trainer is shared
    made, real = [], cache_lib.init_cache

    def spy(shape, dtype, mode="exponent"):
        made.append(tuple(shape))
        return real(shape, dtype, mode)

    monkeypatch.setattr(cache_lib, "init_cache", spy)
    monkeypatch.setattr(ciera_jax, "init_cache", spy)
    state = tr.init_state(0)
    assert made and set(made) == {cache_lib.EMPTY_SHAPE} and cache_lib.EMPTY_SHAPE == (1,), made
    assert bytes_per_device(state.caches) < 64
    held = jax.tree.leaves((state.params, state.caches, state.opt_state))
    assert all(leaf.size for leaf in held), "a zero-size array in the state"


def test_cache_auto_fits_the_memory_budget():
    tensors = fsdp.gathered_tensors(fsdp.attach_caches(abstract_model(TC.model)))
    compress, _ = choose_compressed(TC, tensors, 8, "cpu")

    def modes(gb):
        tc = TrainConfig(cache="auto", memory_gb=gb)
        return cache_modes(tc, tensors, compress, 8, "cpu")

    assert modes(1000.0) == modes(None)  # a large budget: the unlimited plan
    assert "word" in modes(None).values()
    assert set(modes(0.001).values()) == {"exponent"}  # no room left for word caches
    with pytest.raises(ValueError, match="smaller than the training state"):
        modes(0.0)


@pytest.mark.slow
def test_word_caches_train_bitwise_plain_and_send_less(runs):
    """The default (--cache auto: word caches on every tensor on CPU) against exponent caches
    on the same plan."""
    res = train(TrainConfig(**{**TC.__dict__, "cache": "exponent", "plan": "all"}),
                steps=STEPS, seed=0, mesh=make_mesh(8), log=None)
    assert res.sha256 == runs["plain"].sha256
    assert sum(r["sent_bytes"] for r in runs["ciera"].history) < sum(
        r["sent_bytes"] for r in res.history)


def _fault_rows(res, step):
    return [r for r in res.history if r["step"] == step]


def _drill_config(**changes) -> TrainConfig:
    """TC for a fault drill, whose faulted step must compress the faulted tensor: a step that
    gathers it plainly (priming, an overflow) refreshes the cache from the bits, unchecked,
    so the fault is overwritten and nothing is lost, but nothing is caught either. Which steps
    compress depends on when the policy buys programs; at TC's patience that is priced by
    measured compile seconds, so it moves with the machine's load (CI once missed step 8 of
    the exponent drill, and step 7 of the word drill). Patience 0 buys whenever a better
    program exists, whatever a compile takes."""
    return TrainConfig(**{**TC.__dict__, "program_patience": 0.0, "max_programs": 4,
                          **changes})


@pytest.mark.slow  # a drill: its programs (bought at patience 0) are its own
def test_injected_cache_fault_is_caught_healed_and_lost_nothing(runs):
    """Bits flipped in rank 2's cache before step 8: that step's row shows the failed check,
    nothing is applied, the batch runs again, and the run ends bitwise where plain ends."""
    lines = []
    # exponent caches: tiny's exponents churn far above the first program's rungs; at the
    # drill's patience programs come at steps 2, 3 and 5, and step 8 compresses with no
    # overflow
    tc = _drill_config(cache="exponent")
    res = train(tc, steps=STEPS, seed=0, mesh=make_mesh(8), log=lines.append,
                inject_cache_fault="8:2")
    first, redo = _fault_rows(res, 8)
    assert first["verify_failed"] >= 1 and not first["retried"]
    assert redo["verify_failed"] == 0 and redo["retried"]
    assert all(r["verify_failed"] == 0 for r in res.history if r["step"] != 8)
    assert len(res.history) == STEPS + 1
    assert res.sha256 == runs["plain"].sha256 == runs["ciera"].sha256
    assert any("self-check failed" in line for line in lines)


@pytest.mark.slow
def test_injected_word_cache_fault_is_caught_and_healed(runs):
    """Word caches (TC's defaults on CPU: test_plan_compresses_expert_...), rank 0's cache
    flipped before step 4: caught, redone, and the run ends bitwise where plain ends."""
    # at the drill's patience programs come at steps 2, 3 and 4, and step 4 sends every
    # tensor-layer as words
    tc = _drill_config()
    assert set(build_trainer(tc, make_mesh(8)).cache_modes.values()) == {"word"}
    res = train(tc, steps=STEPS, seed=0, mesh=make_mesh(8), log=None, inject_cache_fault="4:0")
    first, redo = _fault_rows(res, 4)
    assert first["fallbacks"] == 0  # the faulted step compressed every tensor-layer
    assert first["verify_failed"] >= 1 and redo["retried"] and redo["verify_failed"] == 0
    assert res.sha256 == runs["plain"].sha256


@pytest.mark.parametrize("spec, msg", [
    ("x", "expected STEP"), ("0", "STEP must be >= 1"), ("3:9", "not among the 8 ranks"),
    ("3:0:nope", "not a compressed tensor")])
def test_bad_fault_specs_fail_before_training(spec, msg):
    with pytest.raises(ValueError, match=msg):
        train(TC, steps=1, seed=0, mesh=make_mesh(8), log=None, inject_cache_fault=spec)

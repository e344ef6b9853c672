"""Pre-flight of a user's own step (``ciera_models.aot.user_step``, ``ciera aot --step``): the
README's Flax example compiled for 8 compile-only H100s and reported as the trainer's step is."""

from __future__ import annotations

import pytest

from ciera_models.aot import user_step
from ciera_models.cli import aot as aot_cli

import readme_step


def test_a_step_is_named_module_colon_function_with_one_line_errors():
    assert user_step.load_builder("readme_step:build_word") is readme_step.build_word
    for bad, says in [("readme_step", "module:function"), ("no_such_mod:f", "no_such_mod"),
                      ("readme_step:nothing", "nothing"), ("readme_step:D", "not a function")]:
        with pytest.raises(ValueError, match=says):
            user_step.load_builder(bad)


@pytest.mark.slow
def test_the_readme_example_compiles_for_8_h100s_plain_and_word(tmp_path, capsys):
    """Plain: no conditional, no all-gather in a branch, every gathered byte overlapped. The
    bare decorator in word mode (the per-call path, no agreement ahead): its rung switch is
    compiled, a conditional a step executes, with all-gathers in its branches: what the docs
    say it costs on a GPU."""
    plain = user_step.compile_user_step(readme_step.build_plain, gpus=8)
    assert set(user_step.REPORT_KEYS) <= set(plain)
    assert plain["conditionals"] == plain["steady_conditionals_per_step"] == 0
    assert plain["all_gathers_in_branches"] == 0 and plain["fusions"] > 0
    assert 0 < plain["memory"]["total"] < plain["memory"]["capacity"]
    word = user_step.compile_user_step(readme_step.build_word, gpus=8)
    assert word["conditionals_per_step"] >= word["conditionals"] >= 1
    assert word["all_gathers_in_branches"] >= 1
    assert word["fusions"] > plain["fusions"]
    # the command: the same report, as a table and JSON
    out = tmp_path / "r.json"
    parser = aot_cli.argparse.ArgumentParser()
    aot_cli.add_arguments(parser)
    assert aot_cli.run(parser.parse_args(["--step", "readme_step:build_plain", "--gpus", "8",
                                          "--json", str(out)])) == 0
    assert "steady_conditionals_per_step" in capsys.readouterr().out and out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["word", "exponent"])
def test_the_wrapped_steps_steady_program_holds_no_conditional(mode):
    """Under ciera_jax.train_step the README's step on its steady path (each tensor at the rung
    holding the steady demand) and the encode program run after it: no conditional, no
    all-gather in a branch, fewer kernels together than the bare decorator's program."""
    steady = user_step.compile_user_step(getattr(readme_step, f"build_{mode}_steady"), gpus=8)
    assert steady["conditionals"] == steady["conditionals_per_step"] == 0
    assert steady["all_gathers_in_branches"] == 0
    encode = user_step.compile_user_step(getattr(readme_step, f"build_{mode}_encode"), gpus=8)
    assert encode["conditionals"] == encode["all_gathers_in_branches"] == 0
    bare = user_step.compile_user_step(getattr(readme_step, f"build_{mode}"), gpus=8)
    assert bare["conditionals"] >= 1
    assert steady["fusions"] + encode["fusions"] < bare["fusions"]


@pytest.mark.slow
def test_blocks_called_in_a_row_gather_under_the_blocks_before():
    """Four of the README's blocks in a row under ciera_jax.train_step: every gather's inputs
    are made ahead, so XLA starts each block's gathers under the compute before it: every
    gathered byte overlapped, as plain's, and still no conditional."""
    plain = user_step.compile_user_step(readme_step.build_plain_4, gpus=8)
    steady = user_step.compile_user_step(readme_step.build_word_steady_4, gpus=8)
    assert steady["conditionals_per_step"] == steady["all_gathers_in_branches"] == 0
    assert steady["all_gather_overlap_share"] >= plain["all_gather_overlap_share"] > 0


@pytest.mark.slow
def test_a_stack_run_with_nnx_scan_gathers_layer_l_plus_1_under_layer_l():
    """Four of the README's blocks stacked with nnx.vmap and run with nnx.scan under
    ciera_jax.train_step: the layer loop's gathers read only inputs made ahead, so XLA
    pipelines them (layer l+1's all-gather started under layer l); no conditional."""
    plain = user_step.compile_user_step(readme_step.build_plain_stacked_4, gpus=8,
                                        hlo_out=None)
    steady = user_step.compile_user_step(readme_step.build_word_steady_stacked_4, gpus=8)
    assert steady["conditionals_per_step"] == steady["all_gathers_in_branches"] == 0
    assert steady["all_gather_overlap_share"] >= plain["all_gather_overlap_share"] > 0
    assert steady["fusions"] < 1.5 * plain["fusions"]

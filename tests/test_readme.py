"""Every Python example in the README and in docs/ runs as written (in a fresh process, like a
new user).

- README.md: each ```python block is a whole program and runs on its own.
- docs/*.md: a guide builds up, so a file's blocks run in order as one program. A block that
  needs names the reader supplies (a fragment such as "export your ``step``") gets them from a
  hidden setup block just before it, an HTML comment that the page does not show:
  ``<!-- test-setup`` newline, the code, ``-->``. It runs in that place in the program.
- A block that would train for long states it with a shorter run in the test: a hidden
  ``<!-- test-replace OLD => NEW -->`` line before it replaces the text OLD by NEW in the next
  block when it is tested (the page keeps the long run). No block is skipped.
- The README's Flax example is checked past running: in its process, after it ran as written
  (word caches), it runs again with exponent caches and with plain gathers; each compressed
  run's last step sent every tensor compressed, and all three end on plain's bits.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

# A ```python block, a hidden setup block, or a replacement for the next ```python block.
PIECE = re.compile(r"```python\n(?P<code>.*?)```"
                   r"|<!-- test-setup\n(?P<setup>.*?)-->"
                   r"|<!-- test-replace (?P<old>.*?) => (?P<new>.*?) -->", flags=re.S)


def programs(text: str) -> list[str]:
    """The code of every ```python block in ``text``, with its hidden setup and replacements
    applied; one entry per block."""
    out, setup, replace = [], "", []
    for m in PIECE.finditer(text):
        if m["setup"] is not None:
            setup += m["setup"]
        elif m["old"] is not None:
            replace.append((m["old"], m["new"]))
        else:
            code = m["code"]
            for old, new in replace:
                if old not in code:
                    raise ValueError(f"test-replace: {old!r} is not in the next block")
                code = code.replace(old, new)
            out.append(setup + code)
            setup, replace = "", []
    return out


def _is_flax_example(code: str) -> bool:
    return "fsdp.attach_caches(" in code


def _cases():
    cases = [pytest.param(code, id=f"README-{i}")
             for i, code in enumerate(programs(README.read_text()))
             if not _is_flax_example(code)]  # test_readme_flax_example_bitwise_plain
    for doc in DOCS:
        blocks = programs(doc.read_text())
        if blocks:  # one program per guide: later blocks use what earlier ones built
            cases.append(pytest.param("\n".join(blocks), id=f"docs/{doc.name}"))
    return cases


def run_program(code: str, tmp_path: Path) -> str:
    """Runs ``code`` as a script in a fresh process; returns what it printed."""
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("code", _cases())
def test_example_runs(code, tmp_path):
    run_program(code, tmp_path)


# The README's Flax example in three variants, by text: as written (word caches), exponent
# caches, plain gathers (the model's gather mode set before its optimizer is built).
FLAX_VARIANTS = {"word": (), "exponent": (('mode="word"', 'mode="exponent"'),),
                 "plain": (("opt = nnx.Optimizer(model,",
                            'opt = nnx.Optimizer(fsdp.set_gather_mode(model, "plain"),'),)}

FLAX_CHECK = """
import jax, numpy as np
from flax import nnx
from ciera_jax import fsdp

runs = {}
for name, code in VARIANTS.items():
    runs[name] = {"__name__": "__main__"}
    exec(compile(code, f"README.md ({name})", "exec"), runs[name])


def bits(ns):
    leaves = jax.tree.leaves((nnx.state(ns["model"], nnx.Param), ns["loss"]))
    return [np.atleast_1d(np.asarray(a)).view(np.uint8) for a in leaves]


for name, cache in (("word", "WordCache"), ("exponent", "ExponentCache")):
    ns = runs[name]
    caches = fsdp.cache_dict(nnx.state(ns["model"], fsdp.GatherCacheVar))
    assert caches and {type(c).__name__ for c in caches.values()} == {cache}, (name, caches)
    assert ns["stats"] and all(
        int(s["fallback"]) == 0 and int(s["sent_bytes"]) < int(s["plain_bytes"])
        for s in ns["stats"].values()), (name, ns["stats"])
    assert all(np.array_equal(a, b) for a, b in zip(bits(ns), bits(runs["plain"]))), name
assert all(int(s["rung"]) == -1 for s in runs["plain"]["stats"].values())
print("checked: word and exponent caches bitwise plain, last step compressed")
"""


def test_readme_flax_example_bitwise_plain(tmp_path):
    """The README's Flax example (decorator, ``nnx.jit``, the (2, 4) data x fsdp mesh) as
    written with word caches, and with exponent caches: its last step compresses every
    tensor, and the parameters and loss are bitwise those of plain gathers."""
    (code,) = [c for c in programs(README.read_text()) if _is_flax_example(c)]
    variants = {}
    for name, swaps in FLAX_VARIANTS.items():
        variants[name] = code
        for old, new in swaps:
            assert code.count(old) == 1, f"the README's Flax example changed: {old!r}"
            variants[name] = variants[name].replace(old, new)
    assert "jax.make_mesh((2, 4), (\"data\", \"fsdp\")" in code
    out = run_program(f"VARIANTS = {variants!r}\n{FLAX_CHECK}", tmp_path)
    assert "checked:" in out and "wire/plain" in out, out


def test_docs_links_resolve():
    """Every relative link in the README and docs/ names a file that exists (docs move)."""
    missing = []
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_readme_is_a_front_door():
    """The README stays short; the rest lives in docs/."""
    assert len(README.read_text().splitlines()) <= 150


def test_results_page_is_current():
    """docs/results.md holds today's figures, one section per claim, not a log."""
    assert len((ROOT / "docs" / "results.md").read_text().splitlines()) <= 400

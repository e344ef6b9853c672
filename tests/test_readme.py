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


def _cases():
    cases = [pytest.param(code, id=f"README-{i}")
             for i, code in enumerate(programs(README.read_text()))]
    for doc in DOCS:
        blocks = programs(doc.read_text())
        if blocks:  # one program per guide: later blocks use what earlier ones built
            cases.append(pytest.param("\n".join(blocks), id=f"docs/{doc.name}"))
    return cases


def run_program(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("code", _cases())
def test_example_runs(code, tmp_path):
    run_program(code, tmp_path)


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

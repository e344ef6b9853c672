"""docs/layout.md maps the tree: one line per module of ``ciera_jax``, ``ciera_models`` and
``ciera_harness``, each under its folder, and no line for a module that is not there."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ciera_jax", "ciera_models", "ciera_harness")


def _listed() -> list[str]:
    """The module paths the tree block names, from each line's indentation and folder."""
    text = (ROOT / "docs" / "layout.md").read_text()
    block = text[text.index("\nciera_jax/\n") + 1:]
    block = block[:block.index("\n```")]
    folders: list[str] = []
    listed = []
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m or not re.fullmatch(r"[\w.]+/|[\w]+\.py", m.group(2)):
            continue  # a description carried on to the next line
        depth = len(m.group(1)) // 2
        if len(folders) < depth:
            continue  # a description line that happens to start with a name
        del folders[depth:]
        name = m.group(2)
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            listed.append("/".join([*folders, name]))
    return listed


def _modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def test_layout_lists_each_module_once():
    listed = _listed()
    assert len(listed) == len(set(listed)), sorted(m for m in listed if listed.count(m) > 1)


def test_layout_matches_the_tree():
    """Every module is listed; a package's ``__init__.py`` is listed where it holds an API."""
    listed, modules = set(_listed()), _modules()
    assert listed - modules == set(), "listed but not in the tree"
    unlisted = {m for m in modules - listed if not m.endswith("__init__.py")}
    assert unlisted == set(), "in the tree but not listed"

"""The project describes what it is and what was measured, not how the work went: no file
refers to numbered log entries, batches of work or issue numbers, and no recorded result is
named after one. Pure Python; reads files only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCANNED = ["README.md", "docs", "ciera_jax", "ciera_models", "tests", "benchmarks"]
TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".json", ".log", ".toml", ".cfg", ".yml",
                 ".yaml", ".ini", ".csv", ""}

# Built from pieces so that this file does not match itself.
_NUM = r"#?[0-9]+\b"
HISTORY = re.compile(
    r"\b(" + "st" + "op|ro" + "und|is" + "sue) " + _NUM
    + r"|(first|second|third|[a-z]+th|this|last|next) " + "st" + r"op\b",
    flags=re.I)

_ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh "
             "twelfth thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth "
             "nineteenth twentieth thirtieth").split()
_TWENTY = "twenty-?(" + "|".join(_ORDINALS[:9]) + ")"
HISTORY_NAME = re.compile(
    r"(?<![a-z])(" + "|".join(_ORDINALS) + "|" + _TWENTY + r"|ro" + r"und-?[0-9]+|st" + r"op)"
    r"(?![a-z])", flags=re.I)


def _files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for p in sorted(path.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts:
                    yield p


def _text(path: Path) -> str | None:
    if path.suffix.lower() not in TEXT_SUFFIXES:
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def test_history_pattern_finds_what_it_should():
    for line in ["see " + "st" + "op 29", "the twenty-ninth " + "st" + "op",
                 "Ro" + "und 4: ...", "is" + "sue #31", "at this " + "st" + "op"]:
        assert HISTORY.search(line), line
    for line in ["--rounds 3", "the last step", "a stop-gap", "round(x, 3)"]:
        assert not HISTORY.search(line), line
    assert HISTORY_NAME.search("programs_twenty" + "ninth.json")
    assert HISTORY_NAME.search("kernel_throughput_ro" + "und3.json")
    assert not HISTORY_NAME.search("programs_2026-12-06.json")
    assert not HISTORY_NAME.search("compile_time_5rounds.json")


def test_no_development_history_in_files():
    hits = []
    for path in _files():
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


def test_results_named_for_what_and_when():
    named = [p.name for p in (ROOT / "benchmarks" / "results").iterdir()
             if HISTORY_NAME.search(p.name)]
    assert not named, named

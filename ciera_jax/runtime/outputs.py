"""Output paths checked before any work: a command that would write a file at the end fails at
the start, in one line, when it could not."""

from __future__ import annotations

import tempfile
from pathlib import Path


def check_output_file(path: str, flag: str) -> None:
    """ValueError in one line unless ``path`` can be written as a file: it is not a folder, its
    folder exists and takes a new file (or the file exists and opens for writing). Nothing is
    left behind; an existing file is not changed."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory; pass a file path")
    folder = p.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    try:
        if p.exists():
            with open(p, "ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as e:
        raise ValueError(f"{flag} {path} is not writable ({e.strerror}); pass a path you can "
                         "write to") from None

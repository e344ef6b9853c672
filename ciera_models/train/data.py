"""Token data: a built-in byte-level corpus, user token files, deterministic batches.

Built-in corpus: the Python standard library's ``.py`` sources (on every machine with Python),
files in sorted order, concatenated as raw bytes (token = byte, vocab 256) up to a fixed cap,
cached on disk at ``~/.cache/ciera_jax/`` (override with ``CIERA_CACHE_DIR``). The last
``VAL_FRACTION`` of it is the validation split.

User data: a flat binary of ``uint16`` (default; ``.u32``/``.uint32`` suffix or
``dtype="uint32"`` for uint32) token ids, memory-mapped.

Batches are a pure function of ``(seed, position)``: batch ``i`` draws its window offsets from
``np.random.default_rng([seed, i])``, so resuming at position ``i`` replays the same stream.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

CORPUS_CAP_BYTES = 4 << 20
VAL_FRACTION = 0.05
TOKEN_DTYPES = ("uint16", "uint32")


def cache_dir() -> Path:
    return Path(os.environ.get("CIERA_CACHE_DIR", Path.home() / ".cache" / "ciera_jax"))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "__pycache__")
    return sorted(p for p in root.rglob("*.py")
                  if p.is_file() and not any(s in p.parts for s in skip))


def build_stdlib_corpus(cap: int = CORPUS_CAP_BYTES) -> np.ndarray:
    """The concatenated stdlib sources (sorted by path relative to the stdlib root), capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for p in sorted(stdlib_files(), key=lambda p: p.relative_to(root).as_posix()):
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= cap:
            break
    return np.frombuffer(b"".join(chunks)[:cap], dtype=np.uint8).copy()


def stdlib_corpus(cap: int = CORPUS_CAP_BYTES) -> np.ndarray:
    """The built-in corpus as uint8 tokens, built at first use and cached on disk."""
    tag = f"py{sys.version_info[0]}.{sys.version_info[1]}-{cap}"
    path = cache_dir() / f"stdlib-bytes-{tag}.bin"
    if path.exists():
        return np.fromfile(path, dtype=np.uint8)
    data = build_stdlib_corpus(cap)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    data.tofile(tmp)
    os.replace(tmp, path)
    return data


def load_token_file(path: str | os.PathLike, dtype: str | None = None) -> np.ndarray:
    """Memory-map a flat binary token file (uint16 unless the suffix or ``dtype`` says uint32)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    if dtype is None:
        dtype = "uint32" if p.suffix.lower() in (".u32", ".uint32") else "uint16"
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token files are {' or '.join(TOKEN_DTYPES)}, got {dtype!r}")
    if p.stat().st_size == 0:
        raise ValueError(f"data file {p} is empty; pass a flat binary of {dtype} token ids")
    if p.stat().st_size % np.dtype(dtype).itemsize:
        raise ValueError(f"{p}: size {p.stat().st_size} is not a multiple of {dtype}")
    return np.memmap(p, dtype=dtype, mode="r")


@dataclasses.dataclass
class Dataset:
    train: np.ndarray
    val: np.ndarray
    name: str

    def batch(self, seed: int, position: int, batch_size: int, seq_len: int,
              split: str = "train") -> np.ndarray:
        """Batch number ``position``: ``[batch_size, seq_len + 1]`` int32 windows."""
        data = self.train if split == "train" else self.val
        rng = np.random.default_rng([seed, position, 0 if split == "train" else 1])
        offs = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        return np.stack([np.asarray(data[o:o + seq_len + 1]) for o in offs]).astype(np.int32)


def load_dataset(path: str | None, vocab_size: int, seq_len: int, dtype: str | None = None) -> Dataset:
    """The built-in corpus (``path`` None) or a user token file, split train/validation."""
    if path is None:
        if vocab_size < 256:
            raise ValueError(f"the byte-level corpus needs vocab_size >= 256, config has {vocab_size}")
        tokens, name = stdlib_corpus(), "stdlib-bytes"
    else:
        tokens, name = load_token_file(path, dtype), str(path)
        top = int(tokens.max()) if len(tokens) else 0
        if top >= vocab_size:
            raise ValueError(f"{path}: token id {top} >= the config's vocab_size {vocab_size}")
    n_val = max(seq_len + 2, int(len(tokens) * VAL_FRACTION))
    if len(tokens) - n_val < seq_len + 2:
        raise ValueError(f"{name}: {len(tokens)} tokens is too few for seq_len {seq_len}")
    return Dataset(tokens[:-n_val], tokens[-n_val:], name)

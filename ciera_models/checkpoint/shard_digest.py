"""Per-shard SHA-256 digests of a checkpoint's arrays, hashed off the step's critical path.

A save copies the shards this process holds to host memory (the step donates the device
buffers, so the copy is the one blocking part), and orbax's background commit hashes them in a
few threads and writes ``digests/process_<i>.json``. Each process hashes only its own shards
(the one copy of each, ``replica_id == 0``), so the hashing involves no other process and no
device: it is safe in a thread while the next steps run. The files are written inside orbax's
temporary step folder, so a save interrupted before every process's hashes are written leaves
no checkpoint at all.

A restore reads every process's file, checks that together they cover every array exactly once,
and hashes each recorded shard where it now lies. On the same layout that is one shard per
device; on another device count a recorded shard is cut from the shards that hold it, by the
first process that holds all of it (shards that no one process holds whole are counted and
left unverified).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

Index = tuple[tuple[int, int], ...]  # a shard's [start, stop) per axis


class Damaged(Exception):
    """One checkpoint is unusable; the message says what is wrong with it."""


def workers() -> int:
    """Hashing threads (hashlib releases the GIL on large buffers)."""
    return max(1, min(8, os.cpu_count() or 1))


def leaf_name(path) -> str:
    """``params/blocks/0/w``: a leaf's path, readable."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def named_leaves(tree) -> list[tuple[str, object]]:
    return [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _index(index, shape) -> Index:
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def _whole(shape) -> Index:
    return tuple((0, n) for n in shape)


def _volume(ix: Index) -> int:
    return math.prod(max(0, b - a) for a, b in ix)


def _overlap(s: Index, d: Index) -> Index:
    return tuple((max(a, c), min(b, e)) for (a, b), (c, e) in zip(s, d))


def sha256(a: np.ndarray) -> str:
    return hashlib.sha256(_raw(a)).hexdigest()


def _raw(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes, as a flat uint8 view (a copy only where ``a`` is not contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def show(ix: Index) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in ix) + "]"


@dataclasses.dataclass
class Snapshot:
    """Host copies of the shards this process hashes: ``(name, index, array)``."""

    process: int
    leaves: dict[str, dict]  # name -> {"shape", "dtype"}
    shards: list[tuple[str, Index, np.ndarray]]


def take(tree) -> Snapshot:
    """Copy this process's shards of ``tree`` to host memory (every transfer started first)."""
    me = jax.process_index()
    picked = []
    for name, x in named_leaves(tree):
        if isinstance(x, jax.Array):
            own = [s for s in x.addressable_shards if s.replica_id == 0]
            for s in own:
                s.data.copy_to_host_async()
            picked += [(name, x, s) for s in own]
        elif me == 0:
            picked.append((name, np.asarray(x), None))
    leaves, shards = {}, []
    for name, x, s in picked:
        leaves[name] = {"shape": list(x.shape), "dtype": str(x.dtype)}
        if s is None:
            shards.append((name, _whole(x.shape), np.array(x)))
            continue
        host = np.asarray(s.data)
        if s.device.platform == "cpu":  # a view of the device buffer, which the step donates
            host = host.copy()
        shards.append((name, _index(s.index, x.shape), host))
    return Snapshot(me, leaves, shards)


def record(snap: Snapshot) -> dict:
    """Hash the snapshot's shards (dropping each copy once hashed): this process's file."""
    keys = [(name, ix) for name, ix, _ in snap.shards]
    arrays = [a for _, _, a in snap.shards]
    snap.shards = []

    def digest(i: int) -> str:
        a, arrays[i] = arrays[i], None  # the copy goes as soon as it is hashed
        return sha256(a)

    with concurrent.futures.ThreadPoolExecutor(workers()) as pool:
        digests = list(pool.map(digest, range(len(arrays))))
    leaves = {name: {**info, "shards": []} for name, info in snap.leaves.items()}
    for (name, ix), d in zip(keys, digests):
        leaves[name]["shards"].append([[list(p) for p in ix], d])
    body = {"process": snap.process, "leaves": leaves}
    return {**body, "sha256": _body_sha(body)}


def _body_sha(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def file_name(process: int) -> str:
    return f"process_{process}.json"


# ---- the orbax item: hashed and written in the background commit --------------------------

class DigestHandler(ocp.AsyncCheckpointHandler):
    """The ``digests`` item of a step: this process's file, written by orbax's commit thread."""

    async def async_save(self, directory, args: "DigestSave"):
        return [ocp.future.CommitFutureAwaitingContractedSignals(
            self._write(directory, args.snapshot), name="ciera_shard_digests")]

    async def _write(self, directory, snap: Snapshot) -> None:
        self._write_now(directory, snap)

    def _write_now(self, directory, snap: Snapshot) -> None:
        (directory / file_name(snap.process)).write_text(json.dumps(record(snap)))

    def save(self, directory, args: "DigestSave"):
        self._write_now(directory, args.snapshot)

    def restore(self, directory, args=None):
        return read_manifest(directory, None)


@ocp.args.register_with_handler(DigestHandler, for_save=True)
@dataclasses.dataclass
class DigestSave(ocp.args.CheckpointArgs):
    snapshot: Snapshot


@ocp.args.register_with_handler(DigestHandler, for_restore=True)
@dataclasses.dataclass
class DigestRestore(ocp.args.CheckpointArgs):
    """Orbax asks for one; restores read the files with :func:`read_manifest` instead."""


# ---- restore: the files together, then each shard where it lies ---------------------------

def read_manifest(directory, processes: int | None) -> dict[str, dict]:
    """Every process's file, checked and combined: ``{name: {"shape", "dtype", "shards":
    {index: (sha256, process)}}}``. :class:`Damaged` if a file is missing, garbled or does
    not match its own digest, or if together they do not cover every array exactly once."""
    from pathlib import Path

    directory = Path(str(directory))
    if processes is None:
        processes = len(list(directory.glob("process_*.json")))
    leaves: dict[str, dict] = {}
    for p in range(processes):
        path = directory / file_name(p)
        try:
            got = json.loads(path.read_text())
            body = {"process": got["process"], "leaves": got["leaves"]}
            ok = got["sha256"] == _body_sha(body) and got["process"] == p
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = "missing" if isinstance(e, FileNotFoundError) else "unreadable"
            raise Damaged(f"its shard digests of process {p} are {why} "
                          f"(digests/{file_name(p)})") from None
        if not ok:
            raise Damaged(f"its shard digests of process {p} do not match their own digest "
                          f"(digests/{file_name(p)})")
        for name, info in got["leaves"].items():
            leaf = leaves.setdefault(name, {"shape": tuple(info["shape"]),
                                            "dtype": info["dtype"], "shards": {}})
            if (leaf["shape"], leaf["dtype"]) != (tuple(info["shape"]), info["dtype"]):
                raise Damaged(f"its shard digests disagree on the shape of {name}")
            for ix, d in info["shards"]:
                leaf["shards"][tuple(tuple(p_) for p_ in ix)] = (d, p)
    for name, leaf in leaves.items():
        if sum(_volume(ix) for ix in leaf["shards"]) != math.prod(leaf["shape"]):
            raise Damaged(f"its shard digests do not cover {name} exactly once")
    return leaves


def _layout(x) -> dict[int, set[Index]]:
    """Which slices of ``x`` each process holds (every process, not just this one)."""
    if not isinstance(x, jax.Array):
        return {0: {_whole(x.shape)}}
    held: dict[int, set[Index]] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        held.setdefault(device.process_index, set()).add(_index(index, x.shape))
    return held


def _owner(ix: Index, held: dict[int, set[Index]]) -> int | None:
    """The first process that holds all of slice ``ix`` (its slices do not overlap)."""
    exact = [p for p, slices in held.items() if ix in slices]
    if exact:
        return min(exact)
    need = _volume(ix)
    for p in sorted(held):
        if sum(_volume(_overlap(ix, d)) for d in held[p]) == need:
            return p
    return None


def _cut(x, ix: Index) -> np.ndarray:
    """Slice ``ix`` of ``x`` from this process's shards (one shard when it matches one)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)[tuple(slice(a, b) for a, b in ix)]
    shards = {}
    for s in x.addressable_shards:
        shards.setdefault(_index(s.index, x.shape), s)
    if ix in shards:
        return np.asarray(shards[ix].data)
    out = np.empty([b - a for a, b in ix], dtype=x.dtype)
    for d, s in shards.items():
        o = _overlap(ix, d)
        if _volume(o):
            out[tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(o, ix))] = np.asarray(
                s.data)[tuple(slice(a - d0, b - d0) for (a, b), (d0, _) in zip(o, d))]
    return out


def verify(tree, manifest: dict[str, dict]) -> tuple[int, int]:
    """Hash each recorded shard of ``tree`` that this process holds whole (the first such
    process does). Returns ``(shards, unverified)``: all the recorded shards, and those no
    process holds whole on this layout. :class:`Damaged`, naming the shard, on a mismatch."""
    me = jax.process_index()
    named = named_leaves(tree)
    missing = sorted(set(manifest) ^ {n for n, _ in named})
    if missing:
        raise Damaged(f"its shard digests and its arrays disagree on {missing[0]}"
                      + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    jobs, total, unverified = [], 0, 0
    for name, x in named:
        leaf = manifest[name]
        if (tuple(x.shape), str(x.dtype)) != (leaf["shape"], leaf["dtype"]):
            raise Damaged(f"its digests record {name} as {leaf['dtype']}{list(leaf['shape'])}, "
                          f"its arrays hold {x.dtype}{list(x.shape)}")
        held = _layout(x)
        for ix, (digest, saved_by) in leaf["shards"].items():
            total += 1
            owner = _owner(ix, held)
            if owner is None:
                unverified += 1
            elif owner == me:
                jobs.append((name, x, ix, digest, saved_by))

    def check(job):
        name, x, ix, digest, saved_by = job
        return None if sha256(_cut(x, ix)) == digest else job

    with concurrent.futures.ThreadPoolExecutor(workers()) as pool:
        bad = [job for job in pool.map(check, jobs) if job is not None]
    if bad:
        name, x, ix, _, saved_by = bad[0]
        # its bytes, not its values: a damaged float shard may hold NaNs
        zeros = " (it reads as all zeros)" if not _raw(_cut(x, ix)).any() else ""
        more = f" (and {len(bad) - 1} more shard(s))" if len(bad) > 1 else ""
        raise Damaged(f"its shard {show(ix)} of {name}, saved by process {saved_by}, does not "
                      f"match its digest{zeros}{more}")
    return total, unverified

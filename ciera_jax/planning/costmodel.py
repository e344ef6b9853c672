"""The cost formulas, in one place: the planner, the simulator and calibration all read them.

A gather moves ``wire`` bytes (the full gathered tensor as it travels) over a ring of ``N``
ranks. Every method is described by two numbers per tensor, its wire bytes and its codec
seconds; the time is the collective's time on the link plus the codec time:

    t_plain  = (N-1)*alpha + (N-1)/N * n*b / beta
    t_ciera  = (N-1)*alpha + (N-1)/N * (n*payload + escape sections) / beta + codec
               + agreement share
    t_int8   = (N-1)*alpha + (N-1)/N * n*(1 + 4/256) / beta + (de)quantize at HBM rate
    t_entropy= (N-1)*alpha + (N-1)/N * n*b/1.5 / beta + encode + decode at entropy-codec rate
    t_word   = (N-1)*alpha + (N-1)/N * n*word_bytes_per_weight / beta + word codec

and every one of them + host faults (:func:`host_fault_time` of ``n*b``) + the host's copies
beyond its last-level cache (:func:`host_spill_time`); both 0 on GPU profiles.

Wire bytes are what the gathers send (``sent_bytes`` in their stats, tested equal): the rungs of
:mod:`ciera_jax.codec.wire` for both CIERA modes, int8 codes in whole blocks plus one float32 scale per
block (as ``quantized.py`` sends). Word mode gathers once per step (the backward reads the
cache); every other method gathers twice.

Codec time on a GPU profile (``codec_pricing="compiled"``) is the compiled program's: the
kernels and bytes of one gather as XLA:GPU compiles it, scaled to the tensor
(:mod:`ciera_jax.planning.codec_costs`, a recorded table with its source), at its roofline or
calibrated by a GPU measurement (``codec_calibration``); the plain gather pays its own device
kernels the same way. A profile with ``codec_pricing="counted"`` counts the bytes each pass
reads and writes per element instead (:data:`CODEC_PASS_BYTES`: the sender's encode over its
shard, the receiver's decode and self-check over the full tensor) at
:data:`CODEC_HBM_FRACTION` of the device's memory bandwidth, plus a launch cost per gather. A
calibrated profile (``codec_pricing="measured"``)
prices what was measured where it is slower than the counted bytes: on a CPU the codec is
bound by its ops, not its bytes (many times its counted time; ``docs/results.md``, section 6,
"Real-socket crossovers"). Its dense passes then run at the measured end-to-end rate of each mode
(``codec_Bps``, ``word_codec_Bps``), and each escaped exponent costs ``escape_s`` more (the
sender's pack and every receiver's fill walk the escapes one by one).

A host's gather also pays for fresh memory (``fault_Bps``, 0 on GPUs, whose buffers come from
XLA's pool): on a CPU, glibc maps blocks above its mmap threshold fresh on every call and the
first touch of each page faults, so a gather of ``B`` full bytes faults in about
``fresh_per_byte * (B - fresh_from_bytes)`` bytes (the output and a staging copy above glibc's
mmap threshold, little below it; counted with ``getrusage``) at ``fault_Bps``. It is why a
gather's effective bandwidth falls with its size over sockets (``docs/results.md``, section 6,
"Real-socket crossovers"). Every method pays it on the size of the full tensor it returns.

A host's gather also slows once its working set leaves the last-level cache (``spill_Bps``, 0
on GPUs): the ranks time-sharing one core each copy the full tensor through the sockets, a
working set of ``W = B * max(1, N / host_cores)`` for a gather of ``B`` full bytes on ``N``
ranks over ``host_cores`` cores. Copies that sweep more than the cache in a cycle miss on every
line (LRU), so above ``llc_bytes`` all ``W`` bytes (:func:`spill_bytes`) run from memory at
``spill_Bps``, on top of the link's line (plain gathers with no fresh memory slow far more
than their bytes once the working set leaves the cache; ``docs/results.md``, section 6,
"Real-socket crossovers"). Both host rates are as loaded as the host they were calibrated on.

``n`` is the element count of the FULL tensor, ``b`` its bytes per element. The link is a
:class:`Profile` (one flat ring) or a :class:`Topology` (NVLink ring inside a node, then a
ring across nodes: the standard two-level all-gather).
"""

from __future__ import annotations

import dataclasses
import math

from ciera_jax.planning import codec_costs
from ciera_jax.planning.links import Link, Profile, Topology
from ciera_jax.codec.wire import (CHECKSUM_BYTES, DEFAULT_CODE_BITS, ExponentWire, WordWire,
                                  int8_wire_bytes)
# Memory traffic of each codec pass per element of bf16 (b = 2 bytes a word), counted from
# what it reads and writes; escapes and flags are small and counted at their steady-state size.
#   exponent encode (shard): read word 2 + cached exponent 1; write payload 1 + flags 1/8
#   exponent decode (full):  read payload 1 + cached exponent 1 + flags 1/8; write word 2 +
#                            new cache 1; the self-check re-reads nothing (same pass)
#   word encode (shard):     read word 2 + cached word 2; write codes b/8 (3-bit: 3/8)
#   word decode (full):      read codes 3/8 + cached word 2; write word 2 + new cache 2
CODEC_PASS_BYTES = {"ciera": (3 + 1 + 1 / 8, 2 + 1 / 8 + 3),
                    "payload": (2 + 1, 1 + 1 + 2),  # split the shard; merge with the cache
                    "word": (4 + DEFAULT_CODE_BITS / 8, DEFAULT_CODE_BITS / 8 + 6)}
CODEC_HBM_FRACTION = 0.8  # of peak bandwidth: a streaming elementwise kernel (gpu_check measures it)
ENTROPY_RATIO = 1.5  # single-pass lossless entropy coding of bf16 (ZipNN / DietGPU class)

# "ciera": exponent mode; "payload": its backward's second gather, sign + mantissa only (the
# exponents are the ones its forward left in the cache)
METHODS = ("plain", "int8", "entropy", "ciera", "word", "payload")


# ----------------------------------------------------------------------------- collectives

def ring_allgather_time(wire_bytes: float, N: int, alpha_s: float, beta_Bps: float) -> float:
    """Ring all-gather of a tensor that is ``wire_bytes`` in full: N-1 hops, each rank
    receives (N-1)/N of it. A ring reduce-scatter moves the same bytes and costs the same."""
    if N <= 1:
        return 0.0
    return (N - 1) * alpha_s + (N - 1) / N * wire_bytes / beta_Bps


def hierarchical_allgather_time(wire_bytes: float, N: int, gpus_per_node: int,
                                intra: Profile, inter: Profile) -> float:
    """Two-level all-gather: a ring across nodes among GPUs of equal local rank (each moves
    1/gpus_per_node of the tensor on its own NIC), then a ring inside each node over NVLink
    of the full tensor. Single node: just the NVLink ring."""
    G = min(gpus_per_node, N)
    M = math.ceil(N / G)
    t = ring_allgather_time(wire_bytes, G, intra.alpha_s, intra.beta_Bps)
    if M > 1:
        t += ring_allgather_time(wire_bytes / G, M, inter.alpha_s, inter.beta_Bps)
    return t


def gather_time(wire_bytes: float, N: int, link: Link) -> float:
    """All-gather (or reduce-scatter) time on a flat ring (Profile) or two levels (Topology)."""
    if isinstance(link, Topology):
        return hierarchical_allgather_time(wire_bytes, N, link.gpus_per_node, link.intra, link.inter)
    return ring_allgather_time(wire_bytes, N, link.alpha_s, link.beta_Bps)


reduce_scatter_time = gather_time


def agreement_time(N: int, link: Link) -> float:
    if N <= 1:
        return 0.0
    return link.agreement(N) if isinstance(link, Topology) else link.agreement_s


# ----------------------------------------------------------------------------- host memory

def fresh_bytes(full_bytes: float, link) -> float:
    """Bytes of freshly mapped host memory one gather returning ``full_bytes`` touches."""
    return max(0.0, link.fresh_per_byte * (full_bytes - link.fresh_from_bytes))


def host_fault_time(full_bytes: float, link) -> float:
    """Seconds one gather returning ``full_bytes`` spends faulting in fresh host memory (0
    where the profile has no fault rate: a GPU's pooled buffers)."""
    if not link.fault_Bps:
        return 0.0
    return fresh_bytes(full_bytes, link) / link.fault_Bps


def spill_bytes(full_bytes: float, N: int, link) -> float:
    """Bytes a gather copies from memory, not its host's last-level cache: its working set,
    the full tensor once per rank time-sharing a core (``N / host_cores``, at least 1), all of
    it once it exceeds the cache (a cyclic sweep larger than an LRU cache misses every line),
    none below; 0 where the profile names no cache or cores."""
    if not link.llc_bytes or not link.host_cores:
        return 0.0
    ws = full_bytes * max(1.0, N / link.host_cores)
    return ws if ws > link.llc_bytes else 0.0


def host_spill_time(full_bytes: float, N: int, link) -> float:
    """Seconds one gather returning ``full_bytes`` on ``N`` ranks spends copying its bytes
    beyond the last-level cache (0 where the profile has no spill rate: GPU profiles)."""
    if not link.spill_Bps:
        return 0.0
    return spill_bytes(full_bytes, N, link) / link.spill_Bps


# ----------------------------------------------------------------------------- codec

def expected_change_count(n_local: int, change_rate: float) -> int:
    """Changed exponents in one shard per step (the agreed max is rounded up to a rung)."""
    return math.ceil(max(change_rate, 0.0) * n_local)


def codec_time(method: str, n: int, N: int, bytes_per_elem: int, link,
               escapes: int = 0) -> float:
    """Encode of one shard + decode of the full tensor, from the bytes each pass moves (scaled
    by the word width: float32 moves twice bf16's bytes) at a fraction of HBM bandwidth.

    With measured pricing the dense passes take the longer of that and the mode's measured
    rate, and ``escapes`` (escaped elements of the full tensor) cost ``escape_s`` each."""
    if link.codec_pricing == "compiled":
        return compiled_codec(method, n * bytes_per_elem, N, link).seconds
    enc, dec = CODEC_PASS_BYTES[method]
    scale = bytes_per_elem / 2
    moved = scale * (enc * n / max(N, 1) + dec * n)
    t = moved / (link.hbm_Bps * CODEC_HBM_FRACTION)
    if link.codec_pricing == "measured":
        rate = measured_codec_Bps(method, link)
        if rate:
            t = max(t, n * bytes_per_elem / rate)
        t += escapes * link.escape_s
    elif link.codec_pricing != "counted":
        raise ValueError(f"codec_pricing {link.codec_pricing!r}: use 'compiled', 'counted' or "
                         "'measured'")
    return t + link.codec_launch_s


def compiled_codec(method: str, n_bytes: float, N: int, link) -> codec_costs.CodecCost:
    """The compiled program's device seconds of ``method`` on ``n_bytes`` (compiled pricing)."""
    if not link.gpu:
        raise ValueError("a profile with codec_pricing 'compiled' names its GPU (gpu=)")
    return codec_costs.codec_cost(method, n_bytes, link.gpu, N, link.codec_calibration)


def codec_source(link) -> str:
    """Where ``link``'s codec term comes from, in words."""
    if link.codec_pricing == "compiled":
        return codec_costs.source(link.gpu, link.codec_calibration)
    if link.codec_pricing == "measured":
        return "codec: measured by ciera calibrate (this profile's rates)"
    return "codec: bytes counted per pass at a fraction of HBM bandwidth, not measured"


def measured_codec_Bps(method: str, link) -> float | None:
    """The calibrated end-to-end rate of ``method``'s codec (exponent mode: ``codec_Bps``, word
    mode: ``word_codec_Bps``); None where nothing was measured for it."""
    return {"ciera": link.codec_Bps, "word": link.word_codec_Bps}.get(method)


# ----------------------------------------------------------------------------- methods

@dataclasses.dataclass(frozen=True)
class GatherCost:
    """One method on one tensor: bytes on the wire (full tensor), codec seconds on the device,
    whether CIERA fell back to plain, the patch capacity it used, and the seconds its host
    spends faulting in fresh memory for the result (:func:`host_fault_time`) and copying beyond
    its last-level cache (:func:`host_spill_time`)."""

    method: str
    wire_bytes: float
    codec_s: float
    fallback: bool = False
    patch_capacity: int = 0
    host_s: float = 0.0
    spill_s: float = 0.0


def gather_cost(method: str, n: int, N: int, bytes_per_elem: int, link: Link,
                change_rate: float = 0.0, *, word_bpw: float | None = None,
                word_rates: tuple[float, float] | None = None) -> GatherCost:
    """Wire bytes, codec time and host fault time of ``method`` for a tensor of ``n`` elements
    on ``N`` ranks (:func:`_wire_and_codec`; every method returns the full tensor, so every one
    pays :func:`host_fault_time` and :func:`host_spill_time` on ``n * bytes_per_elem``)."""
    c = _wire_and_codec(method, n, N, bytes_per_elem, link, change_rate, word_bpw=word_bpw,
                        word_rates=word_rates)
    full = n * bytes_per_elem
    return dataclasses.replace(c, host_s=host_fault_time(full, link),
                               spill_s=host_spill_time(full, N, link))


def _wire_and_codec(method: str, n: int, N: int, bytes_per_elem: int, link: Link,
                    change_rate: float = 0.0, *, word_bpw: float | None = None,
                    word_rates: tuple[float, float] | None = None) -> GatherCost:
    """Wire bytes and codec time of ``method`` for a tensor of ``n`` elements on ``N`` ranks.

    ``ciera`` (exponent mode) takes its rung from ``change_rate``;
    ``word`` takes either a measured ``word_bpw`` (bytes per weight, a trace's figure for a
    phase, fallbacks included) or ``word_rates``: the shares of elements that escape the code
    and that travel raw, priced exactly as :class:`ciera_jax.codec.wire.WordWire` sends them.
    """
    b = bytes_per_elem
    n_local = math.ceil(n / max(N, 1))
    if method == "plain":  # its own device kernels, where the compiled program prices them
        return GatherCost("plain", n * b, (codec_time("plain", n, N, b, link)
                                           if link.codec_pricing == "compiled" and N > 1
                                           else 0.0))
    if method == "payload":
        return GatherCost("payload", n * (b - 1), codec_time("payload", n, N, b, link))
    if method == "int8":
        wire_per_elem = int8_wire_bytes(n_local) / max(n_local, 1)
        # quantize the local shard (read b, write ~1), dequantize the full tensor (read ~1, write b)
        q = (n / N) * (b + wire_per_elem) / link.hbm_Bps
        dq = n * (wire_per_elem + b) / link.hbm_Bps
        return GatherCost("int8", N * int8_wire_bytes(n_local), q + dq + link.codec_launch_s)
    if method == "entropy":
        enc = (n / N) * b / link.entropy_Bps
        dec = n * b / link.entropy_Bps
        return GatherCost("entropy", n * b / ENTROPY_RATIO, enc + dec + link.codec_launch_s)
    if method == "ciera":
        wire = ExponentWire(n_local, b)
        changed = expected_change_count(n_local, change_rate)
        fallback = changed > wire.caps[-1]
        cap = 0 if fallback else next(c for c in wire.caps if c >= changed)
        # a fallback gathers plain bits: no escapes walked
        escapes = 0 if fallback else N * changed
        return GatherCost("ciera", N * wire.sent_bytes(changed),
                          codec_time("ciera", n, N, b, link, escapes), fallback=fallback,
                          patch_capacity=cap)
    if method == "word":
        codec = codec_time("word", n, N, b, link)
        if word_rates is not None:
            escape_rate, raw_rate = word_rates
            wire = WordWire(n_local, b)
            escapes, raw = math.ceil(escape_rate * n_local), math.ceil(raw_rate * n_local)
            fallback = escapes > wire.caps1[-1] or raw > wire.caps2[-1]
            return GatherCost("word", N * wire.sent_bytes(escapes, raw), codec,
                              fallback=fallback)
        if word_bpw is None or word_bpw <= 0:
            raise ValueError("word mode is priced from escape rates (word_rates=) or a measured "
                             f"bytes-per-weight (word_bpw= > 0), got word_bpw={word_bpw!r}")
        return GatherCost("word", n * word_bpw + N * CHECKSUM_BYTES, codec)
    raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")


def _time(c: GatherCost, N: int, link: Link) -> float:
    return gather_time(c.wire_bytes, N, link) + c.codec_s + c.host_s + c.spill_s


def t_plain(n: int, N: int, bytes_per_elem: int, p: Link) -> float:
    return _time(gather_cost("plain", n, N, bytes_per_elem, p), N, p)


def t_ciera(n: int, N: int, payload_bytes_per_elem: int, change_rate: float, p: Link,
            agreement_share_s: float | None = None) -> float:
    """Compressed gather: payload + rung-rounded escape sections + codec + agreement share.
    Above the top rung it is the plain gather (the implementation's fallback) plus the
    agreement share."""
    share = agreement_time(N, p) if agreement_share_s is None else agreement_share_s
    c = gather_cost("ciera", n, N, payload_bytes_per_elem + 1, p, change_rate)
    return _time(c, N, p) + share


def t_payload(n: int, N: int, bytes_per_elem: int, p: Link) -> float:
    """An exponent-cache tensor's backward gather: its payload bytes, merged with the
    exponents its forward gather left in the cache (no escapes, no agreement)."""
    return _time(gather_cost("payload", n, N, bytes_per_elem, p), N, p)


def t_word(n: int, N: int, bytes_per_elem: int, word_bpw: float, p: Link,
           agreement_share_s: float | None = None) -> float:
    """Word-mode gather (forward only: the backward reads the cache) + agreement share."""
    share = agreement_time(N, p) if agreement_share_s is None else agreement_share_s
    return _time(gather_cost("word", n, N, bytes_per_elem, p, word_bpw=word_bpw), N, p) + share

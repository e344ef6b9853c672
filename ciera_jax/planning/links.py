"""The links and devices a gather is priced on (:mod:`~ciera_jax.planning.costmodel`): a
:class:`Profile` (one link and one device, measured by ``ciera calibrate`` or a built-in JSON
in ``profiles/``) and a :class:`Topology` (NVLink hosts joined by a network)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Union

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclasses.dataclass
class Profile:
    """One link and one device: what a calibration run measures, or a documented default.

    alpha_s     latency per ring hop (s)
    beta_Bps    bytes/s per link per direction as a ring collective achieves it (bus bandwidth)
    codec_Bps   CIERA encode+decode rate a calibration measured, bytes of bf16 input per second
                (measured pricing only; None: not measured)
    agreement_s one tiny pmax over the mesh (s)
    hbm_Bps     achievable device-memory bandwidth (int8 quantize/dequantize run at this rate)
    entropy_Bps encode+decode rate of a single-pass entropy codec, bytes of input per second
    codec_launch_s fixed cost of the codec kernels (encode + decode launches) per gather
    memory_gb   device memory (GB, 1e9 bytes) the planner may fill; None: unlimited
    codec_pricing  "compiled": the compiled program's kernels and bytes for ``gpu``
                (:mod:`~ciera_jax.planning.codec_costs`; built-in GPU profiles); "counted": the
                codec's bytes per pass at a fraction of ``hbm_Bps``; "measured": a
                calibration's rates where they are slower
    gpu         the GPU target whose compiled codec prices this profile (compiled pricing)
    codec_calibration  compiled pricing at the "roofline" or scaled to a GPU "measured" time
    word_codec_Bps word mode's measured end-to-end codec rate at its steady-state escapes
                (bytes of bf16 full tensor per second); None: not measured
    escape_s    seconds per escaped exponent of the full tensor, beyond the dense passes
                (measured pricing only)
    fault_Bps   bytes/s at which the host faults in freshly mapped memory of a gather's
                buffers; 0: no such cost (GPU profiles)
    fresh_from_bytes, fresh_per_byte  the fresh bytes of one gather of ``B`` full bytes:
                ``fresh_per_byte * max(0, B - fresh_from_bytes)`` (:func:`fresh_bytes`)
    llc_bytes   the host's last-level cache (bytes, sysfs) the gathers' buffers compete for
    host_cores  cores the host's ranks share (their CPU affinity)
    spill_Bps   bytes/s at which a gather's working set is copied once it exceeds
                ``llc_bytes`` (:func:`spill_bytes`); 0: no such cost (GPU profiles)
    """

    name: str
    alpha_s: float
    beta_Bps: float
    agreement_s: float
    codec_Bps: float | None = None
    hbm_Bps: float = 3.0e12
    entropy_Bps: float = 4.0e11
    codec_launch_s: float = 5e-6
    memory_gb: float | None = None
    codec_pricing: str = "counted"
    word_codec_Bps: float | None = None
    escape_s: float = 0.0
    fault_Bps: float = 0.0
    fresh_from_bytes: float = 0.0
    fresh_per_byte: float = 0.0
    llc_bytes: float = 0.0
    host_cores: int = 0
    spill_Bps: float = 0.0
    gpu: str | None = None
    codec_calibration: str = "roofline"
    sources: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path_or_name: Union[str, Path]) -> "Profile":
        """A profile from a JSON file, or a built-in one by name (see :func:`builtin_profiles`)."""
        p = Path(path_or_name)
        if not p.suffix and not p.exists():
            p = PROFILE_DIR / f"{path_or_name}.json"
            if not p.exists():
                raise KeyError(f"unknown profile {str(path_or_name)!r}; built-in profiles: "
                               f"{', '.join(builtin_profiles())}, or a path to a JSON file")
        if not p.exists():
            raise FileNotFoundError(f"profile file not found: {p}")
        d = json.loads(p.read_text())
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = {"alpha_s", "beta_Bps", "agreement_s"} - set(d)
        if missing:
            raise ValueError(f"profile {p} lacks {', '.join(sorted(missing))}")
        d.setdefault("name", p.stem)
        return cls(**{k: v for k, v in d.items() if k in fields})

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def default_profile(platform: str, device_kind: str = "") -> str:
    """The built-in profile a run on ``platform`` prices its links with when none is named."""
    if platform == "cpu":
        return "cpu-emulated"
    return "h200-nvlink" if "h200" in device_kind.lower() else "h100-nvlink"


def get_profile(p: Union[str, Path, Profile]) -> Profile:
    return p if isinstance(p, Profile) else Profile.load(p)


def get_link(p: Union[str, Path, "Link"]) -> "Link":
    """A Profile or Topology as given, or a profile loaded by name or path."""
    return p if isinstance(p, (Profile, Topology)) else Profile.load(p)


def _from_intra(name: str) -> property:
    """A :class:`Topology` field read from its intra-node profile (a device-side rate)."""
    return property(lambda self: getattr(self.intra, name),
                    doc=f"The intra-node profile's ``{name}`` (the GPU's).")


@dataclasses.dataclass(frozen=True)
class Topology:
    """``gpus_per_node`` GPUs on NVLink (``intra``), nodes joined by ``inter`` (one NIC per GPU)."""

    intra: Profile
    inter: Profile
    gpus_per_node: int = 8

    # Device-side rates come from the GPU, i.e. the intra-node profile.
    codec_Bps = _from_intra("codec_Bps")
    hbm_Bps = _from_intra("hbm_Bps")
    entropy_Bps = _from_intra("entropy_Bps")
    codec_launch_s = _from_intra("codec_launch_s")
    memory_gb = _from_intra("memory_gb")
    codec_pricing = _from_intra("codec_pricing")
    word_codec_Bps = _from_intra("word_codec_Bps")
    escape_s = _from_intra("escape_s")
    fault_Bps = _from_intra("fault_Bps")
    fresh_from_bytes = _from_intra("fresh_from_bytes")
    fresh_per_byte = _from_intra("fresh_per_byte")
    llc_bytes = _from_intra("llc_bytes")
    host_cores = _from_intra("host_cores")
    spill_Bps = _from_intra("spill_Bps")
    gpu = _from_intra("gpu")
    codec_calibration = _from_intra("codec_calibration")

    def agreement(self, N: int) -> float:
        return self.intra.agreement_s if N <= self.gpus_per_node else self.inter.agreement_s


Link = Union[Profile, Topology]

"""Measure every profile value on the current devices, fit them, and say where each came from."""

from __future__ import annotations

import datetime
import platform
import types
from collections.abc import Sequence

import jax

from ciera_jax.planning import costmodel as cm
from ciera_jax.calibrate.defaults import (CPU_CODEC_SIZES, CPU_FAULT_SIZES, CPU_SIZES,
                                          GPU_CODEC_SIZES, GPU_SIZES, mesh_sizes_for)
from ciera_jax.calibrate import host as host_info
from ciera_jax.calibrate.fit import (fit_alpha_beta, fit_fresh_bytes, fit_link_and_host,
                                     fit_rate, with_spill)
from ciera_jax.calibrate.measure import (empty_call_s, measure_agreement, measure_ciera_overhead,
                                         measure_codec, measure_escape_cost, measure_hbm,
                                         measure_plain_gathers, measure_word_overhead)
from ciera_jax.runtime.devices import make_mesh
from ciera_jax.runtime.units import fmt_bytes, parse_size


ESCAPE_CHURN = 0.05  # exponent churn of the escape-cost measurement (word moves' steady state)


def base_profile(platform_name: str, device_kind: str) -> str:
    """The built-in profile whose unmeasured values (entropy rate) a calibration carries over."""
    if platform_name == "cpu":
        return "cpu-emulated"
    return "h200-nvlink" if "h200" in device_kind.lower() else "h100-nvlink"


def calibrate(mesh_sizes: Sequence[int] | None = None, sizes: Sequence | None = None,
              codec_sizes: Sequence | None = None, reps: int = 7, name: str | None = None,
              log=print, fault_sizes: Sequence | None = None):
    """Measure every profile value on the current devices; returns ``(Profile, details)``.

    ``sizes``, ``codec_sizes`` and ``fault_sizes`` are full-tensor bytes (``"4K"`` or ints;
    defaults per platform in :mod:`.defaults`; ``fault_sizes`` empty: no fault fit);
    ``mesh_sizes`` the sub-meshes to time gathers on.
    """
    devs = jax.devices()
    plat, kind = devs[0].platform, devs[0].device_kind
    on_cpu = plat == "cpu"
    if mesh_sizes is None:
        mesh_sizes = mesh_sizes_for(len(devs))
    mesh_sizes = sorted(set(int(n) for n in mesh_sizes))
    sizes = [parse_size(s) for s in (sizes or (CPU_SIZES if on_cpu else GPU_SIZES))]
    codec_sizes = [parse_size(s) for s in (codec_sizes or
                                           (CPU_CODEC_SIZES if on_cpu else GPU_CODEC_SIZES))]
    if fault_sizes is None:
        fault_sizes = CPU_FAULT_SIZES if on_cpu else ()
    fault_sizes = [parse_size(s) for s in fault_sizes]
    N_max = max(mesh_sizes) if mesh_sizes else 1
    date = datetime.date.today().isoformat()
    src = f"measured by ciera calibrate on {plat} {kind} {N_max} devices {date}"
    base = cm.Profile.load(base_profile(plat, kind))

    full_mesh = make_mesh(N_max)
    empty_s = min(empty_call_s(full_mesh), empty_call_s(full_mesh))
    log(f"calibrating on {len(devs)} {plat} device(s) ({kind}); meshes {mesh_sizes}; "
        f"empty call {empty_s * 1e6:.0f} us")
    sources = {}
    gather_recs, fault_recs = [], []
    fault_Bps = fresh_from = fresh_per = spill_Bps = 0.0
    # the host's cache and cores (CPU): what its ranks' gather buffers share
    host = types.SimpleNamespace(llc_bytes=host_info.llc_bytes() if on_cpu else 0,
                                 host_cores=host_info.host_cores() if on_cpu else 0)
    if N_max > 1 and sizes:
        gather_recs = with_spill(measure_plain_gathers([n for n in mesh_sizes if n > 1], sizes,
                                                       reps, log), host)
        alpha, beta = fit_alpha_beta(gather_recs)
        sources["alpha_s"] = (f"{src}: least-squares fit of plain bits all-gathers, "
                              f"N={mesh_sizes}, sizes={[fmt_bytes(s) for s in sizes]} "
                              "(includes the fixed cost of one call)")
        if fault_sizes:
            fault_recs = with_spill(measure_plain_gathers([N_max], fault_sizes, reps, log), host)
            alpha, beta, fault_Bps, spill_Bps = fit_link_and_host(gather_recs + fault_recs)
            full = [r for r in gather_recs + fault_recs if r["N"] == N_max]
            fresh_from, fresh_per = fit_fresh_bytes([r["n_bytes"] for r in full],
                                                    [r["fresh_bytes"] for r in full])
            sources["alpha_s"] += (f", through those that neither faulted nor spilled beyond "
                                   f"the cache of these and N={N_max} gathers of "
                                   f"{[fmt_bytes(s) for s in fault_sizes]}")
        sources["beta_Bps"] = sources["alpha_s"]
    else:
        alpha, beta = base.alpha_s, base.beta_Bps
        why = "one device: no gather to time"
        sources["alpha_s"] = sources["beta_Bps"] = f"not measured ({why}); from {base.name}"
    codec_rows = measure_codec(full_mesh, codec_sizes, reps, log)
    kernel_Bps, icpt = fit_rate([r["n_bytes"] for r in codec_rows],
                                [r["seconds"] for r in codec_rows])
    kernel_launch_s = max(icpt - empty_s, 1e-6)
    kernel_src = (f"kernels alone (encode(shard)+decode(full) on every rank at once, slope over "
                  f"{[fmt_bytes(s) for s in codec_sizes]}): {kernel_Bps / 1e9:.3g} GB/s, launch "
                  f"{kernel_launch_s * 1e6:.0f} us")
    if N_max > 1:
        agreement = measure_agreement(full_mesh, reps * 2, empty_s)
        sources["agreement_s"] = f"{src}: pmax of an int32 vector (64 counts), less one empty call"
        e2e_rows = measure_ciera_overhead(full_mesh, codec_sizes, reps, alpha, beta, agreement,
                                          log)
        codec_Bps, icpt = fit_rate([r["n_bytes"] for r in e2e_rows],
                                   [r["extra_s"] for r in e2e_rows])
        launch_s = max(icpt, 1e-6)
        sources["codec_Bps"] = (
            f"{src}: end to end, CIERA gathers at churn 0 of {[fmt_bytes(s) for s in codec_sizes]}"
            " less their modelled wire time and agreement, slope vs bytes (everything the "
            f"compressed path adds: encode, patch compaction, decode); {kernel_src}")
        sources["codec_launch_s"] = f"{src}: intercept of that line"
        big = max(e2e_rows, key=lambda r: r["n_bytes"])
        esc_row = measure_escape_cost(full_mesh, big["n_bytes"], ESCAPE_CHURN, reps, alpha,
                                      beta, agreement, big["extra_s"], log)
        escape_s = esc_row["escape_s"]
        sources["escape_s"] = (f"{src}: exponent-mode gathers of {fmt_bytes(big['n_bytes'])} "
                               f"at {ESCAPE_CHURN:.0%} churn less the same at 0%, per escaped "
                               "exponent of the full tensor")
        word_rows = measure_word_overhead(full_mesh, codec_sizes, reps, alpha, beta, agreement,
                                          log)
        word_Bps, _ = fit_rate([r["n_bytes"] for r in word_rows],
                               [r["extra_s"] for r in word_rows])
        sources["word_codec_Bps"] = (
            f"{src}: end to end, word-mode gathers of steady-state word moves (escapes "
            f"included) of {[fmt_bytes(s) for s in codec_sizes]} less their modelled wire "
            "time and agreement, slope vs bytes")
    else:
        agreement, e2e_rows = 0.0, []
        esc_row, escape_s, word_rows, word_Bps = None, 0.0, [], None
        codec_Bps, launch_s = kernel_Bps, kernel_launch_s
        sources["agreement_s"] = "one device: no agreement collective"
        sources["codec_Bps"] = f"{src}: {kernel_src}"
        sources["codec_launch_s"] = f"{src}: intercept of that line less one empty call"
    if fault_recs:
        sources["fault_Bps"] = (
            f"{src}: least squares of t - ring(alpha, beta) = fresh_bytes/fault_Bps + "
            "spill_bytes/spill_Bps over the plain gathers above, fresh_bytes each gather's "
            "minor page faults x page size (getrusage); 0: the faults explained nothing")
        sources["spill_Bps"] = (
            f"{src}: that fit, spill_bytes = W = bytes * max(1, N / host_cores) where W > "
            "llc_bytes, else 0, per gather; 0: the spill explained nothing")
        sources["llc_bytes"] = f"{src}: the last-level cache of cpu0 (sysfs)"
        sources["host_cores"] = f"{src}: cores in this process's CPU affinity"
        sources["fresh_from_bytes"] = sources["fresh_per_byte"] = (
            f"{src}: hinge fit of those fresh bytes per gather against its size, "
            f"N={N_max}: fresh = per_byte * max(0, bytes - from)")
    else:
        why = ("not measured on a GPU: its buffers come from XLA's pool, no fresh host memory "
               "per gather" if not on_cpu else "not measured (no fault sizes, or one device)")
        sources["fault_Bps"] = sources["fresh_from_bytes"] = sources["fresh_per_byte"] = (
            f"{why}; 0: no host fault term")
        sources["spill_Bps"] = sources["llc_bytes"] = sources["host_cores"] = (
            f"{why}; 0: no cache spill term")
        host.llc_bytes = host.host_cores = 0
    hbm = measure_hbm(full_mesh, max(codec_sizes), reps, empty_s)
    sources["hbm_Bps"] = f"{src}: w ^ salt over {fmt_bytes(max(codec_sizes))} on every rank"
    sources["entropy_Bps"] = f"not measured; carried over from built-in profile {base.name}"
    prof = cm.Profile(name=name or f"calibrated-{plat}-{N_max}", alpha_s=alpha, beta_Bps=beta,
                      codec_Bps=codec_Bps, agreement_s=agreement, hbm_Bps=hbm,
                      entropy_Bps=base.entropy_Bps, codec_launch_s=launch_s,
                      codec_pricing="measured", word_codec_Bps=word_Bps, escape_s=escape_s,
                      fault_Bps=fault_Bps, fresh_from_bytes=fresh_from, fresh_per_byte=fresh_per,
                      llc_bytes=host.llc_bytes, host_cores=host.host_cores, spill_Bps=spill_Bps,
                      sources=sources)
    details = dict(platform=plat, device_kind=kind, devices=len(devs), mesh_sizes=mesh_sizes,
                   empty_call_s=empty_s, gathers=[{k: v for k, v in r.items() if k != "times"}
                                                  for r in gather_recs],
                   faults=[{k: v for k, v in r.items() if k != "times"} for r in fault_recs],
                   codec=codec_rows, ciera_overhead=e2e_rows, kernel_codec_Bps=kernel_Bps,
                   escape=esc_row, word_overhead=word_rows,
                   host=platform.node(), date=date)
    return prof, details


def profile_table(p: cm.Profile) -> str:
    """The profile's values with units and what each one prices."""
    rows = [("alpha_s", f"{p.alpha_s * 1e6:.2f} us", "latency per ring hop"),
            ("beta_Bps", f"{p.beta_Bps / 1e9:.3f} GB/s", "bytes/s per link (ring bus bw)"),
            ("codec_Bps", f"{p.codec_Bps / 1e9:.3f} GB/s", "CIERA's extra work, bf16 bytes/s"),
            ("codec_launch_s", f"{p.codec_launch_s * 1e6:.1f} us", "fixed codec cost per gather"),
            ("agreement_s", f"{p.agreement_s * 1e6:.1f} us", "one pmax of int32 counts"),
            ("word_codec_Bps", "-" if p.word_codec_Bps is None else
             f"{p.word_codec_Bps / 1e9:.3f} GB/s", "word mode's extra work, bf16 bytes/s"),
            ("escape_s", f"{p.escape_s * 1e9:.2f} ns", "per escaped exponent"),
            ("fault_Bps", f"{p.fault_Bps / 1e9:.3f} GB/s", "host faults of fresh memory (0: none)"),
            ("fresh_from", fmt_bytes(int(p.fresh_from_bytes)), "gathers fault fresh memory above"),
            ("fresh_per_byte", f"{p.fresh_per_byte:.2f}", "fresh bytes per gathered byte above it"),
            ("spill_Bps", f"{p.spill_Bps / 1e9:.3f} GB/s", "copies beyond the cache (0: none)"),
            ("llc_bytes", fmt_bytes(int(p.llc_bytes)), f"last-level cache, {p.host_cores} cores"),
            ("codec_pricing", p.codec_pricing, "counted bytes, or measured rates"),
            ("hbm_Bps", f"{p.hbm_Bps / 1e9:.3f} GB/s", "memory copy rate"),
            ("entropy_Bps", f"{p.entropy_Bps / 1e9:.3f} GB/s", "not measured (carried over)")]
    w = max(len(r[1]) for r in rows)
    lines = [f"profile {p.name}"] + [f"  {k:<15} {v:>{w}}   {d}" for k, v, d in rows]
    return "\n".join(lines)

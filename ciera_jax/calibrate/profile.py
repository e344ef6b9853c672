"""Measure every profile value on the current devices, fit them, and say where each came from."""

from __future__ import annotations

import datetime
import platform
import types
from collections.abc import Sequence

import jax

from ciera_jax.planning import links
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


def calibrate(mesh_sizes: Sequence[int] | None = None, sizes: Sequence | None = None,
              codec_sizes: Sequence | None = None, reps: int = 7, name: str | None = None,
              log=print, fault_sizes: Sequence | None = None):
    """Measure every profile value on the current devices; returns ``(Profile, details)``.

    ``sizes``, ``codec_sizes`` and ``fault_sizes`` are full-tensor bytes (``"4K"`` or ints;
    defaults per platform in :mod:`.defaults`; ``fault_sizes`` empty: no fault fit);
    ``mesh_sizes`` the sub-meshes to time gathers on.
    """
    run = _session(mesh_sizes, sizes, codec_sizes, fault_sizes, reps, log)
    log(f"calibrating on {len(run.devs)} {run.plat} device(s) ({run.kind}); meshes "
        f"{run.mesh_sizes}; empty call {run.empty_s * 1e6:.0f} us")
    sources = {}
    # the host's cache and cores (CPU): what its ranks' gather buffers share
    host = types.SimpleNamespace(llc_bytes=host_info.llc_bytes() if run.on_cpu else 0,
                                 host_cores=host_info.host_cores() if run.on_cpu else 0)
    link = _fit_link(run, host, sources)
    codec = _fit_codec(run, link.alpha, link.beta, sources)
    _host_sources(run, bool(link.fault_recs), host, sources)
    hbm = measure_hbm(run.full_mesh, max(run.codec_sizes), reps, run.empty_s)
    sources["hbm_Bps"] = (f"{run.src}: w ^ salt over {fmt_bytes(max(run.codec_sizes))} on "
                          "every rank")
    sources["entropy_Bps"] = f"not measured; carried over from built-in profile {run.base.name}"
    prof = links.Profile(name=name or f"calibrated-{run.plat}-{run.N_max}", alpha_s=link.alpha,
                         beta_Bps=link.beta, codec_Bps=codec.codec_Bps, agreement_s=codec.agreement,
                         hbm_Bps=hbm, entropy_Bps=run.base.entropy_Bps,
                         codec_launch_s=codec.launch_s, codec_pricing="measured",
                         word_codec_Bps=codec.word_Bps, escape_s=codec.escape_s,
                         fault_Bps=link.fault_Bps, fresh_from_bytes=link.fresh_from,
                         fresh_per_byte=link.fresh_per, llc_bytes=host.llc_bytes,
                         host_cores=host.host_cores, spill_Bps=link.spill_Bps, sources=sources)
    details = dict(platform=run.plat, device_kind=run.kind, devices=len(run.devs),
                   mesh_sizes=run.mesh_sizes, empty_call_s=run.empty_s,
                   gathers=[{k: v for k, v in r.items() if k != "times"}
                            for r in link.gather_recs],
                   faults=[{k: v for k, v in r.items() if k != "times"}
                           for r in link.fault_recs],
                   codec=codec.codec_rows, ciera_overhead=codec.e2e_rows,
                   kernel_codec_Bps=codec.kernel_Bps, escape=codec.esc_row,
                   word_overhead=codec.word_rows, host=platform.node(), date=run.date)
    return prof, details


def _session(mesh_sizes, sizes, codec_sizes, fault_sizes, reps: int, log) -> types.SimpleNamespace:
    """What every measurement of one calibration shares: the devices, the sizes (the
    platform's defaults where not given), the full mesh and the cost of an empty call."""
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
    full_mesh = make_mesh(N_max)
    return types.SimpleNamespace(
        devs=devs, plat=plat, kind=kind, on_cpu=on_cpu, mesh_sizes=mesh_sizes, sizes=sizes,
        codec_sizes=codec_sizes, fault_sizes=fault_sizes, N_max=N_max, date=date,
        src=f"measured by ciera calibrate on {plat} {kind} {N_max} devices {date}",
        base=links.Profile.load(links.default_profile(plat, kind)), full_mesh=full_mesh,
        empty_s=min(empty_call_s(full_mesh), empty_call_s(full_mesh)), reps=reps, log=log)


def _fit_link(run, host, sources: dict) -> types.SimpleNamespace:
    """The link (alpha, beta) from plain gathers over the sub-meshes, and on a host with fault
    sizes its page-fault and cache-spill terms too; one device: the base profile's link."""
    link = types.SimpleNamespace(gather_recs=[], fault_recs=[], fault_Bps=0.0, fresh_from=0.0,
                                 fresh_per=0.0, spill_Bps=0.0)
    if not (run.N_max > 1 and run.sizes):
        link.alpha, link.beta = run.base.alpha_s, run.base.beta_Bps
        why = "one device: no gather to time"
        sources["alpha_s"] = sources["beta_Bps"] = f"not measured ({why}); from {run.base.name}"
        return link
    link.gather_recs = with_spill(measure_plain_gathers([n for n in run.mesh_sizes if n > 1],
                                                        run.sizes, run.reps, run.log), host)
    link.alpha, link.beta = fit_alpha_beta(link.gather_recs)
    sources["alpha_s"] = (f"{run.src}: least-squares fit of plain bits all-gathers, "
                          f"N={run.mesh_sizes}, sizes={[fmt_bytes(s) for s in run.sizes]} "
                          "(includes the fixed cost of one call)")
    if run.fault_sizes:
        link.fault_recs = with_spill(measure_plain_gathers([run.N_max], run.fault_sizes,
                                                           run.reps, run.log), host)
        recs = link.gather_recs + link.fault_recs
        link.alpha, link.beta, link.fault_Bps, link.spill_Bps = fit_link_and_host(recs)
        full = [r for r in recs if r["N"] == run.N_max]
        link.fresh_from, link.fresh_per = fit_fresh_bytes([r["n_bytes"] for r in full],
                                                          [r["fresh_bytes"] for r in full])
        sources["alpha_s"] += (f", through those that neither faulted nor spilled beyond "
                               f"the cache of these and N={run.N_max} gathers of "
                               f"{[fmt_bytes(s) for s in run.fault_sizes]}")
    sources["beta_Bps"] = sources["alpha_s"]
    return link


def _fit_codec(run, alpha: float, beta: float, sources: dict) -> types.SimpleNamespace:
    """The codec's rates: its kernels alone, and on several devices what a compressed gather
    adds end to end (exponent and word mode), the agreement and the cost of an escape."""
    sizes = run.codec_sizes
    codec = types.SimpleNamespace(codec_rows=measure_codec(run.full_mesh, sizes, run.reps,
                                                           run.log))
    codec.kernel_Bps, icpt = fit_rate([r["n_bytes"] for r in codec.codec_rows],
                                      [r["seconds"] for r in codec.codec_rows])
    kernel_launch_s = max(icpt - run.empty_s, 1e-6)
    kernel_src = (f"kernels alone (encode(shard)+decode(full) on every rank at once, slope over "
                  f"{[fmt_bytes(s) for s in sizes]}): {codec.kernel_Bps / 1e9:.3g} GB/s, launch "
                  f"{kernel_launch_s * 1e6:.0f} us")
    if run.N_max <= 1:
        codec.agreement, codec.e2e_rows = 0.0, []
        codec.esc_row, codec.escape_s, codec.word_rows, codec.word_Bps = None, 0.0, [], None
        codec.codec_Bps, codec.launch_s = codec.kernel_Bps, kernel_launch_s
        sources["agreement_s"] = "one device: no agreement collective"
        sources["codec_Bps"] = f"{run.src}: {kernel_src}"
        sources["codec_launch_s"] = f"{run.src}: intercept of that line less one empty call"
        return codec
    src, mesh, reps, log = run.src, run.full_mesh, run.reps, run.log
    codec.agreement = agreement = measure_agreement(mesh, reps * 2, run.empty_s)
    sources["agreement_s"] = f"{src}: pmax of an int32 vector (64 counts), less one empty call"
    codec.e2e_rows = measure_ciera_overhead(mesh, sizes, reps, alpha, beta, agreement, log)
    codec.codec_Bps, icpt = fit_rate([r["n_bytes"] for r in codec.e2e_rows],
                                     [r["extra_s"] for r in codec.e2e_rows])
    codec.launch_s = max(icpt, 1e-6)
    sources["codec_Bps"] = (
        f"{src}: end to end, CIERA gathers at churn 0 of {[fmt_bytes(s) for s in sizes]}"
        " less their modelled wire time and agreement, slope vs bytes (everything the "
        f"compressed path adds: encode, patch compaction, decode); {kernel_src}")
    sources["codec_launch_s"] = f"{src}: intercept of that line"
    big = max(codec.e2e_rows, key=lambda r: r["n_bytes"])
    codec.esc_row = measure_escape_cost(mesh, big["n_bytes"], ESCAPE_CHURN, reps, alpha, beta,
                                        agreement, big["extra_s"], log)
    codec.escape_s = codec.esc_row["escape_s"]
    sources["escape_s"] = (f"{src}: exponent-mode gathers of {fmt_bytes(big['n_bytes'])} "
                           f"at {ESCAPE_CHURN:.0%} churn less the same at 0%, per escaped "
                           "exponent of the full tensor")
    codec.word_rows = measure_word_overhead(mesh, sizes, reps, alpha, beta, agreement, log)
    codec.word_Bps, _ = fit_rate([r["n_bytes"] for r in codec.word_rows],
                                 [r["extra_s"] for r in codec.word_rows])
    sources["word_codec_Bps"] = (
        f"{src}: end to end, word-mode gathers of steady-state word moves (escapes "
        f"included) of {[fmt_bytes(s) for s in sizes]} less their modelled wire "
        "time and agreement, slope vs bytes")
    return codec


def _host_sources(run, faults_fitted: bool, host, sources: dict) -> None:
    """Where the host terms (page faults, cache spill) came from, or why they are 0."""
    src = run.src
    if faults_fitted:
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
            f"N={run.N_max}: fresh = per_byte * max(0, bytes - from)")
        return
    why = ("not measured on a GPU: its buffers come from XLA's pool, no fresh host memory "
           "per gather" if not run.on_cpu else "not measured (no fault sizes, or one device)")
    sources["fault_Bps"] = sources["fresh_from_bytes"] = sources["fresh_per_byte"] = (
        f"{why}; 0: no host fault term")
    sources["spill_Bps"] = sources["llc_bytes"] = sources["host_cores"] = (
        f"{why}; 0: no cache spill term")
    host.llc_bytes = host.host_cores = 0


def profile_table(p: links.Profile) -> str:
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

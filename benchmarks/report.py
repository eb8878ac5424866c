"""Turn collected scenario results into target ratios, text/Markdown tables and a PNG plot.

Every ratio here divides two values measured in the same run (the runner's
JSON); nothing is compared against a number typed in by hand. A ratio whose
inputs are missing (scenario skipped or failed) is reported with
``met: None`` and says which input is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .common import KiB, MiB, human_bytes

logger = logging.getLogger(__name__)

GRPO_WORKLOAD = "grpo"
"""``Row.extra["workload"]`` of the peer workload's GRPO-shaped rows (``peers.workload.GRPO_WORKLOAD``)."""
WIDE_WORKLOAD = "columns4"
"""... and of its four-column rows, four 4 KiB columns a sample (``peers.workload.WIDE_WORKLOAD``)."""

PEER_SYSTEMS = {
    "transferqueue": "TransferQueue",
    "ray-actor": "Ray-actor buffer",
}


def _rows(results: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    sc = results.get("scenarios", {}).get(scenario, {})
    if sc.get("status") != "ok":
        return []
    return list(sc.get("rows", []))


def _workload_row(rows: Iterable[dict[str, Any]], workload: str, op: str, **match: Any) -> dict[str, Any] | None:
    """The peer workload's row of case ``workload`` (GRPO-shaped, four columns) for ``op``
    (see benchmarks/peers/workload.py)."""
    return _find((r for r in rows if (r.get("extra") or {}).get("workload") == workload), op=op, **match)


def _find(rows: Iterable[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _target(
    tid: str,
    description: str,
    measured: float | None,
    reference: float | None,
    bound: float,
    *,
    upper: bool = False,
    ratio: bool = True,
    unit: str = "x",
    detail: str = "",
    primary: bool = True,
    needs: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A target check. ``ratio``: measured/reference against bound; otherwise measured itself."""
    if measured is None or (ratio and not reference):
        value = None
    else:
        value = measured / reference if ratio else measured
    met = None if value is None else (value <= bound if upper else value >= bound)
    return {
        "id": tid,
        "description": description,
        "measured": measured,
        "reference": reference,
        "value": value,
        "bound": bound,
        "comparison": "<=" if upper else ">=",
        "unit": unit,
        "met": met,
        "primary": primary,
        "detail": detail,
        "needs": list(needs),
    }


def compute_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """All issue targets, one entry per measured case that a target covers."""
    out: list[dict[str, Any]] = []
    ceil = _rows(results, "ceilings")
    flow = _rows(results, "dockd_flow")
    cfg = results.get("config", {})
    max_batch = max(cfg.get("batch_sizes", [64]) or [64])

    def ceiling(op: str, payload: int) -> float | None:
        r = _find(ceil, op=op, sample_bytes=payload)
        return r.get("gbps") if r else None

    # 1 + 2: bulk gets against memcpy / raw socket of the same payload.
    for path, op, bound, tid, what in (
        ("shm", "copy", 0.6, "same_host_get_vs_memcpy", "single-thread memcpy"),
        ("socket", "transfer", 0.7, "socket_get_vs_raw_socket", "raw blocking socket"),
    ):
        def bulk_gets(p: str) -> list[dict[str, Any]]:
            return [
                r
                for r in flow
                if r["op"] == "get" and r.get("path") == p and r.get("clients") == 1 and r.get("gbps") is not None
                and (r.get("sample_bytes") or 0) >= 1 * MiB
            ]

        cases = bulk_gets(path)
        label = path
        if not cases and path == "shm":
            # No shared-memory path in this dockd build: a same-host client uses the loopback socket.
            cases = bulk_gets("socket")
            label = "same-host (loopback socket, no shm path)"
        if not cases:
            out.append(_target(tid, f"{path} get of >= 1 MiB samples vs {what}", None, None, bound,
                               detail="no dockd_flow rows for >= 1 MiB samples on this path"))
        for r in cases:
            payload = r["sample_bytes"] * r["batch"]
            out.append(
                _target(
                    tid,
                    f"{label} get {human_bytes(r['sample_bytes'])} x {r['batch']} vs {what} of {human_bytes(payload)}",
                    r["gbps"],
                    ceiling(op, payload),
                    bound,
                    primary=r["batch"] == max_batch,
                )
            )

    # 3: one small get, p50, against the raw socket round trip.
    rtt = _find(ceil, op="rtt")
    lat = [r for r in flow if r["op"] == "get" and r.get("p50_us") is not None]
    if not lat:
        out.append(_target("small_get_p50_vs_rtt", "small get p50 vs raw socket RTT", None, None, 4.0, upper=True,
                           detail="no dockd_flow latency rows"))
    for r in lat:
        out.append(
            _target(
                "small_get_p50_vs_rtt",
                f"{path_label(r.get('path'))} get of one {r.get('sample_bytes')}-byte sample"
                + (f" on {r['extra']['data_on']}" if r.get("extra", {}).get("data_on") else "")
                + ", p50 vs raw socket RTT p50",
                r["p50_us"],
                rtt.get("p50_us") if rtt else None,
                4.0,
                upper=True,
                detail="" if rtt else "raw socket RTT not measured (scenario ceilings)",
            )
        )

    # 4: peers on the same workload.
    dockd_rows = _rows(results, "peer_dockd_central")
    for scen, system, bound in (("peer_transferqueue", "transferqueue", None), ("peer_ray_buffer", "ray-actor", 5.0)):
        peer_rows = _rows(results, scen)
        label = PEER_SYSTEMS[system]
        for metric, size, tq_bound in (("samples_per_s", 4 * KiB, 10.0), ("gbps", 1 * MiB, 3.0)):
            b = tq_bound if bound is None else bound
            for op in ("get", "put"):
                mine = _find(dockd_rows, op=op, sample_bytes=size, path="auto")
                theirs = _find(peer_rows, op=op, sample_bytes=size)
                unit_name = "samples/s" if metric == "samples_per_s" else "GB/s"
                out.append(
                    _target(
                        f"vs_{system}_{op}_{metric}",
                        f"dockd central {op} {unit_name} at {human_bytes(size)} samples vs {label}",
                        mine.get(metric) if mine else None,
                        theirs.get(metric) if theirs else None,
                        b,
                        primary=op == "get",
                        detail=(
                            "dockd central not measured (see scenario peer_dockd_central)" if not mine
                            else "" if theirs else f"{label} not measured (see scenario {scen})"
                        ),
                    )
                )
        # The four-column case (4 x 4 KiB a sample): the 4 KiB bound. The GRPO-shaped case (8 columns, 6 of them
        # ragged tensors): dockd should beat each peer. Both sides move the same tensor bytes per sample, so the
        # GB/s ratio is the same number.
        workloads = ((WIDE_WORKLOAD, "columns4", "four-column", "samples of four 4 KiB columns",
                      10.0 if bound is None else bound),
                     (GRPO_WORKLOAD, "grpo", "GRPO", "GRPO-shaped samples (8 columns, 6 ragged)", 1.0))
        for workload, key, name, what, case_bound in workloads:
            for op in ("get", "put"):
                mine = _workload_row(dockd_rows, workload, op, path="auto")
                theirs = _workload_row(peer_rows, workload, op)
                out.append(
                    _target(
                        f"vs_{system}_{key}_{op}_samples_per_s",
                        f"dockd central {op} samples/s of {what} vs {label}",
                        mine.get("samples_per_s") if mine else None,
                        theirs.get("samples_per_s") if theirs else None,
                        case_bound,
                        primary=op == "get",
                        detail=(
                            f"dockd central {name} case not measured (see scenario peer_dockd_central)" if not mine
                            else "" if theirs else f"{label} {name} case not measured (see scenario {scen})"
                        ),
                    )
                )

    # 5: controller scale.
    ctl = _rows(results, "controller_scale")
    acq = sorted((r for r in ctl if r["op"] == "acquire"), key=lambda r: r["extra"].get("partition_samples", 0))
    if acq:
        small, large = acq[0], acq[-1]
        out.append(
            _target(
                "controller_acquire_flat",
                f"acquire({small.get('batch')}) p50 at {large['extra']['partition_samples']:,} vs "
                f"{small['extra']['partition_samples']:,} samples",
                large["p50_us"],
                small["p50_us"],
                2.0,
                upper=True,
            )
        )
        out.append(
            _target(
                "controller_acquire_under_1ms",
                f"acquire({large.get('batch')}) p50 at {large['extra']['partition_samples']:,} samples",
                large["p50_us"],
                None,
                1000.0,
                upper=True,
                ratio=False,
                unit="us",
            )
        )
    else:
        out.append(_target("controller_acquire_flat", "controller acquire flat", None, None, 2.0, upper=True,
                           detail="controller_scale not measured"))
    meta = sorted((r for r in ctl if r["op"] == "metadata"), key=lambda r: r["extra"].get("partition_samples", 0))
    if meta:
        out.append(
            _target(
                "controller_metadata_bytes",
                f"metadata bytes per sample at {meta[-1]['extra']['partition_samples']:,} samples",
                meta[-1]["value"],
                None,
                64.0,
                upper=True,
                ratio=False,
                unit="B",
            )
        )
    out.extend(_columnar_targets(results))
    for t in out:
        t["needs"] = _needs(t["id"])
    return out


def _columnar_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The columnar data plane's targets, from the figures benchmarks/columnar.py measured."""
    sc = results.get("scenarios", {}).get("columnar", {})
    m = sc.get("info", {}).get("measured") if sc.get("status") == "ok" else None
    if not m:
        return []

    def t(tid: str, what: str, key: str, bound: float, *, upper: bool = False, unit: str = "x") -> dict[str, Any]:
        return _target(tid, what, m.get(key), None, bound, upper=upper, ratio=False, unit=unit)

    return [
        t("columnar_memory_per_value", "warehouse memory per stored value (RSS growth - payload)",
          "mem_overhead_per_value_B", 32.0, upper=True, unit="B"),
        t("columnar_dock_per_sample", "whole dock's memory per 4-column sample", "mem_dock_per_sample_B", 64.0,
          upper=True, unit="B"),
        t("columnar_grpo_put", "GRPO-shaped put vs memcpy of the same bytes", "grpo_put_vs_memcpy", 0.15),
        t("columnar_grpo_get", "GRPO-shaped get vs memcpy of the same bytes", "grpo_get_vs_memcpy", 0.15),
        t("columnar_multi_column_get", "4 x 4 KiB vs 1 x 16 KiB per-sample get time (columns as tensors)",
          "get_multi_vs_single_stacked", 1.5, upper=True),
        t("columnar_put_1MiB", "same-host put of 1 MiB samples vs memcpy", "put_1MiB_vs_memcpy", 0.5),
        t("columnar_put_16MiB", "same-host put of 16 MiB samples vs memcpy", "put_16MiB_vs_memcpy", 0.5),
    ]


_NEEDS = (
    ("same_host_get_vs_memcpy", ("ceilings", "dockd_flow")),
    ("socket_get_vs_raw_socket", ("ceilings", "dockd_flow")),
    ("small_get_p50_vs_rtt", ("ceilings", "dockd_flow")),
    ("vs_transferqueue", ("peer_dockd_central", "peer_transferqueue")),
    ("vs_ray-actor", ("peer_dockd_central", "peer_ray_buffer")),
    ("controller_", ("controller_scale",)),
    ("columnar_", ("columnar",)),
)


def _needs(tid: str) -> list[str]:
    for prefix, names in _NEEDS:
        if tid.startswith(prefix):
            return list(names)
    return []


def relevant_targets(results: dict[str, Any], targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets that depend on at least one scenario this run attempted."""
    ran = set(results.get("scenarios", {}))
    return [t for t in targets if ran & set(t.get("needs") or _needs(t["id"]))]


def path_label(path: str | None) -> str:
    return {"shm": "same-host", "socket": "socket", "auto": "default", None: "-"}.get(path, str(path))


# ---------------------------------------------------------------- text tables


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v >= 1e6:
            return f"{v:,.0f}"
        if v >= 100:
            return f"{v:,.0f}"
        if 0 < abs(v) < 1:
            return f"{v:.3g}"
        return f"{v:.{digits}f}"
    return str(v)


ROW_COLUMNS = ("system", "op", "path", "sample", "batch", "clients", "GB/s", "samples/s", "p50 us", "p99 us", "other")


TOO_SHORT = "too short to judge"
"""What a verdict or a memory figure reads as when the run was too short for it to mean anything."""

#: targets whose figure is a process's resident-memory growth (benchmarks/columnar.py): noise in a short run
_RSS_TARGETS = ("columnar_memory_per_value", "columnar_dock_per_sample")


def is_quick(results: dict[str, Any]) -> bool:
    """A ``--quick`` run: tiny sizes, whose ratios and memory figures mean nothing."""
    return bool((results.get("config") or {}).get("quick"))


def _meaningless_memory(value: Any, unit: str | None) -> bool:
    """A memory figure below zero: RSS shrank over a run too short for the growth to show."""
    return unit in ("B", "B/sample") and isinstance(value, (int, float)) and value < 0


def _rss_row(r: dict[str, Any]) -> bool:
    return r.get("scenario") == "columnar" and str(r.get("path") or "").startswith("mem_") and r.get("unit") == "B"


def _row_cells(r: dict[str, Any], *, quick: bool = False) -> list[str]:
    other = ""
    if r.get("value") is not None:
        if (quick and _rss_row(r)) or _meaningless_memory(r["value"], r.get("unit")):
            other = f"memory: {TOO_SHORT}"
        else:
            other = f"{_fmt(r['value'])} {r.get('unit') or ''}".strip()
    elif r.get("extra", {}).get("partition_samples"):
        other = f"partition={r['extra']['partition_samples']:,}"
        first = r["extra"].get("first_acquire_per_consumer_us")
        if first:
            other += f"; first acquire per consumer up to {max(first):,.0f} us"
    phases = r.get("extra", {}).get("get_phase_s_per_call") or {
        k: v / 1e6 for k, v in (r.get("extra", {}).get("get_phase_us") or {}).items()}
    if phases:
        other = "phases us: " + ", ".join(f"{k} {v * 1e6:,.0f}" for k, v in phases.items())
    if r.get("extra", {}).get("data_on"):
        other = f"data on {r['extra']['data_on']}" + (f"; {other}" if other else "")
    sample = human_bytes(r.get("sample_bytes"))
    workload = r.get("extra", {}).get("workload")
    if workload in (GRPO_WORKLOAD, WIDE_WORKLOAD):
        per_column = r["extra"].get("mean_sample_bytes", 0) / max(1, len(r["extra"].get("columns") or [1]))
        sample = (f"GRPO ~{r['extra'].get('mean_sample_bytes', 0) / KiB:.0f} KiB" if workload == GRPO_WORKLOAD
                  else f"{len(r['extra'].get('columns') or [])} x {human_bytes(int(per_column))}")
        what = f"{len(r['extra'].get('columns') or [])} columns" + (", ragged" if workload == GRPO_WORKLOAD else "")
        other = f"{what}; {other}" if other else what
    return [
        r["system"],
        r["op"],
        path_label(r.get("path")) if r.get("path") else "-",
        sample,
        _fmt(r.get("batch")),
        _fmt(r.get("clients")),
        _fmt(r.get("gbps")),
        _fmt(r.get("samples_per_s"), 0),
        _fmt(r.get("p50_us"), 1),
        _fmt(r.get("p99_us"), 1),
        other,
    ]


def _target_cells(t: dict[str, Any], *, quick: bool = False) -> list[str]:
    """One target's row. In a quick run (or for a negative memory figure) no verdict is given: the
    status reads "too short to judge" and a memory figure is left out."""
    met = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
    negative = _meaningless_memory(t["value"], t["unit"])
    if t["value"] is not None and (quick or negative):
        met = TOO_SHORT
    if t["value"] is None or negative or (quick and t["id"] in _RSS_TARGETS):
        value = "-"
    elif t["unit"] == "x":
        value = f"{t['value']:.2f}x"
    else:
        value = f"{t['value']:.1f} {t['unit']}"
    bound = f"{t['comparison']} {t['bound']:g}{'x' if t['unit'] == 'x' else ' ' + t['unit']}"
    return [t["description"], value, bound, met + ("" if t["primary"] else " (info)"), t.get("detail", "")]


def _text_table(header: Iterable[str], rows: list[list[str]]) -> str:
    header = list(header)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _md_table(header: Iterable[str], rows: list[list[str]]) -> str:
    header = list(header)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def render(results: dict[str, Any], *, markdown: bool = False) -> str:
    """All scenario tables, then the targets table."""
    return "\n\n".join(p for p in (render_scenarios(results, markdown=markdown),
                                     render_targets(results, markdown=markdown)) if p)


def render_targets(results: dict[str, Any], *, markdown: bool = False) -> str:
    table = _md_table if markdown else _text_table
    targets = relevant_targets(results, results.get("targets") or compute_targets(results))
    if not targets:
        return ""
    quick = is_quick(results)
    head = "### Targets" if markdown else "== Targets (ratios of values measured in this run)"
    if quick:
        head += ("\n\nA --quick run: its sizes are too small for any target to be judged (ratios shown as measured, "
                 "resident-memory figures left out).")
    rows = [_target_cells(t, quick=quick) for t in targets]
    return head + "\n\n" + table(("target", "value", "bound", "status", "note"), rows)


def render_scenarios(results: dict[str, Any], *, markdown: bool = False) -> str:
    table = _md_table if markdown else _text_table
    quick = is_quick(results)
    parts: list[str] = []
    for name, sc in results.get("scenarios", {}).items():
        title = sc.get("title", name)
        head = f"### {name}: {title}" if markdown else f"== {name}: {title}"
        if sc.get("status") == "ok" and not sc.get("rows"):
            note = (sc.get("info") or {}).get("note") or "no rows"
            parts.append(f"{head} ({sc.get('wall_s', 0):.0f} s)\n{note} (in the JSON under scenarios.{name}.info)")
        elif sc.get("status") == "ok":
            parts.append(f"{head} ({sc.get('wall_s', 0):.0f} s)")
            parts.append(table(ROW_COLUMNS, [_row_cells(r, quick=quick) for r in sc.get("rows", [])]))
        elif sc.get("status") == "skipped":
            parts.append(f"{head}\nSKIPPED: {sc.get('reason')}")
        else:
            parts.append(f"{head}\nFAILED: {sc.get('error', 'unknown error')}")
    return "\n\n".join(parts)


# ---------------------------------------------------------------- plot


def plot(results: dict[str, Any], out_png: str | Path) -> Path | None:
    """GB/s against sample size per system, ceilings as dashed lines. Returns the path, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("[report] matplotlib is not installed; no plot. Install it with: pip install -e '.[plot]'")
        return None
    cfg = results.get("config", {})
    batch = max(cfg.get("batch_sizes", [64]) or [64])
    peer_batch = cfg.get("peer_batch", batch)
    ceil = _rows(results, "ceilings")
    flow = _rows(results, "dockd_flow")
    peers = {
        "dockd central (default path)": (_rows(results, "peer_dockd_central"), {"path": "auto"}),
        "dockd central (socket)": (_rows(results, "peer_dockd_central"), {"path": "socket"}),
        "TransferQueue": (_rows(results, "peer_transferqueue"), {}),
        "Ray-actor buffer": (_rows(results, "peer_ray_buffer"), {}),
    }
    grpo = [(label, op, r) for label, (rows, match) in peers.items() for op in ("get", "put")
            if (r := _workload_row(rows, GRPO_WORKLOAD, op, **match)) is not None and r.get("samples_per_s")]
    if grpo:
        fig, all_axes = plt.subplots(1, 3, figsize=(18, 6), gridspec_kw={"width_ratios": [1, 1, 0.8]})
        all_axes[1].sharey(all_axes[0])
        axes = list(all_axes[:2])
        _plot_grpo(all_axes[2], grpo, peer_batch)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    for ax, op in zip(axes, ("get", "put")):
        series: list[tuple[str, list[tuple[int, float]], dict[str, Any]]] = []
        for path in ("shm", "socket"):
            for b in sorted({r["batch"] for r in flow if r.get("batch")}):
                pts = [
                    (r["sample_bytes"], r["gbps"])
                    for r in flow
                    if r["op"] == op and r.get("path") == path and r.get("batch") == b and r.get("clients") == 1
                    and r.get("gbps")
                ]
                series.append((f"dockd {path_label(path)}, batch {b}", pts, {"marker": "o"}))
        for label, (rows, match) in peers.items():
            pts = [
                (r["sample_bytes"], r["gbps"])
                for r in rows
                if r["op"] == op and r.get("gbps") and r.get("sample_bytes")
                and all(r.get(k) == v for k, v in match.items())
            ]
            series.append((f"{label}, batch {peer_batch}", pts, {"marker": "s", "alpha": 0.8}))
        sizes = sorted({r["sample_bytes"] for r in flow if r.get("sample_bytes") and r.get("gbps")} | {
            r["sample_bytes"] for rows, _ in peers.values() for r in rows if r.get("sample_bytes") and r.get("gbps")})
        for label, cop, style in (("memcpy ceiling", "copy", "--"), ("raw socket ceiling", "transfer", "-.")):
            pts = []
            for s in sizes:
                r = _find(ceil, op=cop, sample_bytes=s * batch)
                if r and r.get("gbps"):
                    pts.append((s, r["gbps"]))
            series.append((f"{label} (payload = sample x {batch})", pts, {"linestyle": style, "color": "black", "linewidth": 1.2}))
        for label, pts, style in series:
            if not pts:
                continue
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if sizes:
            ax.set_xticks(sizes)
            ax.set_xticklabels([human_bytes(s) for s in sizes])
            ax.minorticks_off()
            ax.set_yscale("log")
        ax.set_xlabel("sample size (bytes)")
        ax.set_title(f"{op}, one column")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (payload, median of repeats)")
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8, frameon=False)
    mach = results.get("machine", {})
    fig.suptitle(f"dockd sample flow vs ceilings and peers - {mach.get('cpus', '?')} CPUs, {mach.get('cpu_model', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.13 if handles else 0, 1, 1))
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _plot_grpo(ax: Any, grpo: list[tuple[str, str, dict[str, Any]]], batch: int) -> None:
    """Grouped bars: samples/s of the GRPO-shaped case per system, get and put, GB/s written on top."""
    systems = list(dict.fromkeys(label for label, _, _ in grpo))
    width = 0.38
    for k, (op, color) in enumerate((("get", "tab:blue"), ("put", "tab:orange"))):
        xs, ys, gb = [], [], []
        for i, label in enumerate(systems):
            r = next((r for lab, o, r in grpo if lab == label and o == op), None)
            if r is not None:
                xs.append(i + (k - 0.5) * width)
                ys.append(r["samples_per_s"])
                gb.append(r.get("gbps"))
        bars = ax.bar(xs, ys, width, label=op, color=color)
        for bar, g in zip(bars, gb):
            ax.annotate(f"{bar.get_height():,.0f}\n{g:.2f} GB/s" if g else f"{bar.get_height():,.0f}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=6.5)
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels([s.replace(" (", "\n(") for s in systems], fontsize=8)
    ax.set_yscale("log")
    top = max(r["samples_per_s"] for _, _, r in grpo)
    ax.set_ylim(top=top * 2.5)  # room for the labels
    ax.set_ylabel("samples/s (median of repeats)")
    ax.set_title(f"GRPO-shaped samples (6 ragged tensors, reward, uid), batch {batch}", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


# ---------------------------------------------------------------- Markdown report


def markdown_report(results: dict[str, Any], *, plot_name: str | None = None) -> str:
    """A self-contained Markdown report of one run: machine, versions, command, targets, tables, plot."""
    mach = results.get("machine", {})
    ver = results.get("versions", {})
    cfg = results.get("config", {})
    pk = ver.get("packages", {})
    mem = mach.get("memory_bytes")
    lines = [
        f"- when (UTC): {results.get('started_utc', '?')} to {results.get('finished_utc', '?')}",
        f"- machine: {mach.get('cpu_model', '?')}, {mach.get('cpus', '?')} CPUs, "
        f"{mem / 2**30:.1f} GiB memory, {mach.get('platform', '?')}" if mem else f"- machine: {mach}",
        f"- load average (1/5/15 min) at start {_load(mach.get('loadavg'))}, at end {_load(mach.get('loadavg_end'))}",
        f"- versions: Python {ver.get('python', '?')}, dockd {pk.get('dockd')} (git {ver.get('dockd_git')}"
        f"{', uncommitted changes' if ver.get('dockd_git_dirty') else ''}), "
        + ", ".join(f"{k} {v}" for k, v in pk.items() if k != "dockd" and v),
        f"- command: `{results.get('command', '?')}`",
        f"- config: repeats {cfg.get('repeats')}, sample sizes {[human_bytes(s) for s in cfg.get('sample_sizes', [])]}, "
        f"batches {cfg.get('batch_sizes')}, paths {cfg.get('paths')}, concurrent clients {cfg.get('concurrent_clients')}, "
        f"~{human_bytes(cfg.get('bytes_per_repeat'))} per repeat, latency ops {cfg.get('latency_ops')}, "
        f"peer batch {cfg.get('peer_batch')}, controller partitions {cfg.get('controller_partition_sizes')} "
        "(every field in the JSON)",
    ]
    parts = ["\n".join(lines)]
    if plot_name:
        parts.append(f"![GB/s against sample size per system, ceilings as black lines]({plot_name})")
    parts.append(render_targets(results, markdown=True))
    parts.append(render_scenarios(results, markdown=True))
    return "\n\n".join(parts) + "\n"


def _load(values: Any) -> str:
    if not values:
        return "?"
    return "/".join(f"{v:.1f}" for v in values)

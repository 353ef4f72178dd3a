"""The report for people and files: the table, the JSON document and the premium-against-K plot."""

from __future__ import annotations

import importlib.util
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from certckpt.errors import ConfigurationError, MissingDependencyError
from certckpt.storage import write_atomic

from .stats import TRIM, describe, se_text

__all__ = ["format_table", "plot", "require_matplotlib", "to_json"]


def _load(v: Sequence[float] | None) -> str:
    return "?" if not v else "/".join(f"{x:.1f}" for x in v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def _header(report: Mapping[str, Any]) -> list[str]:
    return [
        f"performance envelope: {report['model']} ({report['params']:,} parameters), {report['ranks']} rank(s), "
        f"{report['backend']} on {report['device']}, {report['threads_per_rank']} torch thread(s) per rank, "
        f"{report['cpus']} CPUs, {report['mode']} audits"
        + (", non-finite flags read a step late" if report.get("nonfinite_read") == "deferred" else ""),
        f"load average {_load(report.get('loadavg_start'))} at start, {_load(report.get('loadavg_end'))} at end "
        f"({report['cpus']} CPUs; other jobs on the machine make every figure noisier)",
        f"plain/audited: mean step time, {report.get('trim', TRIM):.0%} trimmed at each end "
        "(audited: one K-step cycle, K-1 non-audit steps + 1 audit step); premium = (audited - plain) / plain;",
        "± one standard error; shares of the premium: replay / consensus / non-finite checks;",
        "replay floor = forward+backward share of a plain step / K",
        "",
    ]


def _rows(report: Mapping[str, Any]) -> list[str]:
    head = (
        "seq",
        "mb",
        "K",
        "trials",
        "plain ms",
        "audited ms",
        "premium",
        "replay",
        "consensus",
        "nonfinite",
        "floor",
        "",
    )
    rows = []
    for c in report["combinations"]:
        sh = c["shares"] or {}
        rows.append(
            (
                str(c["seq_len"]),
                str(c["micro_batch"]),
                str(c["audit_every"]),
                str(c.get("trials", "")),
                f"{c['plain_s'] * 1e3:.2f}",
                f"{c['audited_s'] * 1e3:.2f}",
                _pct(c["premium"]) + se_text(c.get("premium_se")),
                *(f"{sh[n]:.0%}" if n in sh else "-" for n in ("replay", "consensus", "nonfinite")),
                _pct(c["replay_floor"]),
                "OVER" if c["over_budget"] else "",
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    last = len(head) - 1  # every column is right-aligned but the OVER flag

    def fmt(r: Sequence[str]) -> str:
        cells = (v.ljust(w) if i == last else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
        return "  ".join(cells).rstrip()

    return [fmt(head), *(fmt(r) for r in rows)]


def _verdict(report: Mapping[str, Any]) -> list[str]:
    lines = []
    if any(c["shares"] is None for c in report["combinations"]):
        lines.append("shares '-': premium at or below zero (within measurement noise)")
    ob = report["over_budget"]
    if ob:
        lines.append(
            f"OVER BUDGET (premium > {report['max_premium']:.1%}): "
            + "; ".join(f"{describe(c)} ({_pct(c['premium'])})" for c in ob)
        )
    else:
        lines.append(f"every premium within {report['max_premium']:.1%}")
    lines.append(f"measured in {report['elapsed_s']:.0f} s")
    return lines


def format_table(report: Mapping[str, Any]) -> str:
    """The report for people: a header and one row per combination, then the verdict."""
    return "\n".join([*_header(report), *_rows(report), "", *_verdict(report)])


def to_json(report: Mapping[str, Any]) -> str:
    """The report as the JSON document that ``certckpt plan --from`` reads."""
    return json.dumps(report, indent=2)


def require_matplotlib() -> None:
    """Raise MissingDependencyError now (before a long sweep) when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("--plot needs matplotlib: pip install 'certckpt[report]'")


def plot(report: Mapping[str, Any], out_path: str | os.PathLike) -> str:
    """Draw premium against K, one line per (seq_len, micro_batch) shape with one-standard-error bars,
    the budget as a dashed line; PNG.

    Returns:
        The path written.

    Raises:
        ConfigurationError: ``out_path`` does not end in ``.png``.
        MissingDependencyError: no matplotlib.
    """
    path = os.fspath(out_path)
    if os.path.splitext(path)[1].lower() != ".png":
        raise ConfigurationError(f"{path}: --plot writes PNG; give a path ending in .png")
    try:  # matplotlib here, not at the top: it is optional, and only --plot needs it
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(f"--plot needs matplotlib: pip install 'certckpt[report]' ({e})") from e

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    shapes: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
    for c in report["combinations"]:
        se = c.get("premium_se")
        shapes.setdefault((c["seq_len"], c["micro_batch"]), []).append(
            (c["audit_every"], c["premium"], se if se is not None else 0.0)
        )
    ks = sorted({c["audit_every"] for c in report["combinations"]})
    for (s, b), pts in shapes.items():
        pts.sort()
        ax.errorbar(
            [k for k, _, _ in pts],
            [p * 100 for _, p, _ in pts],
            yerr=[e * 100 for _, _, e in pts],
            marker="o",
            capsize=3,
            label=f"seq {s} x mb {b}",
        )
    ax.axhline(
        report["max_premium"] * 100,
        color="red",
        linestyle="--",
        linewidth=1,
        label=f"budget {report['max_premium']:.1%}",
    )
    ax.axhline(0, color="grey", linewidth=0.5)
    if ks and ks[-1] / max(ks[0], 1) >= 10:
        ax.set_xscale("log")
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel("audit every K steps")
    ax.set_ylabel("premium over plain DDP (%)")
    ax.set_title(f"audit premium: {report['model']}, {report['ranks']} rank(s), {report['backend']}/{report['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    write_atomic(path, buf.getvalue())
    return path

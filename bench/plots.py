"""Plots for the benchmarks: latency CDFs and timelines as PNG (matplotlib, Agg backend).

matplotlib is the `bench` extra (`pip install -e '.[bench]'`); without it, :func:`available`
is False and the benchmarks print their tables and skip the plots.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


@dataclass
class Panel:
    """One axes of a figure: named series, optional vertical target lines."""

    title: str
    xlabel: str
    ylabel: str = ""
    series: dict[str, Sequence[float]] = field(default_factory=dict)
    targets: dict[str, float] = field(default_factory=dict)
    log_x: bool = False


def latency_cdfs(path: Path, panels: Sequence[Panel], *, suptitle: str = "") -> Path:
    """One CDF per series, one axes per panel, side by side. Empty series are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for label, values in panel.series.items():
            ordered = sorted(values)
            if not ordered:
                continue
            n = len(ordered)
            fractions = [(i + 1) / n for i in range(n)]
            ax.step(ordered, fractions, where="post", label=f"{label} (n={n})")
        for label, x in panel.targets.items():
            ax.axvline(x, color="grey", linestyle="--", linewidth=1)
            ax.text(x, 0.02, f" {label}", color="grey", rotation=90, va="bottom", ha="right")
        if panel.log_x:
            ax.set_xscale("log")
        ax.axhline(0.99, color="lightgrey", linestyle=":", linewidth=1)
        ax.axhline(0.5, color="lightgrey", linestyle=":", linewidth=1)
        ax.set_ylim(0, 1.01)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel or "fraction of samples ≤ x")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(loc="lower right", fontsize=8)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclass
class Track:
    """One axes of a timeline: series of y values over the shared time axis."""

    ylabel: str
    series: dict[str, tuple[Sequence[float], Sequence[float]]]
    """label -> (times in seconds, values)"""
    hlines: Mapping[str, float] = field(default_factory=dict)
    points: bool = False
    """Scatter (one dot per sample, at its time) instead of a step line."""
    log_y: bool = False


def timeline(
    path: Path,
    tracks: Sequence[Track],
    *,
    xlabel: str = "seconds",
    suptitle: str = "",
    marks: Mapping[str, float] | None = None,
) -> Path:
    """Stacked axes sharing the time axis, one per track; ``marks`` are named instants,
    drawn as vertical lines across all of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(tracks), 1, figsize=(11, 2.7 * len(tracks)), sharex=True, squeeze=False
    )
    for ax, track in zip(axes[:, 0], tracks, strict=True):
        for label, (times, values) in track.series.items():
            if not times:
                continue
            if track.points:
                ax.scatter(times, values, label=label, s=4, alpha=0.5, linewidths=0)
            else:
                ax.plot(times, values, label=label, linewidth=1.3, drawstyle="steps-post")
        for label, y in track.hlines.items():
            ax.axhline(y, color="grey", linestyle="--", linewidth=1)
            ax.text(0, y, f" {label}", color="grey", va="bottom", fontsize=8)
        for label, x in (marks or {}).items():
            ax.axvline(x, color="black", linestyle=":", linewidth=1)
            if ax is axes[0, 0]:
                ax.text(
                    x, 1.0, f" {label}", transform=ax.get_xaxis_transform(), fontsize=8, va="bottom"
                )
        ax.set_ylabel(track.ylabel)
        if track.log_y:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.25)
        ax.legend(loc="upper right", fontsize=8, markerscale=3)
    axes[-1, 0].set_xlabel(xlabel)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt


def latency_cdfs(
    path: Path,
    title: str,
    panels: Mapping[str, Mapping[str, Sequence[float]]],
    xlabel: str = "latency (ms, log scale)",
) -> Path:
    """One panel per key of ``panels`` (e.g. "16 clients"), one CDF line per system."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items(), strict=True):
        for name, samples in series.items():
            ordered = sorted(s for s in samples if s > 0)
            if not ordered:
                continue
            ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.plot(ordered, ys, label=name)
        ax.set_xscale("log")
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of operations")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def grouped_bars(
    path: Path,
    title: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
) -> Path:
    """Bars per group (e.g. client counts), one bar per system."""
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        xs = [g + index * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def lines(
    path: Path,
    title: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    *,
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One line per series of ``(xs, ys)``."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log")
    _axes(ax, title, xlabel, ylabel, logy=logy)
    return _saved(fig, path)


def panel_lines(
    path: Path,
    title: str,
    panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    xlabel: str,
    ylabel: str,
    *,
    logy: bool = False,
) -> Path:
    """One panel per key of ``panels`` (a region, a system), one line per series."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items(), strict=True):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) < 12 else None, label=name)
        _axes(ax, panel, xlabel, ylabel, logy=logy)
    fig.suptitle(title)
    return _saved(fig, path)


def timelines(
    path: Path,
    title: str,
    panels: Mapping[str, tuple[Sequence[float], Sequence[float], Mapping[str, float]]],
    xlabel: str,
    ylabel: str,
) -> Path:
    """One panel per key of ``panels``: a step line of ``(xs, ys)`` and a dashed
    vertical line at each named moment (a kill, the first grant after it)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (panel, (xs, ys, moments)) in zip(axes[0], panels.items(), strict=True):
        ax.step(xs, ys, where="mid", label=ylabel)
        for index, (name, x) in enumerate(moments.items()):
            if math.isfinite(x):
                ax.axvline(x, linestyle="--", color=f"C{index + 1}", label=name)
        _axes(ax, panel, xlabel, ylabel)
    fig.suptitle(title)
    return _saved(fig, path)


def _axes(ax: Any, title: str, xlabel: str, ylabel: str, *, logy: bool = False) -> None:
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def _saved(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

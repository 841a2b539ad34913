"""The economy repro's figures: each arm's pool by kind over time and its purchases over time (from one
run's full results), and the TTFT CDF per arm. Agg canvas, no pyplot state (loadgen/repro/report.py)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadgen.repro.report import _figure
from loadgen.sim.economy_result import EconomyResult
from shared.policy.memory_market import SOURCES

KINDS = ("weights", "dropped", "prewarm", "adapter", "kv_used", "kv_free")  # stacked bottom to top
GIB = float(1 << 30)
# one colour per source in every panel (matplotlib's default cycle would re-colour by what a panel has)
SOURCE_COLORS = dict(zip(SOURCES, ("tab:cyan", "tab:green", "tab:red", "tab:orange", "tab:purple", "tab:blue", "tab:gray")))


def pool_series(r: EconomyResult) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Times and, per kind, the bytes summed over the GPUs at each sample time."""
    times = sorted({s.t for s in r.pool})
    at = {t: k for k, t in enumerate(times)}
    out = {kind: np.zeros(len(times)) for kind in KINDS}
    for s in r.pool:
        for kind in KINDS:
            out[kind][at[s.t]] += getattr(s, kind)
    return np.array(times), out


def purchase_series(r: EconomyResult, bin_s: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Purchases per bin by source (bin starts in seconds)."""
    end = max([p.t for p in r.purchases] + [s.t for s in r.pool] + [bin_s])
    edges = np.arange(0.0, end + bin_s, bin_s)
    out = {src: np.zeros(len(edges) - 1) for src in SOURCES}
    for p in r.purchases:
        k = min(int(p.t // bin_s), len(edges) - 2)
        out[p.source][k] += 1
    return edges[:-1], out


def stacked_panels(path: Path, panels: Sequence[tuple[str, np.ndarray, dict[str, np.ndarray]]], kinds: Sequence[str],
                   ylabel: str, xlabel: str) -> Path:
    """One panel per (title, times, series by kind): the kinds stacked bottom to top over the times."""
    fig = _figure(5.2 * len(panels), 3.8)
    axes = np.atleast_1d(fig.subplots(1, len(panels), sharey=True))
    for ax, (title, t, by) in zip(axes, panels):
        ax.stackplot(t, *[by[k] for k in kinds], labels=kinds, step="post")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return path


def pool_plot(path: Path, results: dict[str, EconomyResult], arms: Sequence[str]) -> Path:
    panels = []
    for arm in (a for a in arms if a in results):
        t, by = pool_series(results[arm])
        panels.append((f"{arm}: device memory by kind (all GPUs)", t / 60.0, {k: v / GIB for k, v in by.items()}))
    return stacked_panels(path, panels, KINDS, "GiB", "minutes")


def purchases_plot(path: Path, results: dict[str, EconomyResult], arms: Sequence[str], bin_s: float = 60.0) -> Path:
    arms = [a for a in arms if a in results]
    fig = _figure(5.2 * len(arms), 3.6)
    axes = np.atleast_1d(fig.subplots(1, len(arms), sharey=True))
    for ax, arm in zip(axes, arms):
        t, by = purchase_series(results[arm], bin_s)
        bottom = np.zeros(len(t))
        for src in SOURCES:
            if by[src].any():
                ax.bar(t / 60.0, by[src], width=bin_s / 60.0, bottom=bottom, align="edge", label=src,
                       color=SOURCE_COLORS[src])
                bottom += by[src]
        ax.set_title(f"{arm}: memory bought per {bin_s:g} s, by source", fontsize=9)
        ax.set_xlabel("minutes")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("purchases")
    fig.tight_layout()
    fig.savefig(path)
    return path


def ttft_cdf(path: Path, results: dict[str, EconomyResult]) -> Path:
    fig = _figure(6.4, 4.0)
    ax = fig.subplots()
    for arm, r in results.items():
        v = np.sort(r.ttft[~np.isnan(r.ttft)])
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, lw=1.1, label=arm)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.set_ylim(0.9, 1.0005)
    ax.set_title("TTFT tail per arm (one seed, the headline rate)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


__all__ = ["KINDS", "pool_plot", "pool_series", "purchase_series", "purchases_plot", "stacked_panels", "ttft_cdf"]

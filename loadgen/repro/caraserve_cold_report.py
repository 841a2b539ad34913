"""The cold-start part of `tidal repro caraserve`'s report: Fig. 10 (CDFs of TTFT, time per token and
request latency per mode), Fig. 11 (prefill and decode iteration latency per mode), Fig. 13/14-style
overhead bars per workload, the tables and the summary's entries."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loadgen.repro.caraserve_cold import (CPU_CORES, CPU_FLOPS_PER_CORE, INVOKE_S, MODES, PAPER, PAPER_EFFECTIVE_BPS,
                                          ColdRun)
from loadgen.repro.report import _figure, md_table

LINK_LABEL = {"pcie-peak": "PCIe Gen4 x16 peak, 32 GB/s (A10 datasheet)",
              "paper-effective": "the paper's effective rate, 6.0 GB/s (Fig. 3-Left fit)"}


def _pick(runs: list[ColdRun], workload: str, link: str) -> ColdRun | None:
    return next((r for r in runs if r.workload == workload and r.link == link), None)


def fig10(path: Path, run: ColdRun) -> Path:
    fig = _figure(13.5, 3.6)
    axes = fig.subplots(1, 3)
    for ax, (metric, label) in zip(axes, (("ttft", "time to first token (s)"), ("tpot", "time per token (s)"),
                                          ("e2e", "request latency (s)"))):
        for mode in MODES:
            x = np.sort(getattr(run.results[mode], metric))
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), lw=1.1, label=mode)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Fig. 10 analogue: {run.workload}, loads at {LINK_LABEL[run.link]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def fig11(path: Path, run: ColdRun) -> Path:
    fig = _figure(7.5, 3.6)
    ax = fig.subplots(1, 1)
    x = np.arange(len(MODES))
    pre = [np.mean(run.results[m].prefill_iters) * 1000 for m in MODES]
    dec = [np.mean(run.results[m].decode_iters) * 1000 for m in MODES]
    ax.bar(x - 0.2, pre, 0.4, label="prefill iteration")
    ax.bar(x + 0.2, dec, 0.4, label="decode iteration")
    ax.set_xticks(x, MODES)
    ax.set_ylabel("mean latency (ms)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"Fig. 11 analogue: iteration latency, {run.workload}, {run.link}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def overhead_bars(path: Path, runs: list[ColdRun], link: str) -> Path:
    chosen = [r for r in runs if r.link == link]
    fig = _figure(max(7.0, 1.6 * len(chosen)), 3.8)
    ax = fig.subplots(1, 1)
    modes = [m for m in MODES if m != "cached"]
    x = np.arange(len(chosen))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        vals = [100 * r.overhead(mode) for r in chosen]
        ax.bar(x + (j - (len(modes) - 1) / 2) * width, np.clip(vals, -100, 1000), width, label=mode)
    ax.set_xticks(x, [r.workload for r in chosen], fontsize=8)
    ax.set_ylabel("mean TTFT vs cached (%, clipped at 1000)")
    ax.axhline(0, color="k", lw=0.6)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"TTFT overhead per workload (Fig. 13/14 analogue), loads at {link}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def cold_section(out: Path, runs: list[ColdRun], plots: bool) -> tuple[list[str], dict]:
    """Report lines and the summary's "cold_start" entry."""
    if not runs:
        return [], {}
    figures = []
    head = _pick(runs, "synthetic-r64", "pcie-peak") or runs[0]
    if plots:
        fig10(out / "cold_fig10_cdf.png", head)
        fig11(out / "cold_fig11_iterations.png", head)
        figures = ["cold_fig10_cdf.png", "cold_fig11_iterations.png"]
        for link in sorted({r.link for r in runs}):
            overhead_bars(out / f"cold_overheads_{link}.png", runs, link)
            figures.append(f"cold_overheads_{link}.png")
    rows = []
    for r in runs:
        paper = PAPER.get(r.workload, {})
        for m in MODES:
            if m == "cached":
                continue
            res = r.results[m]
            rows.append((r.workload, r.link, m, f"{100 * r.overhead(m, 'ttft'):+.0f}%",
                         f"{100 * paper[m]:+.0f}%" if m in paper else "",
                         f"{100 * r.overhead(m, 'tpot'):+.0f}%", f"{100 * r.overhead(m, 'e2e'):+.0f}%",
                         f"{np.mean(res.prefill_iters) * 1000:.1f}", f"{np.mean(res.decode_iters) * 1000:.1f}",
                         res.loads))
    base = head.results["cached"]
    lines = [
        "## Cold start (§7.2, Fig. 10/11/13/14), one server", "",
        "Cached / OnDemand (the prefill iteration loads the adapter, the batch waits) / S-LoRA (the same, MBGMV) / "
        "async (ours without CPU assist: the load runs beside, only its request waits) / CaraServe (CPU LoRA while "
        "it loads; the GPU takes over when it lands). Overheads: mean over requests against Cached's mean (the "
        "paper's \"on average\"). loadgen/repro/caraserve_cold.py.", "",
        f"Headline ({head.workload}, {head.link}): Cached mean TTFT {np.mean(base.ttft) * 1000:.0f} ms, time per "
        f"token {np.mean(base.tpot) * 1000:.1f} ms; a rank-64 load {head.load_s_rank64 * 1000:.1f} ms.", "",
        md_table(("workload", "loads", "mode", "TTFT vs cached", "paper", "TPOT vs cached", "E2E vs cached",
                  "prefill iter ms", "decode iter ms", "loads"), rows), "",
        *[f"![{f}]({f})" for f in figures], "",
        "Setting: engine mode, every arm: LightLLM-like iterations (new requests' prefill first, as CaraServe's "
        "LightLLM-based engine and its baselines run them; the same for all five modes); step costs from the LoRA model "
        "(caraserve-a10-llama2-7b.toml) plus KV reads, a prefill iteration at least the weights read (the decode "
        f"model's beta); adapter bytes by rank (96 MiB at rank 64); CPU LoRA at {CPU_FLOPS_PER_CORE / 1e9:.1f} "
        f"GFLOP/s per core (measured here, fp32) on {CPU_CORES} cores, {INVOKE_S * 1000:g} ms invocation per "
        f"iteration (§4.2); the paper-effective link is {PAPER_EFFECTIVE_BPS / 1e9:.2f} GB/s. MAF-like workloads: "
        "Zipf popularity, bursty arrivals, an LRU of adapters over half the A10's free memory (our assumption).",
        "",
        "What decides CPU assist against waiting: a prompt of L tokens costs L x r x 1.573e6 FLOP on the CPU "
        "and its adapter r x 1.573e6 bytes on the link, so CPU assist wins when the helpers' FLOP/s over the "
        "link's bytes/s exceeds L (the rank cancels); and a CPU-assisted prefill is free while its CPU part "
        "fits under the GPU iteration (here at least the 31.8 ms weights read).", "",
    ]
    summary = {"runs": [{"workload": r.workload, "link": r.link, "load_s_rank64": r.load_s_rank64,
                         "ttft_overhead": {m: r.overhead(m) for m in MODES if m != "cached"},
                         "tpot_overhead": {m: r.overhead(m, "tpot") for m in MODES if m != "cached"},
                         "e2e_overhead": {m: r.overhead(m, "e2e") for m in MODES if m != "cached"},
                         "mean_ttft_s": {m: float(np.mean(r.results[m].ttft)) for m in MODES},
                         "mean_prefill_iter_s": {m: float(np.mean(r.results[m].prefill_iters)) for m in MODES},
                         "mean_decode_iter_s": {m: float(np.mean(r.results[m].decode_iters)) for m in MODES},
                         "loads": {m: r.results[m].loads for m in MODES}} for r in runs],
               "paper": PAPER, "cpu_flops_per_core": CPU_FLOPS_PER_CORE, "cpu_cores": CPU_CORES}
    return lines, summary


__all__ = ["cold_section", "fig10", "fig11", "overhead_bars"]

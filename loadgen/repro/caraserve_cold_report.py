"""The cold-start part of `tidal repro caraserve`'s report: Fig. 10 (CDFs of TTFT, time per token and
request latency per mode), Fig. 11 (prefill and decode iteration latency per mode), Fig. 13/14-style
overhead bars per workload, the tables and the summary's entries."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loadgen.repro.caraserve_cold import (ARMS, CPU_CORES, CPU_FLOPS_PER_CORE, FIT_RANGE, HEADLINE, INVOKE_S, MODES,
                                          PAPER, PAPER_EFFECTIVE_BPS, SATURATED_TAIL, ColdRun, pick, seed_stats)
from loadgen.repro.report import _figure, md_table

LINK_LABEL = {"pcie-peak": "PCIe Gen4 x16 peak, 32 GB/s (A10 datasheet)",
              "paper-effective": "the paper's effective rate, 6.0 GB/s (Fig. 3-Left fit)"}


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
    ax.set_xticks(x, MODES, fontsize=7, rotation=20)
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
    modes = list(ARMS)
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


def _pm(chosen: list[ColdRun], value, scale: float = 100, fmt: str = "{:+.0f}") -> str:
    mean, lo, hi = seed_stats(chosen, value)
    spread = f" [{fmt.format(scale * lo)}..{fmt.format(scale * hi)}]" if len(chosen) > 1 else ""
    return fmt.format(scale * mean) + spread


def cold_section(out: Path, runs: list[ColdRun], plots: bool) -> tuple[list[str], dict]:
    """Report lines and the summary's "cold_start" entry."""
    if not runs:
        return [], {}
    figures = []
    group = pick(runs, *HEADLINE) or [runs[0]]
    head = group[0]
    if plots:
        fig10(out / "cold_fig10_cdf.png", head)
        fig11(out / "cold_fig11_iterations.png", head)
        figures = ["cold_fig10_cdf.png", "cold_fig11_iterations.png"]
        for link in sorted({r.link for r in runs}):
            overhead_bars(out / f"cold_overheads_{link}.png", [r for r in runs if r.seed == head.seed], link)
            figures.append(f"cold_overheads_{link}.png")
    keys = list(dict.fromkeys((r.workload, r.link) for r in runs))
    rows, detail = [], []
    for workload, link in keys:
        chosen = pick(runs, workload, link)
        paper = PAPER.get(workload, {})
        sat = sum(r.saturated for r in chosen)
        rows.append((workload + (f" **saturated** ({sat}/{len(chosen)})" if sat else ""), link,
                     *[_pm(chosen, lambda r, m=m: r.overhead(m)) for m in ARMS],
                     " / ".join(f"{100 * paper[m]:+.0f}%" for m in ("caraserve", "ondemand", "slora")) if paper else "",
                     _pm(chosen, lambda r: r.cpu_share("caraserve"), fmt="{:.0f}"),
                     _pm(chosen, lambda r: r.cpu_share("caraserve-arrival"), fmt="{:.0f}"),
                     _pm(chosen, lambda r: np.mean(r.results["cached"].ttft), 1000, "{:.0f}"),
                     _pm(chosen, lambda r: np.mean(r.results["cached"].tpot), 1000, "{:.1f}")))
        detail.append((workload, link, *[_pm(chosen, lambda r, m=m: r.overhead(m, "tpot")) for m in ARMS],
                       *[_pm(chosen, lambda r, m=m: np.mean(r.results[m].prefill_iters), 1000, "{:.1f}")
                         for m in ("cached", "caraserve", "ondemand")]))
    base = head.results["cached"]
    seeds = sorted({r.seed for r in runs})
    lines = [
        "## Cold start (§7.2, Fig. 10/11/13/14), one server", "",
        "Cached / OnDemand (the prefill iteration loads the adapter, the batch waits) / S-LoRA (the same, MBGMV; "
        "against a Cached that also runs MBGMV) / async (ours without CPU assist: the load starts at arrival beside "
        "the iterations, only its request waits) / CaraServe (the load and the CPU prefill start together at "
        "admission, Fig. 1; the GPU takes over when it lands) / CaraServe-arrival (a variant: the load starts at "
        "arrival, so it mostly lands while the request waits and CPU assist is rarely needed). Overheads: mean TTFT "
        f"over requests against Cached's mean (the paper's \"on average\"), the mean over seeds {seeds} with "
        "[min..max]. CPU-assisted: the share of prefills begun with the adapter off the GPU. Saturated: Cached's "
        f"p99 TTFT above {SATURATED_TAIL:g}x its median (a queue builds). loadgen/repro/caraserve_cold.py.", "",
        f"Headline ({head.workload}, {head.link}, sustained): Cached mean TTFT {np.mean(base.ttft) * 1000:.0f} ms, "
        f"time per token {np.mean(base.tpot) * 1000:.1f} ms (seed {head.seed}); a rank-64 load "
        f"{head.load_s_rank64 * 1000:.1f} ms.", "",
        md_table(("workload", "loads", *[f"{m} TTFT %" for m in ARMS], "paper cara/ond/slora", "CPU-assisted %",
                  "CPU-assisted % (arrival)", "cached TTFT ms", "cached TPOT ms"), rows), "",
        md_table(("workload", "loads", *[f"{m} TPOT %" for m in ARMS], "cached prefill iter ms",
                  "caraserve prefill iter ms", "ondemand prefill iter ms"), detail), "",
        *[f"![{f}]({f})" for f in figures], "",
        "Setting: engine mode, every arm: LightLLM-like iterations (new requests' prefill first, as CaraServe's "
        "LightLLM-based engine and its baselines run them); step costs from the LoRA model "
        "(caraserve-a10-llama2-7b.toml) plus KV reads, a prefill iteration at least the weights read (the decode "
        f"model's beta); MBGMV's decode clamped to at least BGMV's at uniform rank beyond Fig. 5's measured batches "
        f"(decode feature {FIT_RANGE[0]}-{FIT_RANGE[1]}; the two-point lines cross at 1088, §5; "
        "loadgen/repro/caraserve_kernel.py); adapter bytes by rank (96 MiB at rank 64); CPU LoRA at "
        f"{CPU_FLOPS_PER_CORE / 1e9:.1f} GFLOP/s per core (measured here, fp32) on {CPU_CORES} cores, "
        f"{INVOKE_S * 1000:g} ms invocation per iteration (§4.2); the paper-effective link is "
        f"{PAPER_EFFECTIVE_BPS / 1e9:.2f} GB/s. MAF-like workloads: Zipf popularity, bursty arrivals, an LRU of "
        "adapters over half the A10's free memory (our assumption).", "",
        "What decides CPU assist against waiting: a prompt of L tokens costs L x r x 1.573e6 FLOP on the CPU "
        "and its adapter r x 1.573e6 bytes on the link, so CPU assist beats the load alone when the helpers' "
        "FLOP/s over the link's bytes/s exceeds L (the rank cancels); against the load plus the GPU prefill "
        "(T_cpu < X + P) it also wins while the CPU part fits under the GPU iteration (here at least the 31.8 ms "
        "weights read).", "",
    ]
    summary = {"seeds": seeds, "headline": list(HEADLINE),
               "runs": [{"workload": r.workload, "link": r.link, "seed": r.seed, "load_s_rank64": r.load_s_rank64,
                         "saturated": r.saturated,
                         "cpu_assisted_share": {m: r.cpu_share(m) for m in ("caraserve", "caraserve-arrival")},
                         "ttft_overhead": {m: r.overhead(m) for m in ARMS},
                         "tpot_overhead": {m: r.overhead(m, "tpot") for m in ARMS},
                         "e2e_overhead": {m: r.overhead(m, "e2e") for m in ARMS},
                         "mean_ttft_s": {m: float(np.mean(r.results[m].ttft)) for m in MODES},
                         "mean_prefill_iter_s": {m: float(np.mean(r.results[m].prefill_iters)) for m in MODES},
                         "mean_decode_iter_s": {m: float(np.mean(r.results[m].decode_iters)) for m in MODES},
                         "loads": {m: r.results[m].loads for m in MODES}} for r in runs],
               "paper": PAPER, "cpu_flops_per_core": CPU_FLOPS_PER_CORE, "cpu_cores": CPU_CORES}
    return lines, summary


__all__ = ["cold_section", "fig10", "fig11", "overhead_bars"]

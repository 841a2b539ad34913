"""The report of `tidal repro caraserve`: report.md (paper vs ours), Fig. 19 analogues (SLO
attainment bars and TPOT CDFs per kernel) and summary.json, under one directory."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadgen.repro.caraserve import ALPACA_OUTPUT, ALPACA_PROMPT, LORA_PROFILE, CaraRun, Headline
from loadgen.repro.report import _figure, grouped_bars, md_table

PAPER = {"slo_attainment": 0.99, "tpot_vs": {"most-idle": -0.161, "random": -0.188, "first-fit": -0.364}}
KERNEL_LABEL = {"segmented": "segmented (S-LoRA MBGMV)", "padded": "padded (Punica BGMV)"}


def _cdf_plot(path: Path, run: CaraRun) -> Path:
    kernels = sorted({k for k, _ in run.results}, reverse=True)
    fig = _figure(6.2 * len(kernels), 3.6)
    axes = np.atleast_1d(fig.subplots(1, len(kernels)))
    for ax, kernel in zip(axes, kernels):
        for (k, policy), res in run.results.items():
            if k != kernel:
                continue
            x = np.sort(np.asarray(res.tpots)) * 1000
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), lw=1.1, label=policy)
        ax.axvline(run.slo_s * 1000, color="k", ls="--", lw=0.8, label="SLO")
        ax.set_xlabel("time per token (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(KERNEL_LABEL.get(kernel, kernel), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Time per token CDF (Fig. 19 analogue)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_caraserve_report(out: Path, run: CaraRun, head: Headline, *, command: str, wall_s: float,
                           plots: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = run.cfg
    kernels = sorted({k for k, _ in run.results}, reverse=True)
    policies = [p for p in cfg.policies]
    figures = []
    if plots:
        grouped_bars(out / "slo_attainment.png", [KERNEL_LABEL.get(k, k) for k in kernels], policies,
                     [("SLO attainment", [[run.results[(k, p)].slo_attainment for p in policies] for k in kernels])],
                     "attainment", "TPOT SLO attainment (Fig. 19 analogue)", percent=True)
        grouped_bars(out / "tpot_mean.png", [KERNEL_LABEL.get(k, k) for k in kernels], policies,
                     [("mean TPOT (ms)", [[run.results[(k, p)].tpot_mean_s * 1000 for p in policies] for k in kernels])],
                     "ms", "Mean time per token")
        _cdf_plot(out / "tpot_cdf.png", run)
        figures = ["slo_attainment.png", "tpot_mean.png", "tpot_cdf.png"]
    rows = []
    for k in kernels:
        ra = run.results.get((k, "rank-aware"))
        for p in policies:
            r = run.results[(k, p)]
            vs = f"{100 * (ra.tpot_mean_s / r.tpot_mean_s - 1):+.1f}%" if ra and p != "rank-aware" else ""
            rows.append((k, p, f"{r.slo_attainment:.3f}", f"{r.tpot_mean_s * 1000:.1f}", f"{r.tpot_p50_s * 1000:.1f}",
                         f"{r.tpot_p99_s * 1000:.1f}", f"{r.ttft_p50_s * 1000:.0f}", vs, r.adapter_loads,
                         f"{r.adapter_load_s:.1f}", r.slo_penalties if p.startswith("rank-aware") else ""))
    paper_rows = [("SLO attainment, rank-aware (MBGMV)", "99%", f"{100 * head.slo_attainment:.1f}% ({head.kernel})")]
    for b, v in PAPER["tpot_vs"].items():
        ours = head.tpot_vs.get(b)
        paper_rows.append((f"mean TPOT, rank-aware vs {b} (MBGMV)", f"{100 * v:+.1f}%",
                           "n/a" if ours is None else f"{100 * ours:+.1f}%"))
    padded = run.results.get(("padded", "rank-aware"))
    if padded:
        best = min(padded.tpot_mean_s / run.results[("padded", b)].tpot_mean_s - 1
                   for b in ("most-idle", "random", "first-fit") if ("padded", b) in run.results)
        paper_rows += [("SLO attainment, rank-aware (BGMV)", "99%", f"{100 * padded.slo_attainment:.1f}%"),
                       ("mean TPOT, rank-aware vs best-case baseline (BGMV)", "up to -36.0%", f"up to {100 * best:+.1f}%")]
    n = len(run.trace.records)
    lines = [
        "# CaraServe scheduler study (§7.5, Fig. 19), simulated", "",
        f"Command: `{command}` ({wall_s:.0f} s wall).", "",
        "## Paper vs ours", "", md_table(("figure", "paper", "ours"), paper_rows), "",
        "## Every run", "",
        md_table(("kernel", "policy", "SLO attainment", "mean TPOT ms", "P50 TPOT ms", "P99 TPOT ms", "P50 TTFT ms",
                  "rank-aware vs this", "adapter loads", "load wait s", "SLO penalties"), rows), "",
        *[f"![{f}]({f})" for f in figures], "",
        "## Setting", "",
        f"- Trace: MAF-like, {cfg.adapters} functions as adapters (Zipf popularity, s = {cfg.zipf_s}), ranks "
        f"{'/'.join(map(str, cfg.ranks))} uniformly, {cfg.rate:g} RPS for {cfg.duration_s:g} s simulated, bursty "
        f"(gamma gaps, CV {cfg.arrival_cv:g}: OUR ASSUMPTION, MAF is not in the library) "
        f"({n} requests; the paper runs each workload for 5 minutes, §7.1), seed {cfg.seed}.",
        f"- {cfg.servers} simulated servers, Llama-2-7B on an A10 each (profile `a10-llama2-7b-lora`), continuous "
        "batching with chunked prefill (engine mode `chunked`, loadgen/sim/worker.py) for every policy, at most 64 "
        "sequences per batch: the routing comparison holds the engine fixed (CaraServe's own engine is LightLLM-based; "
        "its iteration order is modelled in the cold-start experiment below).",
        f"- Step time = the router's own linear model ({LORA_PROFILE.name}: decode from CaraServe Fig. 5, prefill "
        "from the A10 roofline) + KV reads (loadgen/sim/lora_worker.py).",
        "- Adapter loads: a server's first request for an adapter loads it from host memory inside the step that "
        "admits it, which waits for the load (the one movement cost model, shared/policy/movement.py: "
        "layers x q/k/v x 2 x hidden x rank x 2 B over the A10's PCIe Gen4 x16 at 32 GB/s, datasheet; a rank-64 "
        "adapter is 96 MiB, 3.1 ms). Adapters stay resident afterwards (no eviction at this scale).",
        f"- SLO: time per token <= {cfg.slo_factor:g} x HF-PEFT's ({run.peft_tpot_s * 1000:.1f} ms: merged "
        f"weights, no LoRA kernel, unloaded) = {run.slo_s * 1000:.1f} ms. A request that fails counts as a miss.",
        f"- Lengths: Alpaca-like, OUR ASSUMPTION (no published Alpaca quantiles in the trace library): prompt mean "
        f"{ALPACA_PROMPT.mean:g} (P50 {ALPACA_PROMPT.p50:g}), output mean {ALPACA_OUTPUT.mean:g} (P50 "
        f"{ALPACA_OUTPUT.p50:g}) tokens.",
        "- Policies: the live routing code (shared/policy/lora_routing.py: RankAware, MostIdle, FirstFit; "
        "shared/policy/routing.py: HashRandom), called at every arrival exactly as the dispatcher does. "
        "`rank-aware` is ours (Alg. 1's cost plus the new request's own modeled time per token); "
        "`rank-aware-strict` is Alg. 1 as published (score x requests already there: idle servers tie at 0). "
        "SLO penalties: candidates whose DecPerf(exists + r) exceeded the SLO when priced.",
        "- `--live` (the small version on a local cluster) is not built: this command only simulates.", "",
        "## Why ours differs", "",
        "With the published Fig. 5 slopes the LoRA term is small next to the weights read (a full batch of 64 at "
        "rank 64 adds 16 ms to a 32 ms step with BGMV, 10 ms with MBGMV), so among the balanced policies the "
        "rank mix moves time per token by a few percent; the segmented kernel's cost grows with the sum of ranks, "
        "which balancing alone already spreads, so rank-aware and MostIdle nearly tie there. FirstFit packs "
        "batches full and pays for it, as in the paper. The paper's 16-19% over MostIdle/Random comes from its "
        "own profiled simulator (its Fig. 9 fit, unpublished as numbers) and its Alpaca load; neither is "
        "reproduced here, so the gap is reported, not tuned away.",
    ]
    from loadgen.repro.caraserve_cold_report import cold_section

    cold_lines, cold_summary = cold_section(out, run.cold, plots)
    lines += ["", *cold_lines]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    summary = {
        "line": head.line(), "kernel": head.kernel, "slo_attainment": head.slo_attainment,
        "tpot_vs": head.tpot_vs, "slo_s": run.slo_s, "hf_peft_tpot_s": run.peft_tpot_s, "requests": n,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "runs": [{k: v for k, v in vars_of(r).items() if k != "tpots"} for r in run.results.values()],
        "paper": PAPER, "cold_start": cold_summary,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return report


def vars_of(obj) -> dict:
    import msgspec

    return msgspec.structs.asdict(obj)

"""The report of `tidal repro kunserve`: report.md (paper vs ours, every point), Fig. 10 and Fig. 16
analogues as PNGs, and summary.json, under one directory."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec

from loadgen.repro.kunserve import LABELS, STAGE_OVERHEAD_S, Headline, KunRun
from loadgen.repro.report import grouped_bars, md_table

PAPER = {"p99_ttft_vs_replication": "8.4-27.3x", "p99_ttft_vs_migration": "23.1-47.6x",
         "p99_ttft_vs_pipeline": "2.9-52.2x", "p50_tbt_vs_replication": "1.079-1.375x (+7.9-37.5%)"}


def _figures(out: Path, run: KunRun) -> list[str]:
    systems = list(run.cfg.systems)
    names = []
    for metric, label, scale in (("ttft_p99", "P99 TTFT (s)", 1.0), ("tbt_p50", "P50 TBT (ms)", 1000.0),
                                 ("slo_violation", "SLO violations", 1.0)):
        panels = list(run.cfg.datasets)
        groups = [f"{r:g}" for r in next(iter(run.cfg.datasets.values()))]
        series = [(LABELS[s], [[getattr(run.get(d, r, s), metric) * scale for r in run.cfg.datasets[d]]
                               for d in panels]) for s in systems]
        name = f"fig10_{metric}.png"
        grouped_bars(out / name, panels, groups if len({len(v) for v in run.cfg.datasets.values()}) == 1 else
                     ["low", "mid", "high"][:len(groups)], series, label.replace(" (%)", ""),
                     f"{label} by base rate (req/s), Fig. 10 analogue", percent=metric == "slo_violation")
        names.append(name)
    if run.ablation:
        grouped_bars(out / "fig16_ablation.png", ["KunServe drop plans"], ["P50 TTFT", "P99 TTFT", "P99 TBT x10"],
                     [(p.strategy, [[p.ttft_p50, p.ttft_p99, p.tbt_p99 * 10]]) for p in run.ablation], "s",
                     "Throughput- vs memory-greedy (Fig. 16 analogue)")
        names.append("fig16_ablation.png")
    return names


def write_kunserve_report(out: Path, run: KunRun, head: Headline, *, command: str, wall_s: float,
                          plots: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    figures = _figures(out, run) if plots else []
    cfg = run.cfg
    paper_rows = [(f"P99 TTFT, {b} / KunServe (best dataset, highest rate)", PAPER[f"p99_ttft_vs_{b}"], f"{v:.1f}x")
                  for b, v in head.ttft_vs.items()]
    paper_rows.append(("P50 TBT, KunServe / replication (worst dataset, highest rate)", PAPER["p50_tbt_vs_replication"],
                       f"{head.tbt_vs_replication:.2f}x"))
    rows = [(p.dataset, f"{p.rate:g}", LABELS[p.system], f"{p.ttft_p50:.2f}", f"{p.ttft_p99:.2f}",
             f"{p.tbt_p50 * 1000:.1f}", f"{p.tbt_p99 * 1000:.1f}", f"{100 * p.slo_violation:.1f}%", p.drops,
             p.migrations) for p in run.points]
    abl = [(p.strategy, f"{p.ttft_p50:.2f}", f"{p.ttft_p99:.2f}", f"{p.tbt_p50 * 1000:.1f}", f"{p.tbt_p99 * 1000:.1f}",
            p.drops) for p in run.ablation]
    lines = [
        "# KunServe evaluation (§5, Fig. 10, Fig. 16), simulated", "",
        f"Command: `{command}` ({wall_s:.0f} s wall).", "",
        "## Paper vs ours", "", md_table(("figure", "paper (Qwen-2.5-14B, Fig. 10)", "ours"), paper_rows), "",
        "## Every point (Fig. 10)", "",
        md_table(("dataset", "base rps", "system", "P50 TTFT s", "P99 TTFT s", "P50 TBT ms", "P99 TBT ms",
                  "SLO violations", "drops", "migrations"), rows), "",
        "SLOs (5x P50 of replication at the lowest base rate, no burst): "
        + "; ".join(f"{d} TTFT {a:.2f} s, TBT {b * 1000:.0f} ms" for d, (a, b) in run.slos.items()), "",
        "## Buddy-group ablation (Fig. 16; paper: memory-greedy 1.2x P50 and P99 TTFT, 1.1x P99 TBT)", "",
        md_table(("drop plan", "P50 TTFT s", "P99 TTFT s", "P50 TBT ms", "P99 TBT ms", "drops"), abl) if abl else "(not run)",
        "", *[f"![{f}]({f})" for f in figures], "",
        "## Setting", "",
        f"- {cfg.instances} instances of Qwen-2.5-14B, one A800 80GB each, 200 Gbps RDMA (profile "
        "`a800-qwen2.5-14b`, every number cited in the file)"
        + (f"; KV budget overridden to {cfg.kv_blocks} blocks per instance" if cfg.kv_blocks else "") + ".",
        f"- Arrivals: BurstGPT-shaped, a base rate with one {cfg.burst_magnitude:g}x burst of {cfg.burst_s:g} s at "
        f"{cfg.burst_start_s:g} s, {cfg.duration_s:g} s simulated; lengths from KunServe Table 2 per dataset.",
        f"- Pipeline groups: a round costs the unsplit step with KV and prefill work divided by the stages, plus "
        f"{STAGE_OVERHEAD_S * 1000:.1f} ms per stage (calibrated to §5.2's 17.2% throughput loss of 2 stages) and an "
        "activation hop per stage over the link; victims' KV is exchanged over the link with remote attention "
        "(a round trip per layer per round) while it moves (loadgen/sim/pipeline.py, loadgen/sim/buddy_cluster.py).",
        "- KunServe: the monitor and the drop plan are the live policy code (shared/policy/kunserve_monitor.py, "
        "shared/policy/kunserve.py); restore reloads dropped layers over PCIe and moves the KV back over the link.",
        "- Llumnix (pipeline): static 2-stage groups (the size KunServe's plan picks under one throttling, §5.1).",
        "- `--live` (a small run on a local cluster) is not built: this command only simulates.", "",
        "## Why ours differs", "",
        "In this profile's roofline (prefill at 50% of 312 TFLOPS, decode at 77% of 2,039 GB/s) a burst on 8 "
        "A800s runs out of compute (prefill) before it runs out of KV memory: 233k tokens of KV per instance hold "
        "more requests than the GPU can prefill and decode at the burst's rate. Dropping layers then adds memory "
        "that the queue can only partly use and costs pipeline throughput, so KunServe cuts the tail far less than in the "
        "paper, whose testbed throttles on memory (its Fig. 1: KV provisioned at 2.1x the average need). With "
        "tight KV memory (`--scale tiny`: 400 blocks per instance) the drop does cut P99 TTFT against "
        "replication, which is the mechanism the paper measures. The gap is reported, not tuned away.",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    summary = {"line": head.line(), "ttft_vs": head.ttft_vs, "tbt_vs_replication": head.tbt_vs_replication,
               "slos": run.slos, "points": [msgspec.structs.asdict(p) for p in run.points],
               "ablation": [msgspec.structs.asdict(p) for p in run.ablation], "paper": PAPER}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return report

"""The report of `tidal repro mell`: report.md (paper vs ours, per-scenario figures), PNG
analogues of MELL Figs. 11-15 and summary.json, under one directory."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadgen.repro.mell import Headline, ReproConfig, Scenario, batched_mell, gpus_needed
from loadgen.repro.mell_core_report import INTRO as CORE_INTRO
from loadgen.repro.mell_core_report import core_table
from loadgen.repro.report import grouped_bars, md_table, timelines
from shared.policy.binpack_baselines import PAPER_BASELINES as BASELINES

RESTART = ("BF-restart", "WF-restart")  # ablation rows, not the paper's baselines

SEMANTICS = [
    "- Baselines as §VIII-B defines them. **BF** / **WF**: best / worst fit, never migrate; \"sufficient "
    "memory\" is the request's final KV footprint (prompt + output), reserved at admission, because without "
    "migration a GPU can only keep its admitted requests fitting as they grow by reserving that growth (a real "
    "system reserves prompt + max_tokens). The reservation counts against capacity but not as memory in use. "
    "**LB**: worst fit at the current KV size plus Llumnix-style KV migration (pair the fullest GPU with the "
    "emptiest each interval, migrate out of a GPU its requests outgrew, de-fragment for an arrival that fits "
    "nowhere). All activate a GPU when no GPU fits an arrival and terminate a GPU when it is idle.",
    "- **BF-restart** / **WF-restart** (ablation, outside the paper): admit at the current size; when requests "
    "outgrow a GPU, preempt its newest requests and restart them on another GPU by the same fit rule — "
    "unlimited repacking that pays a re-prefill per restart (not counted as migrations; listed as restarts/s).",
    "- MELL: size class by the request's current KV size (its growth past a granule is an Update); operations "
    "batched per planning interval (§VI); tiny requests bundled into multi-items.",
]


def _pct(v: float) -> str:
    return f"{100 * v:+.0f}%"


def _span(values: list[float], pct: bool = True) -> str:
    f = _pct if pct else (lambda v: f"{100 * v:.0f}%")
    return f"{f(min(values))} .. {f(max(values))} (mean {f(float(np.mean(values)))})"


def paper_vs_ours(scenarios: list[Scenario], head: Headline) -> str:
    rel = {b: [gpus_needed(s.results["MELL"]) / gpus_needed(s.results[b]) - 1 for s in scenarios] for b in BASELINES}
    util_m = [s.util("MELL") for s in scenarios]
    util_b = {b: [s.util(b) for s in scenarios] for b in BASELINES}
    gain = [s.util("MELL") - max(s.util(b) for b in BASELINES) for s in scenarios]
    gain_max = [s.util("MELL") - min(s.util(b) for b in BASELINES) for s in scenarios]
    fewer_than_lb = sum(s.rate("MELL") < s.rate("LB") for s in scenarios)
    mean_rel = {b: [s.results["MELL"].mean_devices() / s.results[b].mean_devices() - 1 for s in scenarios]
                for b in BASELINES}
    restart_rel = {b: [gpus_needed(s.results["MELL"]) / gpus_needed(s.results[b]) - 1 for s in scenarios]
                   for b in RESTART if b in scenarios[0].results}

    def cuts(kind: str) -> str:
        c = [1 - s.results[batched_mell(s)].moves / s.results["MELL-nobatch"].moves for s in scenarios
             if s.workload.kind == kind and s.results["MELL-nobatch"].moves]
        return f"{100 * min(c):.0f}% .. {100 * max(c):.0f}%" if c else "n/a"

    rows = [
        ("GPUs needed, MELL vs BF", "over 20% fewer (§VIII-C); 9-31% fewer over all baselines (abstract)", _span(rel["BF"])),
        ("GPUs needed, MELL vs WF", "over 20% fewer (§VIII-C)", _span(rel["WF"])),
        ("GPUs needed, MELL vs LB", "up to 15% fewer (§VIII-C)", _span(rel["LB"])),
        ("GPUs time-averaged, MELL vs BF / WF / LB", "not reported (Fig. 15 shows MELL lowest throughout)",
         " / ".join(_span(mean_rel[b]) for b in BASELINES)),
        *[(f"GPUs needed, MELL vs {b} (ablation)", "not in the paper", _span(v)) for b, v in restart_rel.items()],
        ("MELL memory utilisation", "lowest average 88% (§VIII-C, Fig. 14)", _span(util_m, pct=False)),
        ("baselines' utilisation", "peak ~80%; BF as low as 65% at Poisson high (Fig. 14)",
         "; ".join(f"{b} {min(v) * 100:.0f}..{max(v) * 100:.0f}%" for b, v in util_b.items())
         + " (BF/WF in use + reserved: " + "; ".join(
             f"{b} {min(s.reserved_share(b) for s in scenarios) * 100:.0f}.."
             f"{max(s.reserved_share(b) for s in scenarios) * 100:.0f}%" for b in ("BF", "WF")) + ")"),
        ("utilisation gain of MELL (points)", "8-28% (§VIII-C); 10-43% (abstract)",
         f"{100 * min(gain):+.0f} .. {100 * max(gain_max):+.0f} (vs best .. worst baseline)"),
        ("migration frequency", "MELL below LB in every workload; BF/WF 0 (Fig. 12)",
         f"MELL below LB in {fewer_than_lb}/{len(scenarios)}; BF/WF 0 (they reserve growth, never overflow)"),
        ("migrations removed by batching, Poisson", "up to 30% (Fig. 13)", cuts("poisson")),
        ("migrations removed by batching, Azure", "up to 25% (Fig. 13)", cuts("azure")),
        ("most migrations caused by one operation", "at most 10 (Theorem 3)", str(head.max_migrations_per_op)),
    ]
    return md_table(("claim", "paper", "ours"), rows)


def scenario_table(scenarios: list[Scenario]) -> str:
    rows = []
    for s in scenarios:
        r = s.results
        rows.append((s.testbed.key, s.workload.label, s.schedule.requests,
                     " / ".join(str(r[p].peak_devices()) for p in (*BASELINES, "MELL")),
                     " / ".join(f"{r[p].mean_devices():.1f}" for p in (*BASELINES, "MELL")),
                     " / ".join(f"{100 * s.util(p):.0f}" for p in (*BASELINES, "MELL")),
                     " / ".join(f"{100 * s.reserved_share(p):.0f}" for p in ("BF", "WF")),
                     f"{s.rate('LB'):.2f} / {s.rate('MELL'):.2f} / {s.rate('MELL-nobatch'):.2f}",
                     max(r[p].overcommitted_epochs for p in r)))
    return md_table(("testbed", "workload", "requests", "peak GPUs BF/WF/LB/MELL", "mean GPUs BF/WF/LB/MELL",
                     "util % BF/WF/LB/MELL", "in use + reserved % BF/WF", "migrations/s LB/MELL/MELL-nobatch",
                     "overcommitted epochs"), rows)


def restart_table(scenarios: list[Scenario]) -> str:
    """The restart ablation: what repacking by restarts (preempt the newest, re-prefill elsewhere) buys BF and WF."""
    rows = []
    for s in scenarios:
        r = s.results
        rows.append((s.testbed.key, s.workload.label,
                     " / ".join(str(r[p].peak_devices()) for p in (*RESTART, "MELL")),
                     " / ".join(f"{r[p].mean_devices():.1f}" for p in (*RESTART, "MELL")),
                     " / ".join(f"{100 * s.util(p):.0f}" for p in RESTART),
                     " / ".join(f"{s.rate(p):.2f}" for p in RESTART),
                     " / ".join(str(r[p].moves) for p in RESTART)))
    return md_table(("testbed", "workload", "peak GPUs BF-r/WF-r/MELL", "mean GPUs BF-r/WF-r/MELL",
                     "util % BF-r/WF-r", "restarts/s BF-r/WF-r", "restarts BF-r/WF-r"), rows)


def moves_table(scenarios: list[Scenario]) -> str:
    """What the moves cost each policy (loadgen/sim/kv_packing_moves.py), per scenario."""
    rows = []
    for s in scenarios:
        for p, r in s.results.items():
            st = r.move_costs
            if st is None or not (st.kv_moves or st.token_moves):
                continue
            failed = ", ".join(f"{k} {v}" for k, v in sorted(st.failed.items())) or "none"
            stalls = sorted(st.stalls)
            p99 = stalls[min(len(stalls) - 1, int(0.99 * len(stalls)))] if stalls else 0.0
            over = f"{st.physical_overcommitted_epochs} ({100 * st.overcommit_max_bytes / s.schedule.capacity:.0f}%)"
            rows.append((s.testbed.key, s.workload.label, p, st.kv_ok, failed, st.retries, st.token_moves,
                         f"{st.copy_s:.0f}", f"{st.bytes_copied / 1e9:.0f}", f"{1000 * p99:.0f}",
                         f"{st.recompute_s:.0f}", f"{max(st.delay.values(), default=0.0):.2f}",
                         over))
    return md_table(("testbed", "workload", "policy", "KV moves ok", "failed (reason)", "retries", "restarts",
                     "copy s", "GB copied", "stall P99 ms", "re-prefill s", "max delay per request s",
                     "epochs a copy overcommitted a GPU (most, % of C)"), rows)


MOVES_INTRO = (
    "Every policy's moves pay the one movement cost model (shared/policy/movement.py) over the testbed "
    "profile's kv link (MELL §VIII-B: 10 Gbps between machines): a KV migration is Llumnix's multi-stage "
    "pre-copy (the request keeps decoding, a stall for the last stage), its source stays occupied until the "
    "hand-over (a GPU being drained counts as active), and it fails when the request ends first, the pre-copy "
    "does not converge, or the destination still holds an outgoing copy (the failed move is retried the next "
    "interval). A restart re-prefills the context on the destination. The policies plan on their own books: "
    "the last column counts epochs where memory a copy still held was already given to another request (a real "
    "engine would hold that request back until the copy frees it), with the largest excess on one GPU.")


def _plots(out: Path, scenarios: list[Scenario]) -> list[str]:
    testbeds = list(dict.fromkeys(s.testbed.key for s in scenarios))
    workloads = list(dict.fromkeys(s.workload.key for s in scenarios))
    by = {(s.testbed.key, s.workload.key): s for s in scenarios}
    panels = [next(s.testbed.paper_label for s in scenarios if s.testbed.key == t) for t in testbeds]
    labels = [next(s.workload.label for s in scenarios if s.workload.key == w) for w in workloads]

    def values(fn) -> list[list[float]]:
        return [[fn(by[(t, w)]) for w in workloads] for t in testbeds]

    pols = (*BASELINES, "MELL")
    grouped_bars(out / "fig11_gpus.png", panels, labels,
                 [(p, values(lambda s, p=p: s.results[p].peak_devices())) for p in pols],
                 "GPUs needed (peak)", "Fig. 11: GPUs needed")
    grouped_bars(out / "fig12_migrations.png", panels, labels,
                 [(p, values(lambda s, p=p: s.rate(p))) for p in ("BF", "WF", "LB", "MELL")],
                 "migrations / s", "Fig. 12: migration frequency (BF/WF never migrate)")
    grouped_bars(out / "fig13_batching.png", panels, labels,
                 [(p, values(lambda s, p=p: s.results[p].moves))
                  for p in ("MELL-nobatch", batched_mell(scenarios[0]))],
                 "migrations", "Fig. 13: MELL migrations without / with request-operation batching")
    grouped_bars(out / "fig14_util.png", panels, labels,
                 [(p, values(lambda s, p=p: s.util(p))) for p in pols], "GPU memory utilisation",
                 "Fig. 14: GPU memory utilisation", percent=True)
    high = "poisson-1.1" if "poisson-1.1" in workloads else workloads[0]
    tl = [by[(t, high)] for t in testbeds]
    timelines(out / "fig15_gpus_over_time.png", panels,
              [np.arange(len(s.schedule.epochs)) * s.schedule.epoch_s for s in tl],
              [(p, [s.results[p].active for s in tl]) for p in pols], "active GPUs",
              f"Fig. 15: GPUs over time, {tl[0].workload.label}")
    return ["fig11_gpus.png", "fig12_migrations.png", "fig13_batching.png", "fig14_util.png", "fig15_gpus_over_time.png"]


def write_mell_report(out: Path, scenarios: list[Scenario], cfg: ReproConfig, head: Headline, *, command: str,
                      wall_s: float, plots: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    figures = _plots(out, scenarios) if plots else []
    setup = [f"- {s.testbed.model.name} on {s.testbed.gpu}: KV capacity C = {s.testbed.capacity() / 1e9:.2f} GB "
             f"({s.testbed.capacity() // s.testbed.model.kv_bytes_per_token()} tokens of "
             f"{s.testbed.model.kv_bytes_per_token()} B), decode step {1000 * s.decode_step_s:.1f} ms "
             f"(profile `{s.testbed.profile_name}`)" for s in {sc.testbed.key: sc for sc in scenarios}.values()]
    text = "\n".join([
        "# MELL reproduction (simulated, paper scale)", "",
        f"Command: `{command}` — {wall_s:.1f} s wall.", "",
        "## Setup", "",
        *setup,
        f"- Poisson runs {cfg.poisson_duration_s:.0f} s, Azure one diurnal day compressed into "
        f"{cfg.azure_duration_s:.0f} s; LMSYS-Chat-1M lengths x10; planning interval {cfg.epoch_s} s; KV reported "
        f"in granules of C/{cfg.granule_fraction}; seed {cfg.seed}.",
        f"- GPUs needed = peak active GPUs (MELL eq. 3); utilisation = KV bytes in use / KV capacity of the active "
        f"GPUs, time-averaged, for every policy (BF/WF's reserved-but-unused bytes are not in use).",
        *SEMANTICS,
        f"- Truncated requests (longer than one GPU's KV): {sum(s.schedule.truncated for s in scenarios)}.", "",
        "## Paper vs ours", "", paper_vs_ours(scenarios, head), "",
        "## Per scenario", "", scenario_table(scenarios), "",
        *(["## MELL through the planner core vs direct", "", CORE_INTRO, "", core_table(scenarios), ""]
          if "MELL-direct" in scenarios[0].results else []),
        "## What the moves cost", "", MOVES_INTRO, "", moves_table(scenarios), "",
        *(["## Ablation: BF/WF with restarts instead of reservation", "", restart_table(scenarios), ""]
          if all(p in scenarios[0].results for p in RESTART) else []),
        *[f"![{f}]({f})" for f in figures], "",
        head.line(), ""])
    (out / "report.md").write_text(text)
    summary = {"headline": head.line(), "scenarios": [
        {"testbed": s.testbed.key, "workload": s.workload.key, "requests": s.schedule.requests,
         "duration_s": s.schedule.duration_s,
         "policies": {p: {"peak_gpus": r.peak_devices(), "mean_gpus": r.mean_devices(), "util": s.util(p),
                          "held": s.reserved_share(p),
                          "moves": r.moves, "moves_before_dedup": r.moves_before_dedup,
                          "max_moves_per_op": r.max_moves_per_op, "overcommitted_epochs": r.overcommitted_epochs,
                          "move_costs": r.move_costs.summary() if r.move_costs else None,
                          "wall_s": r.wall_s} for p, r in s.results.items()}} for s in scenarios]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return out / "report.md"

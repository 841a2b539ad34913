"""The per-arm tables of the `tidal repro mell` report (loadgen/repro/mell_report.py): GPUs at the SLO,
per scenario, what waiting and the moves cost, the planning-interval sweep, the reserving and planner-core
arms."""
from __future__ import annotations

import numpy as np

from loadgen.repro.mell import FLEET, FREE, OURS, PAPER, RESERVING, SERVICE, Scenario, batching_cut
from loadgen.repro.mell_service import tpot_p, ttft_p
from loadgen.repro.report import md_table
from loadgen.sim.kv_packing_fleet import FleetResult

MAIN = (*PAPER, "MELL")
ALL_ARMS = (*SERVICE,)


def _fleet(s: Scenario, p: str) -> FleetResult | None:
    r = s.results.get(p)
    return r if isinstance(r, FleetResult) else None


def service_table(scenarios: list[Scenario], slo) -> str:
    """Every arm's GPUs at the SLO (the pools tried) and its latency on demand."""
    rows = []
    for s in scenarios:
        for p in ALL_ARMS:
            n = s.needed.get(p)
            r = _fleet(s, p)
            if n is None or r is None:
                continue
            tried = " ".join(f"{k}{'✓' if v else '✗'}" for k, v in sorted(n.tried.items()))
            rows.append((s.testbed.key, s.workload.label, p, n.gpus if n.gpus is not None else "none (latency for GPUs)",
                         s.lower_bound, r.peak_devices(), r.peak_physical(), f"{ttft_p(r, slo):.2f}",
                         f"{1000 * tpot_p(r, slo):.1f}", f"{s.per_request(p):.2f}", tried or "—"))
    return md_table(("testbed", "workload", "arm", "GPUs at the SLO", "L2 bound", "peak on demand (Eq. 3)",
                     "peak with copies", "on demand: P99 TTFT added s", "P99 TPOT added ms", "migrations per request",
                     "pools tried"), rows)


def cost_table(scenarios: list[Scenario]) -> str:
    """Seconds of wall per arm and scenario (run on demand + pool search; the pools run in brackets): what a scale
    costs, arm by arm."""
    arms = list(dict.fromkeys(a for s in scenarios for a in s.wall_s))
    rows = [(s.testbed.key, s.workload.label, s.requests,
             *(f"{s.wall_s[a]:.0f}" + (f" ({s.needed[a].runs})" if a in s.needed else "") if a in s.wall_s else "—"
               for a in arms), f"{sum(s.wall_s.values()):.0f}") for s in scenarios]
    rows.append(("all", "", sum(s.requests for s in scenarios),
                 *(f"{sum(s.wall_s.get(a, 0.0) for s in scenarios):.0f}" for a in arms),
                 f"{sum(sum(s.wall_s.values()) for s in scenarios):.0f}"))
    return md_table(("testbed", "workload", "requests", *arms, "total s"), rows)


def scenario_table(scenarios: list[Scenario]) -> str:
    rows = []
    for s in scenarios:
        r = s.results
        rows.append((s.testbed.key, s.workload.label, s.requests,
                     f"{s.lower_bound} ({s.lower_bound_l1})",
                     " / ".join(str(r[p].peak_devices()) for p in MAIN),
                     str(r[FREE].peak_devices()) if FREE in r else "—",
                     " / ".join(f"{r[p].mean_devices():.1f}" for p in MAIN),
                     " / ".join(f"{100 * s.util(p):.0f}" for p in MAIN),
                     " / ".join(f"{s.per_request(p):.2f}" for p in ("LB", "MELL")),
                     " / ".join(f"{s.rate(p):.2f}" for p in ("LB", "MELL")),
                     f"{r['MELL-uncapped'].max_moves_per_op if 'MELL-uncapped' in r else '—'} / "
                     f"{getattr(r['MELL'], 'capped_ops', 0)}"))
    return md_table(("testbed", "workload", "requests", "L2 (L1) bound", "peak GPUs BF/WF/LB/MELL",
                     "peak GPUs MELL-free", "mean GPUs BF/WF/LB/MELL", "util % BF/WF/LB/MELL",
                     "migrations per request LB/MELL", "migrations/s LB/MELL",
                     "MELL: most moves in one op uncapped / ops at the cap of 10"), rows)


def waiting_table(scenarios: list[Scenario]) -> str:
    """What the fleet arms' requests waited: preemptions, held-back arrivals, stalls and re-prefills."""
    rows = []
    for s in scenarios:
        for p in FLEET:
            r = _fleet(s, p)
            if r is None:
                continue
            delayed = int(np.count_nonzero((r.ttft_delay > 0) | (r.tpot_delay > 0)))
            rows.append((s.testbed.key, s.workload.label, p, r.preemptions, r.held_back,
                         f"{100 * delayed / max(1, s.requests):.0f}%",
                         f"{float(np.percentile(r.ttft_delay, 99)):.2f} / {float(r.ttft_delay.max(initial=0)):.1f}",
                         f"{1000 * float(np.percentile(r.tpot_delay, 50)):.1f} / "
                         f"{1000 * float(np.percentile(r.tpot_delay, 99)):.1f}",
                         r.overcommitted_epochs))
    return md_table(("testbed", "workload", "policy", "preemptions", "arrivals held back", "requests delayed",
                     "TTFT added P99 / max (s)", "TPOT added P50 / P99 (ms per token)",
                     "epochs a GPU held more than C"), rows)


def moves_table(scenarios: list[Scenario]) -> str:
    """How each migrating arm's moves went (loadgen/sim/kv_packing_fleet.py)."""
    rows = []
    for s in scenarios:
        for p in ("LB", "LB-open", "MELL", "MELL-uncapped", OURS):
            r = _fleet(s, p)
            if r is None or r.move_costs is None:
                continue
            st = r.move_costs
            failed = ", ".join(f"{k} {v}" for k, v in sorted(st.failed.items())) or "none"
            stalls = sorted(st.stalls)
            p99 = stalls[min(len(stalls) - 1, int(0.99 * len(stalls)))] if stalls else 0.0
            rows.append((s.testbed.key, s.workload.label, p, r.decided, r.kv_migrations, r.token_migrations,
                         r.deferred, r.requeued, failed, st.retries, f"{st.copy_s:.0f}", f"{st.bytes_copied / 1e9:.0f}",
                         f"{1000 * p99:.0f}", f"{st.recompute_s:.0f}",
                         r.max_moves_per_op if r.max_moves_per_op >= 0 else r.max_moves_per_round,
                         r.capped_ops, r.removed_by_batching))
    return md_table(("testbed", "workload", "policy", "moves decided", "by KV", "by tokens", "deferred (boundaries)",
                     "waiting, moved free", "failed (reason)", "retries", "copy s", "GB copied", "stall P99 ms",
                     "re-prefill s", "most per op (LB: per round)", "capped ops", "removed by batching"), rows)


def sweep_table(scenarios: list[Scenario]) -> str:
    rows = []
    for s in scenarios:
        for sw in s.sweep:
            r = sw.result
            rows.append((s.testbed.key, s.workload.label, f"{sw.epoch_s:g}", sw.lower_bound, r.peak_devices(),
                         f"{r.mean_devices():.2f}", r.moves, f"{r.moves / s.requests:.2f}", r.kv_migrations,
                         r.token_migrations, sw.unbatched.moves if sw.unbatched is not None else "—",
                         f"{100 * sw.cut:.0f}%", f"{100 * batching_cut(r):.0f}%", r.capped_ops,
                         f"{1000 * float(np.percentile(r.tpot_delay, 99)):.1f}"))
    return md_table(("testbed", "workload", "interval s", "L2 bound", "peak GPUs", "mean GPUs", "migrations",
                     "per request", "by KV", "by tokens", "migrations op by op", "batching_cut (executed)",
                     "decided moves removed", "capped ops", "TPOT added P99 ms"), rows)


def reserve_table(scenarios: list[Scenario]) -> str:
    rows = []
    for s in scenarios:
        r = s.results
        if not all(p in r for p in RESERVING):
            continue
        rows.append((s.testbed.key, s.workload.label,
                     " / ".join(str(r[p].peak_devices()) for p in (*RESERVING, "MELL")),
                     " / ".join(f"{r[p].mean_devices():.1f}" for p in (*RESERVING, "MELL")),
                     " / ".join(f"{100 * s.util(p):.0f}" for p in RESERVING),
                     " / ".join(f"{100 * s.reserved_share(p):.0f}" for p in RESERVING)))
    return md_table(("testbed", "workload", "peak GPUs BF-r/WF-r/MELL", "mean GPUs BF-r/WF-r/MELL",
                     "util % BF-r/WF-r", "in use + reserved % BF-r/WF-r"), rows)


def core_table(scenarios: list[Scenario]) -> str:
    rows = []
    for s in scenarios:
        core = s.results.get("MELL-core")
        if core is None:
            continue
        mell = s.results["MELL"]
        rows.append((s.testbed.key, s.workload.label, f"{core.peak_devices()} / {mell.peak_devices()}",
                     f"{core.mean_devices():.2f} / {mell.mean_devices():.2f}", f"{core.moves} / {mell.moves}",
                     f"{core.wall_s:.1f} / {mell.wall_s:.1f}"))
    return md_table(("testbed", "workload", "peak GPUs core/fleet", "mean GPUs core/fleet", "migrations core/fleet",
                     "wall s core/fleet"), rows)


MOVES_INTRO = (
    "Every policy's moves pay the one movement cost model (shared/policy/movement.py) over the testbed profile's "
    "kv link (MELL §VIII-B: 10 Gbps between machines). KV: Llumnix's multi-stage pre-copy, one copy at a time per "
    "interface and direction, the destination reserving the blocks and the source keeping them until the hand-over, "
    "then a stall. Tokens: the source frees the KV at once, the destination re-prefills the context (the request "
    "stalls for it). MELL picks per move within its boundaries (§V): KV while the interfaces' bytes this interval "
    "allow, tokens while the destination's spare prefill compute allows (a destination idle at the boundary takes "
    "one longer re-prefill), else the move waits an interval (deferred). A failed LB move is put back; MELL's books "
    "keep the request where MELL wants it and the move is retried. A request waiting for memory moves for free "
    "(it holds no KV).")

WAITING_INTRO = (
    "A GPU whose requests' KV blocks exceed its capacity preempts its newest running request (vLLM's recompute "
    "preemption); the request waits at the head of that GPU's queue and re-prefills its prompt and generated "
    "tokens when memory frees (its later tokens shift: TPOT, or TTFT before its first). An arrival put on a GPU "
    "without room waits there (held back; e.g. MELL placing it into memory a copy still holds). Migration stalls "
    "and re-prefills count too. BF and WF get their GPU counts by letting requests wait; MELL and LB by moving "
    "them. The L2 bound holds for the undelayed stream only: a policy that delays requests can go below it.")

"""What `tidal bench lora` prints after its rounds: the arms with their spreads (Fig. 10/11) and what
the decision rule chose, from the auto engines' own measurements (shared/policy/lora_cold_choice.py)."""
from __future__ import annotations

import statistics

from tidal.bench.lora_stats import mode_stats, round_overheads, spread


def fmt(values: list[float], scale: float, unit: str) -> str:
    if not values:
        return "n/a"
    med, lo, hi = spread(values)
    sign = "+" if unit == "%" else ""
    return f"{med * scale:{sign}.0f}{unit} [{lo * scale:{sign}.0f}..{hi * scale:{sign}.0f}]"


def print_report(rounds: list[dict], modes: list[str], steps: dict[str, dict[str, list[float]]],
                 baselines: dict[str, str]) -> dict:
    over = round_overheads(rounds, modes, "mean", baselines)
    print("median over rounds [min..max] of each round's mean (overheads: of the same requests under the Cached "
          "on the mode's kernel)")
    width = max(10, *(len(m) for m in modes))
    for which in ("cold", "warm"):
        if not any(r["cold"] == (which == "cold") for r in rounds[0]["cached"]):
            continue
        print(f"  {which} requests:")
        for mode in modes:
            ttft, tpot, e2e = (mode_stats(rounds, mode, k, which, "mean") for k in ("ttft_s", "tpot_s", "e2e_s"))
            line = (f"    {mode:<{width}} TTFT {fmt(ttft, 1000, ' ms'):<22} TPOT {fmt(tpot, 1000, ' ms'):<20} "
                    f"E2E {fmt(e2e, 1000, ' ms'):<22}")
            if not mode.startswith("cached"):
                o = over[mode]
                line += f"  vs {baselines.get(mode, 'cached')}: " + "  ".join(
                    f"{k.split('_')[0].upper()} {fmt(o.get(f'{k}_{which}', []), 100, '%')}"
                    for k in ("ttft_s", "tpot_s", "e2e_s"))
            print(line)
    print("  server side (Fig. 11): mean step time with a prefill chunk / decode-only, ms")
    for mode in modes:
        pre, dec = steps[mode]["prefill"], steps[mode]["decode"]
        print(f"    {mode:<{width}} prefill iteration {statistics.fmean(pre) * 1000 if pre else float('nan'):7.1f}"
              f"   decode iteration {statistics.fmean(dec) * 1000 if dec else float('nan'):7.1f}")
    return over


def rule_view(engine, typical: int, rank: int, nbytes: int) -> dict:  # type: ignore[no-untyped-def]
    """An engine's decisions and its measured T_cpu, X, P for the typical prompt and a rank-`rank` adapter."""
    costs = engine.cold.costs
    x = costs.links.seconds("pageable", nbytes)
    t_cpu, p = costs.cpu_s(typical, rank, x), costs.prefill_s(typical)
    return {"choices": dict(costs.counts), "t_cpu_s": t_cpu, "t_cpu_all_chunks_s": costs.cpu_s(typical, rank),
            "x_s": x, "p_s": p, "rule": None if t_cpu is None else ("cpu_assist" if t_cpu < x + (p or 0.0) else "load"),
            "last": None if costs.last is None else costs.last.reason, "fits": costs.summary()}


def print_choices(views: dict[str, dict], typical: int, rank: int, prefill_s: float) -> None:
    """Per CPU arm: what the helpers cost the typical prompt (the ratio it ran at, measured) and, for the
    auto arms, what the rule chose."""
    for mode, v in views.items():
        t, full, x, p = v["t_cpu_s"], v["t_cpu_all_chunks_s"], v["x_s"], v["p_s"]
        ms = (lambda s: "n/a" if s is None else f"{s * 1000:.1f} ms")
        ratio = "n/a" if full is None else f"{full / prefill_s:.2f}"
        line = (f"  {mode}: a {typical}-token rank-{rank} prompt's prefill with every chunk on the helpers "
                f"{ms(full)} (x{ratio} the calibrated prefill); the rule's T_cpu (the device taking over once the "
                f"load lands) {ms(t)}, X {ms(x)}, P {ms(p)}")
        if mode.startswith("auto"):
            c = v["choices"]
            line += (f"; the rule chose cpu_assist {c['cpu_assist']}, async {c['async']}, inline {c['inline']} times"
                     f" (for this prompt now, alone: {v['rule'] or 'n/a'}; last: {v['last']})")
        print(line)

"""`tidal trace burstgpt|azure|maf|poisson|mixed|prefix-chat|prefix-system [options] --out FILE`, `tidal trace info FILE`.

Writes a seeded trace as JSONL (docs/loadgen.md). `burstgpt --csv` and `azure --csv`
import the public trace files instead of generating. Requests name the models of the
cluster config (`--config`, default the embedded one) unless told otherwise, so a trace
made with the defaults runs against that cluster as it is (`tidal bench serve`).
"""
from __future__ import annotations

import argparse
import re
import sys

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h|d|w)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0}


def duration(text: str) -> float:
    """Seconds from '90', '90s', '15m', '1h', '7d' or '1w'."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 600, 90s, 15m, 1h, 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return names


def config_models(config: str | None) -> list[str]:
    """The models of a cluster config, its default model first: the first `[[models]]` entry
    a `[[workers]]` entry serves (else the first entry), then the others in file order."""
    from shared.config import load_config

    cfg = load_config(config)
    names = [m.name for m in cfg.models]
    if not names:
        raise ValueError(f"the config {config or '(embedded default)'} has no [[models]]: name them with --model")
    served = {m for w in cfg.workers for m in w.models}
    first = next((n for n in names if n in served), names[0])
    return [first] + [n for n in names if n != first]


def _default_model(args: argparse.Namespace) -> str:
    return args.model or config_models(args.config)[0]


def _models(args: argparse.Namespace) -> list[str]:
    """--model-names, else the config's models (the first --models of them when given)."""
    if args.model_names:
        return list(args.model_names)
    names = config_models(args.config)
    if args.models is None:
        return names
    if args.models > len(names):
        raise ValueError(f"--models {args.models}: the config has {len(names)} ({', '.join(names)}); "
                         "name more with --model-names")
    return names[: args.models]


def _burst(text: str):
    from loadgen.traces.schema import Burst

    try:
        start, dur, mag = text.split(":")
        return Burst(start_s=duration(start), duration_s=duration(dur), magnitude=float(mag))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"bad burst {text!r}: use START:DURATION:MAGNITUDE, e.g. 120:30:14") from None


def _pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: use LO:HI, e.g. 48:128") from None
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: need 0 <= LO <= HI")
    return lo, hi


def _common(p: argparse.ArgumentParser, *, rate: float, dur: str) -> None:
    p.add_argument("--out", required=True, help="trace file to write (JSONL)")
    p.add_argument("--config", default=None,
                   help="cluster TOML whose models the requests name by default (default: the embedded one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=duration, default=None,
                   help=f"trace length (default {dur}; for --csv: the window's length, default all of it)")
    p.set_defaults(default_duration=duration(dur))
    p.add_argument("--rate", type=float, default=rate, help=f"requests per second (default {rate})")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="divide arrival times by this after generating (2 = twice the rate, half the time)")


def register(sub: argparse._SubParsersAction) -> None:
    from typing import get_args

    from loadgen.traces.schema import LengthDataset  # no numpy at parser build time

    parser = sub.add_parser("trace", help="generate a request trace (JSONL) or import a public one")
    kinds = parser.add_subparsers(dest="trace_kind", metavar="KIND")
    datasets = sorted(get_args(LengthDataset))

    p = kinds.add_parser("burstgpt", help="base rate with sudden bursts; lengths from KunServe Table 2")
    _common(p, rate=2.0, dur="10m")
    p.add_argument("--bursts", type=int, default=2, help="bursts placed at seeded random times (default 2)")
    p.add_argument("--burst-duration", type=duration, default=30.0)
    p.add_argument("--burst-magnitude", type=float, default=14.0, help="rate multiplier in a burst (default 14)")
    p.add_argument("--burst-ramp", type=duration, default=2.0, help="rise/fall time of a burst (default 2s)")
    p.add_argument("--burst", type=_burst, action="append", default=None, metavar="START:DUR:MAG",
                   help="an explicit burst (repeatable); replaces --bursts")
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gaps (1 = Poisson)")
    p.add_argument("--dataset", choices=datasets, default="burstgpt")
    p.add_argument("--model", default=None,
                   help="model name (default: the config's default model; for --csv: keep the CSV's)")
    p.add_argument("--csv", help="import a BurstGPT CSV instead of generating")
    p.add_argument("--model-map", type=_names, default=None, help="CSV model renames, e.g. ChatGPT=llama,GPT-4=qwen")
    p.add_argument("--log-type", default=None, help="keep only this Log Type (CSV)")
    p.add_argument("--keep-failed", action="store_true", help="keep CSV rows with 0 response tokens")
    p.add_argument("--start", type=duration, default=None, help="CSV window start (seconds from its first row)")
    p.add_argument("--kunserve-segment", action="store_true",
                   help="CSV: the segment KunServe's code replays (775 rows from row 474438, timestamps / 10)")
    p.set_defaults(func=run_burstgpt)

    p = kinds.add_parser("azure", help="multi-model conversation/code load, daily and weekly periodicity")
    _common(p, rate=1.0, dur="1d")
    p.add_argument("--models", type=int, default=None, help="the first N of the config's models (default: all)")
    p.add_argument("--model-names", type=_names, default=None, help="comma-separated model names (overrides --models)")
    p.add_argument("--alpha", type=float, default=0.5, help="power-law exponent of per-model rates")
    p.add_argument("--kinds", type=_names, default=["conv"], help="conv, code or conv,code (cycled over models)")
    p.add_argument("--daily-amplitude", type=float, default=0.6)
    p.add_argument("--peak-hour", type=float, default=14.0)
    p.add_argument("--weekend-factor", type=float, default=0.6)
    p.add_argument("--phase-jitter-h", type=float, default=1.5)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--csv", help="import an Azure LLM inference trace CSV instead of generating")
    p.add_argument("--model", default=None, help="model name for CSV requests (default: the config's default model)")
    p.add_argument("--start", type=duration, default=None, help="CSV window start (seconds from its first row)")
    p.set_defaults(func=run_azure)

    p = kinds.add_parser("maf", help="many LoRA adapters with Zipf popularity, Poisson arrivals")
    _common(p, rate=6.0, dur="5m")
    p.add_argument("--adapters", type=int, default=2000)
    p.add_argument("--zipf-s", type=float, default=1.0, help="popularity exponent")
    p.add_argument("--models", type=int, default=1, help="base models: the first N of the config's (default 1)")
    p.add_argument("--model-names", type=_names, default=None, help="comma-separated base model names")
    p.add_argument("--ranks", type=_names, default=["8", "16", "32", "64"])
    p.add_argument("--base-fraction", type=float, default=0.0, help="share of requests without an adapter")
    p.add_argument("--dataset", choices=datasets, default="burstgpt")
    p.set_defaults(func=run_maf)

    p = kinds.add_parser("mixed", help="many models (power law), Zipf adapters on some, diurnal drift, bursts, "
                                       "short and long requests")
    _common(p, rate=10.0, dur="1h")
    p.add_argument("--models", type=int, default=8, help="models, named model-0.. (default 8)")
    p.add_argument("--model-names", type=_names, default=None, help="comma-separated model names (overrides --models)")
    p.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of model popularity")
    p.add_argument("--period", type=duration, default=3600.0, help="diurnal period (default 1h: a compressed day)")
    p.add_argument("--daily-amplitude", type=float, default=0.5)
    p.add_argument("--phase-spread", type=float, default=0.25, help="per-model phase, +- this fraction of a period")
    p.add_argument("--cv", type=float, default=1.5, help="coefficient of variation of gaps (1 = Poisson)")
    p.add_argument("--bursts", type=int, default=3, help="bursts, each on a seeded model (default 3)")
    p.add_argument("--burst-duration", type=duration, default=60.0)
    p.add_argument("--burst-magnitude", type=float, default=8.0, help="the model's rate multiplier in a burst")
    p.add_argument("--adapter-models", type=int, default=2, help="models carrying adapters, a seeded choice")
    p.add_argument("--adapter-model-names", type=_names, default=None, help="comma-separated (overrides the count)")
    p.add_argument("--adapters-per-model", type=int, default=100)
    p.add_argument("--zipf-s", type=float, default=1.0, help="adapter popularity exponent")
    p.add_argument("--adapter-fraction", type=float, default=0.8, help="share of an adapter model's requests "
                                                                       "naming an adapter")
    p.add_argument("--ranks", type=_names, default=["8", "16", "32", "64"])
    p.add_argument("--dataset", choices=datasets, default="azureconv", help="lengths of short requests")
    p.add_argument("--long-fraction", type=float, default=0.1, help="share of long requests")
    p.add_argument("--long-prompt-factor", type=float, default=8.0)
    p.add_argument("--long-output-factor", type=float, default=4.0)
    p.set_defaults(func=run_mixed)

    p = kinds.add_parser("poisson", help="plain Poisson arrivals at --rate")
    _common(p, rate=1.0, dur="1m")
    p.add_argument("--model", default=None, help="model name (default: the config's default model)")
    p.add_argument("--dataset", choices=datasets, default="burstgpt")
    p.add_argument("--prompt-tokens", type=int, default=None, help="fixed prompt length")
    p.add_argument("--output-tokens", type=int, default=None, help="fixed output length")
    p.set_defaults(func=run_poisson)

    p = kinds.add_parser("prefix-chat", help="multi-turn chat: each turn's prompt is the conversation so far + "
                                             "a new user message (prefix caching; loadgen/traces/prefix.py)")
    _common(p, rate=0.2, dur="1m")  # --rate: new conversations per second
    p.add_argument("--model", default=None, help="model name (default: the config's default model)")
    p.add_argument("--turns", type=_pair, default=(3, 6), metavar="LO:HI", help="turns per conversation (default 3:6)")
    p.add_argument("--system-tokens", type=int, default=64, help="each conversation's own system prompt")
    p.add_argument("--user-tokens", type=_pair, default=(48, 128), metavar="LO:HI")
    p.add_argument("--output-tokens", type=int, default=32, help="each reply (its stand-in joins the history)")
    p.add_argument("--think", type=duration, default=4.0, help="mean gap between turns (default 4s)")
    p.set_defaults(func=run_prefix_chat)

    p = kinds.add_parser("prefix-system", help="N distinct long system prompts, many requests each (prefix caching)")
    _common(p, rate=1.0, dur="1m")
    p.add_argument("--model", default=None, help="model name (default: the config's default model)")
    p.add_argument("--prompts", type=int, default=4, help="distinct system prompts (default 4)")
    p.add_argument("--system-tokens", type=int, default=768)
    p.add_argument("--user-tokens", type=_pair, default=(32, 96), metavar="LO:HI")
    p.add_argument("--output-tokens", type=int, default=16)
    p.set_defaults(func=run_prefix_system)

    p = kinds.add_parser("info", help="summarize a trace file")
    p.add_argument("file")
    p.set_defaults(func=run_info)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _write(args: argparse.Namespace, make) -> int:
    from loadgen.traces.io import scale_time, write_trace
    from loadgen.traces.loaders import TraceCsvError
    from loadgen.traces.summary import format_summary, summarize

    try:
        trace = make()
        if args.time_scale != 1.0:
            trace = scale_time(trace, args.time_scale)
    except (ValueError, TraceCsvError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = write_trace(args.out, trace)
    print(f"wrote {path}")
    print(format_summary(summarize(trace)))
    return 0


def _window(args: argparse.Namespace) -> dict[str, float | None]:
    return {"start_s": args.start or 0.0, "duration_s": args.duration}


def _duration(args: argparse.Namespace) -> float:
    return args.duration or args.default_duration


def run_burstgpt(args: argparse.Namespace) -> int:
    from loadgen.traces.burstgpt import place_bursts
    from loadgen.traces.generate import generate
    from loadgen.traces.loaders import load_burstgpt_csv
    from loadgen.traces.schema import BurstGPTParams

    def make():
        if args.csv:
            mapping = dict(pair.split("=", 1) for pair in args.model_map or [] if "=" in pair)
            from loadgen.traces.loaders import KUNSERVE_SEGMENT
            segment = KUNSERVE_SEGMENT if args.kunserve_segment else {}
            return load_burstgpt_csv(args.csv, model=args.model,
                                     model_map=mapping, log_type=args.log_type, keep_failed=args.keep_failed,
                                     **_window(args), **segment)
        dur = _duration(args)
        bursts = args.burst if args.burst else place_bursts(args.seed, dur, args.bursts, args.burst_duration,
                                                            args.burst_magnitude, args.burst_ramp)
        return generate(BurstGPTParams(seed=args.seed, duration_s=dur, rate=args.rate, bursts=bursts,
                                       cv=args.cv, dataset=args.dataset, model=_default_model(args)))
    return _write(args, make)


def run_azure(args: argparse.Namespace) -> int:
    from loadgen.traces.generate import generate
    from loadgen.traces.loaders import load_azure_csv
    from loadgen.traces.schema import AzureParams

    def make():
        if args.csv:
            return load_azure_csv(args.csv, model=_default_model(args), **_window(args))
        bad = [k for k in args.kinds if k not in ("conv", "code")]
        if bad:
            raise ValueError(f"unknown kind(s) {bad}: use conv and/or code")
        return generate(AzureParams(
            seed=args.seed, duration_s=_duration(args), rate=args.rate, models=_models(args), alpha=args.alpha,
            kinds=args.kinds, daily_amplitude=args.daily_amplitude, peak_hour=args.peak_hour,
            weekend_factor=args.weekend_factor, phase_jitter_h=args.phase_jitter_h, cv=args.cv))
    return _write(args, make)


def run_maf(args: argparse.Namespace) -> int:
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import MAFParams

    def make():
        try:
            ranks = [int(r) for r in args.ranks]
        except ValueError:
            raise ValueError(f"--ranks must be integers, got {args.ranks}") from None
        return generate(MAFParams(seed=args.seed, duration_s=_duration(args), rate=args.rate, adapters=args.adapters,
                                  zipf_s=args.zipf_s, models=_models(args), ranks=ranks,
                                  base_fraction=args.base_fraction, dataset=args.dataset))
    return _write(args, make)


def run_mixed(args: argparse.Namespace) -> int:
    import numpy as np

    from loadgen.traces.generate import generate
    from loadgen.traces.mixed import place_model_bursts
    from loadgen.traces.schema import MixedParams

    def make():
        models = list(args.model_names) if args.model_names else [f"model-{i}" for i in range(args.models)]
        if not models:
            raise ValueError("--models must be >= 1")
        try:
            ranks = [int(r) for r in args.ranks]
        except ValueError:
            raise ValueError(f"--ranks must be integers, got {args.ranks}") from None
        if args.adapter_model_names is not None:
            adapter_models = list(args.adapter_model_names)
        else:
            if not 0 <= args.adapter_models <= len(models):
                raise ValueError(f"--adapter-models {args.adapter_models}: there are {len(models)} models")
            picked = np.random.default_rng([args.seed, 0xADA]).choice(len(models), args.adapter_models, replace=False)
            adapter_models = [models[int(i)] for i in sorted(picked)]
        dur = _duration(args)
        bursts = place_model_bursts(args.seed, dur, models, args.bursts, args.burst_duration, args.burst_magnitude)
        return generate(MixedParams(
            seed=args.seed, duration_s=dur, rate=args.rate, models=models, alpha=args.alpha, period_s=args.period,
            daily_amplitude=args.daily_amplitude, phase_spread=args.phase_spread, cv=args.cv, bursts=bursts,
            adapter_models=adapter_models, adapters_per_model=args.adapters_per_model, zipf_s=args.zipf_s,
            adapter_fraction=args.adapter_fraction, ranks=ranks, dataset=args.dataset,
            long_fraction=args.long_fraction, long_prompt_factor=args.long_prompt_factor,
            long_output_factor=args.long_output_factor))
    return _write(args, make)


def run_poisson(args: argparse.Namespace) -> int:
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import PoissonParams

    return _write(args, lambda: generate(PoissonParams(
        seed=args.seed, duration_s=_duration(args), rate=args.rate, model=_default_model(args), dataset=args.dataset,
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)))


def run_prefix_chat(args: argparse.Namespace) -> int:
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import PrefixChatParams

    return _write(args, lambda: generate(PrefixChatParams(
        seed=args.seed, duration_s=_duration(args), rate=args.rate, model=_default_model(args), turns=args.turns,
        system_tokens=args.system_tokens, user_tokens=args.user_tokens, output_tokens=args.output_tokens,
        think_s=args.think)))


def run_prefix_system(args: argparse.Namespace) -> int:
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import PrefixSystemParams

    return _write(args, lambda: generate(PrefixSystemParams(
        seed=args.seed, duration_s=_duration(args), rate=args.rate, model=_default_model(args), prompts=args.prompts,
        system_tokens=args.system_tokens, user_tokens=args.user_tokens, output_tokens=args.output_tokens)))


def run_info(args: argparse.Namespace) -> int:
    from loadgen.traces.io import TraceFormatError, read_trace
    from loadgen.traces.summary import format_summary, summarize

    try:
        trace = read_trace(args.file)
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"generator     {type(trace.header.params).__name__}")
    print(format_summary(summarize(trace)))
    return 0

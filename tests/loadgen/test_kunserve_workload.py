"""The KunServe repro's workload: 1-second bins as the harness replays BurstGPT, its ceil(f)-Bernoulli
upscaling, the long-lived base and the spikes, and a real segment through the same path."""
from __future__ import annotations

import numpy as np
import pytest

from loadgen.repro.kunserve_workload import Workload, build, burst_prefill_ratio, segment_bins, spike_windows
from loadgen.traces.burstgpt import bin_arrivals, bin_counts, spike_bins, upscale_bins
from loadgen.traces.schema import Burst, BurstGPTParams, Trace, TraceHeader, TraceRecord


def test_bins_truncate_timestamps_as_the_harness_does():
    assert bin_counts([0.1, 0.9, 1.0, 3.99], 5).tolist() == [2, 1, 0, 1, 0]
    assert bin_arrivals(np.array([2, 0, 1])).tolist() == [0.0, 0.0, 2.0]
    with pytest.raises(ValueError):
        bin_counts([-0.5])


def test_upscaling_tries_each_row_ceil_f_times_with_probability_f_over_ceil_f():
    rng = np.random.default_rng(1)
    counts = np.full(20000, 2)
    assert upscale_bins(counts, 1.0, rng).tolist() == counts.tolist()  # f = 1 keeps every row
    up = upscale_bins(counts, 2.5, rng)
    assert up.max() <= 2 * 3  # never more than ceil(f) tries per row
    assert abs(up.mean() - 5.0) < 0.05  # mean f x counts
    low = upscale_bins(counts, 0.4, rng)
    assert low.max() <= 2 and abs(low.mean() - 0.8) < 0.03
    with pytest.raises(ValueError):
        upscale_bins(counts, 0.0, rng)


def test_spike_bins_rise_by_the_magnitude_inside_a_spike_only():
    rng = np.random.default_rng(2)
    bins = np.mean([spike_bins(rng, 30, 5.0, [Burst(start_s=10, duration_s=5, magnitude=14, ramp_s=0.5)])
                    for _ in range(400)], axis=0)
    assert abs(bins[11:14].mean() - 70) < 3 and abs(bins[20:].mean() - 5) < 0.5


def test_trace_arrives_in_whole_seconds_with_spikes_in_the_window_and_a_long_lived_base():
    w = Workload()
    trace = build(w, "burstgpt", 1.0, seed=0)
    times = np.array([r.arrival_s for r in trace.records])
    assert np.all(times == np.floor(times)) and times.max() < w.duration_s
    spikes = spike_windows(w, 0)
    assert len(spikes) == w.spikes and all(w.warmup_s <= a < b <= w.duration_s for a, b in spikes)
    assert all(b2 >= a1 for (_, a1), (b2, _) in zip(spikes, spikes[1:]))  # no overlap
    long = [r for r in trace.records if r.output_tokens >= w.long_output[0]]
    assert abs(len(long) / w.duration_s - w.long_per_s) < 0.5  # the long-lived base, ~3/s at f = 1
    quiet = build(w, "burstgpt", 1.0, seed=0, spikes=False)
    assert len(quiet.records) < len(trace.records)
    twice = build(w, "burstgpt", 2.0, seed=0)
    assert 1.8 < len(twice.records) / len(trace.records) < 2.2  # the scale multiplies every stream


def _segment(times: list[float]) -> Trace:
    header = TraceHeader(params=BurstGPTParams(seed=0, duration_s=10.0, rate=1.0, bursts=[]), num_records=len(times),
                         duration_s=10.0)
    return Trace(header=header, records=[TraceRecord(arrival_s=t, model="m", prompt_tokens=100, output_tokens=10,
                                                     request_id=f"r{i}") for i, t in enumerate(times)])


def test_a_real_segment_replaces_the_spikes_through_the_same_bins_and_upscaling():
    seg = segment_bins(_segment([100.2, 100.7, 101.5, 104.0, 104.1, 104.2, 104.3]))
    assert seg == (2, 1, 0, 0, 4)
    w = Workload(warmup_s=5.0, duration_s=15.0, short_per_s=0.0001, long_per_s=0.0001, bins=seg)
    trace = build(w, "burstgpt", 1.0, seed=0)
    times = [r.arrival_s for r in trace.records]
    assert times.count(5.0) == 2 and times.count(9.0) == 4  # the segment starts at the window
    assert spike_windows(w, 0) == [(5.0, 7.0), (9.0, 10.0)]  # bins over 3x the base rate, merged


def test_burst_prefill_ratio_is_spike_prompts_over_cluster_prefill():
    trace = _segment([1.0, 1.0, 2.0, 5.0])  # 100-token prompts
    # 3 requests in [1, 3): 300 tokens at 0.01 s each on 2 instances over 2 s
    assert burst_prefill_ratio(trace, [(1.0, 3.0)], 2, 0.01) == pytest.approx(300 * 0.01 / (2 * 2.0))
    assert burst_prefill_ratio(trace, [], 2, 0.01) == 0.0

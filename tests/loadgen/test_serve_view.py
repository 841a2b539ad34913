"""`tidal bench serve`'s live table, from constructed counters: running streams count, 80 columns."""
from __future__ import annotations

from rich.console import Console

from loadgen.runner.runner import RunProgress
from tidal.bench.serve_view import LiveView, RecentRate


def test_the_table_shows_running_streams_and_fits_80_columns() -> None:
    progress = RunProgress(total=2614, sent=12345, in_flight=873, done=3610, ok=3000, failed=610, tokens=1000)
    progress.streams.events, progress.streams.streaming = 400, 16
    progress.streams.first_token_s = [17.7543, 120.1]
    progress.recent_tpot_s = [0.0312, 0.5]
    console = Console(width=80, color_system=None)
    view = LiveView(progress, "tidal bench serve burst.jsonl", console=console)
    assert view.row(now=0.0)["tok/s"] == "-"  # one sample: no rate yet
    progress.streams.events += 250  # tokens arrive on running streams: no request has to finish
    row = view.row(now=5.0)
    assert row["tok/s"] == "50.0" and row["in flight"] == "873" and row["streaming"] == "16"
    assert row["TTFT ms P50/P99"] == "68927/119077" and row["TPOT ms P50/P99"] == "266/495"
    with console.capture() as captured:
        console.print(view.table())
    text = captured.get()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for column, value in row.items():
        assert column == "tok/s" or value in text, (value, text)  # (tok/s is read again as the table is drawn)


def test_the_rate_is_over_the_window_and_never_negative() -> None:
    rate = RecentRate(window_s=5.0)
    assert rate.add(0.0, 0) is None
    assert rate.add(5.0, 100) == 20.0
    assert rate.add(10.0, 300) == 40.0  # (300 - 100) / 5: the sample at 0 s has left the window
    assert rate.add(11.0, 250) == 25.0  # (250 - 100) / 6 s
    assert rate.add(12.0, 50) == 0.0  # fewer than at the window's start (a cut stream settled): never negative

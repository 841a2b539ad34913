"""The launcher's restart policy (pure)."""
from __future__ import annotations

from tidal.restart_policy import RestartPolicy


def test_backoff_doubles_up_to_the_cap_and_gives_up_after_too_many_crashes():
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=4.0, max_crashes=4, window_s=60.0)
    delays = [policy.crashed("dispatcher", now=t, ran_s=0.5) for t in (0.0, 2.0, 5.0, 10.0)]
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert policy.crashed("dispatcher", now=15.0, ran_s=0.5) is None  # 5 crashes within 60 s
    assert policy.crashed("gateway", now=15.0, ran_s=0.5) == 1.0  # per child


def test_a_child_that_ran_a_whole_window_starts_the_backoff_over():
    policy = RestartPolicy(initial_backoff_s=1.0, max_crashes=3, window_s=60.0)
    policy.crashed("planner", now=0.0, ran_s=1.0)
    policy.crashed("planner", now=2.0, ran_s=1.0)
    assert policy.crashed("planner", now=100.0, ran_s=90.0) == 1.0
    assert policy.crashes("planner") == 1


def test_old_crashes_fall_out_of_the_window():
    policy = RestartPolicy(initial_backoff_s=1.0, max_crashes=2, window_s=10.0)
    policy.crashed("registry", now=0.0, ran_s=0.1)
    policy.crashed("registry", now=1.0, ran_s=0.1)
    assert policy.crashed("registry", now=30.0, ran_s=5.0) == 1.0  # the first two are older than the window

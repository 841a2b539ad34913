"""Property tests of MELL's scheduler over random operation sequences (allocate / grow / depart,
sizes in (0, C]), batched and one by one.

After every batch:
* Eq. 2: no device holds more than C, and the books add up;
* the returned placements and moves, replayed, give exactly the scheduler's placement;
* Theorem 1 holds up to MAX_EXCEPTIONS violations, beside the three exempt GPUs (the latest
  M-, S- and T-GPU) -- violations come only from refills the migration cap cut short, and are
  repaired by later operations;
* the GPU count bound the paper's proofs give: with no T-GPU, Lemma 2.1's |A(I)| <= W(I) + c
  (c = 2 for the latest M/S-GPU, plus one per violation); with T-GPUs, Theorem 2 case 1's
  |A(I)| <= 4/3 * S(I)/C + c (every GPU but the exempt three and the violators is >= 75% full);
* no single operation migrates more than 10 requests (Theorem 3);
* each GPU's request count (its workload priority) is the number of requests it holds.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.mell import Allocate, Depart, MellScheduler, Op, Update

C = 2400
MAX_EXCEPTIONS = 4

step = st.tuples(st.sampled_from(["alloc", "alloc", "grow", "depart"]), st.integers(0, 10**6),
                 st.integers(1, C), st.booleans())
scenario = st.tuples(st.lists(step, min_size=1, max_size=200), st.integers(1, 8))


def _batches(steps: list[tuple[str, int, int, bool]], batch: int) -> list[list[Op]]:
    live: dict[str, int] = {}
    ops: list[Op] = []
    for n, (kind, pick, size, small) in enumerate(steps):
        if small:
            size = max(1, size // 16)  # plenty of tiny and T requests too
        if kind == "alloc" or not live:
            live[f"r{n}"] = size
            ops.append(Allocate(f"r{n}", size))
            continue
        rid = sorted(live)[pick % len(live)]
        if kind == "depart":
            del live[rid]
            ops.append(Depart(rid))
        else:
            live[rid] = min(C, live[rid] + size // 3 + 1)
            ops.append(Update(rid, live[rid]))
    return [ops[i:i + batch] for i in range(0, len(ops), batch)]


def _check(s: MellScheduler, shadow: dict[str, str]) -> None:
    total = 0
    for dev in s.active_devices():
        on = s.requests_on(dev)
        assert on, f"{dev} is active but empty"
        assert s.fleet.active[dev].n_requests == len(on), f"{dev} counts {s.fleet.active[dev].n_requests} requests"
        assert s.used(dev) == sum(on.values()) <= C
        total += s.used(dev)
        for rid in on:
            assert shadow.get(rid) == dev, f"{rid}: replayed {shadow.get(rid)}, scheduler {dev}"
    assert sum(1 for _ in shadow) == sum(len(s.requests_on(d)) for d in s.active_devices())
    violations = s.theorem1_violations()
    assert not any(v.startswith("Eq. 2") for v in violations)
    assert len(violations) <= MAX_EXCEPTIONS, violations
    active = len(s.active_devices())
    if s.fleet.count("T"):
        assert active <= 4 / 3 * total / C + 3 + len(violations)
    else:
        assert active <= s.weight_lower_bound() + 2 + len(violations)


def _replay(shadow: dict[str, str], placements: dict[str, str], moves, departed: set[str]) -> None:
    for rid in departed:
        shadow.pop(rid, None)
    shadow.update(placements)
    for m in moves:
        assert shadow[m.request_id] == m.source, f"{m} does not start where {m.request_id} is"
        shadow[m.request_id] = m.destination


@settings(max_examples=200, deadline=None)
@given(scenario)
def test_batched_operation_sequences_keep_mell_invariants(sc) -> None:
    steps, batch = sc
    s = MellScheduler(C, batching=True)
    shadow: dict[str, str] = {}
    for ops in _batches(steps, batch):
        r = s.run_batch(ops)
        assert len(r.moves) <= r.moves_before_dedup <= 10 * len(ops)
        departed = {op.request_id for op in ops if isinstance(op, Depart)}
        _replay(shadow, r.placements, r.moves, departed)
        _check(s, shadow)


@settings(max_examples=200, deadline=None)
@given(scenario)
def test_every_single_operation_migrates_at_most_ten_requests(sc) -> None:
    steps, batch = sc
    s = MellScheduler(C, batching=False)
    shadow: dict[str, str] = {}
    for ops in _batches(steps, batch):
        for op in ops:
            r = s.apply(op)
            assert len(r.moves) <= 10
            _replay(shadow, r.placements, r.moves, {op.request_id} if isinstance(op, Depart) else set())
        _check(s, shadow)


@settings(max_examples=100, deadline=None)
@given(scenario, st.integers(2, 40))
def test_a_fixed_device_list_never_overfills(sc, n_devices: int) -> None:
    from shared.policy.mell import NoCapacity

    steps, batch = sc
    s = MellScheduler(C, [f"w{i}" for i in range(n_devices)])
    for ops in _batches(steps, 1):
        op = ops[0]
        if isinstance(op, (Depart, Update)) and s.device_of(op.request_id) is None:
            continue  # its allocation was refused
        try:
            s.apply(op)
        except NoCapacity:
            assert len(s.active_devices()) == n_devices
        for dev in s.active_devices():
            assert dev.startswith("w") and s.used(dev) <= C

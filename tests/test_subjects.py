"""The subject catalog as data: builders, wildcards, matching, roles (pure; no I/O)."""
from __future__ import annotations

import pytest

from shared import subjects
from shared.subjects import CATALOG, Pattern


def test_builders_give_the_documented_subjects():
    assert subjects.dispatch_submit() == "tidal.v1.dispatch.submit"
    assert subjects.worker_assign("cpu-0") == "tidal.v1.worker.cpu-0.assign"
    assert subjects.worker_ctl("cuda_3") == "tidal.v1.worker.cuda_3.ctl"
    assert subjects.request_out("cmpl-42") == "tidal.v1.req.cmpl-42.out"
    assert subjects.request_abort("cmpl-42") == "tidal.v1.req.cmpl-42.abort"
    assert subjects.worker_stats() == "tidal.v1.evt.worker.stats"
    assert subjects.worker_heartbeat() == "tidal.v1.evt.worker.heartbeat"
    assert subjects.plan_event("decided") == "tidal.v1.evt.plan.decided"
    assert subjects.registry_op("put") == "tidal.v1.registry.put"
    assert subjects.registry_changed("workers") == "tidal.v1.evt.registry.workers"
    assert subjects.health("gpu_worker") == "tidal.v1.gpu_worker.health"
    assert subjects.planner_capacity() == "tidal.v1.planner.capacity"
    assert subjects.kv_bucket("models") == "tidal_models"


def test_bad_tokens_are_refused_or_encoded():
    with pytest.raises(ValueError):
        subjects.request_out("")
    with pytest.raises(ValueError, match="unknown plan event kind"):
        subjects.plan_event("maybe")
    with pytest.raises(ValueError, match="unknown registry op"):
        subjects.registry_op("truncate")
    with pytest.raises(ValueError):
        subjects.registry_changed("secrets")
    with pytest.raises(ValueError, match="unknown service"):
        subjects.health("mailer")
    # a '.' (or a wildcard) would change the subject's shape: it is percent-encoded instead
    assert subjects.predict_forecast("qwen2.5-7b") == "tidal.v1.predict.qwen2%2E5-7b"
    assert subjects.worker_assign("a.*>") == "tidal.v1.worker.a%2E%2A%3E.assign"


@pytest.mark.parametrize("value", ["qwen2.5-0.5b", "a%b", "plain_id-1", "ünï.cödé"])
def test_subject_token_round_trips(value):
    token = subjects.subject_token(value)
    assert not set(token) & set(".*> \t")
    assert subjects.parse_subject_token(token) == value


def test_find_recovers_the_entry_and_its_tokens():
    spec, tokens = subjects.find(subjects.predict_forecast("qwen2.5"))
    assert spec.key == "predict.forecast" and tokens == {"model": "qwen2.5"}
    spec, tokens = subjects.find("tidal.v1.worker.cpu-1.ctl")
    assert spec.key == "worker.ctl" and tokens == {"worker_id": "cpu-1"}
    assert subjects.find("tidal.v1.worker.cpu-1.reboot") is None
    assert subjects.find("tidal.v2.dispatch.submit") is None


def test_catalog_entries_are_well_formed():
    templates = [s.template for s in CATALOG.values()]
    assert len(set(templates)) == len(templates)
    for spec in CATALOG.values():
        assert spec.template.startswith("tidal.v1.")
        assert spec.publishers and spec.listeners, spec.key
        assert all(tok == "*" or tok.replace("_", "").isalnum() for tok in spec.wildcard.split(".")), spec.key
        assert spec.wildcard.count("*") == len(spec.tokens)
        if spec.pattern is Pattern.REQUEST:
            assert spec.reply_type is not None, spec.key
        else:
            assert spec.reply == () and spec.queue_group is None
    for service in subjects.SERVICES:
        assert CATALOG[f"health.{service}"].listeners == {service}


def test_subject_spec_validates_itself():
    with pytest.raises(ValueError, match="not under tidal.v1"):
        subjects.Subject("x", "other.x", Pattern.PUBSUB, (), frozenset({"cli"}), frozenset({"cli"}), "d")
    with pytest.raises(ValueError, match="reply types"):
        subjects.Subject("x", "tidal.v1.x", Pattern.REQUEST, (), frozenset({"cli"}), frozenset({"cli"}), "d")
    with pytest.raises(ValueError, match="unknown roles"):
        subjects.Subject("x", "tidal.v1.x", Pattern.PUBSUB, (), frozenset({"mallory"}), frozenset({"cli"}), "d")
    with pytest.raises(TypeError, match="takes tokens"):
        CATALOG["worker.assign"].subject(request_id="r")


def test_the_flows_the_design_describes_are_in_the_catalog():
    """Spot checks of who talks to whom (DESIGN §2)."""
    pub, listen = subjects.uses("gateway")
    assert {s.key for s in pub} >= {"dispatch.submit", "request.abort"}
    assert "request.out" in {s.key for s in listen}
    pub, listen = subjects.uses("gpu_worker")
    assert {s.key for s in listen} >= {"worker.assign", "worker.ctl", "request.abort"}
    assert {s.key for s in pub} >= {"request.out", "worker.stats", "worker.heartbeat"}
    assert "worker.ctl" not in {s.key for s in pub}  # workers never command each other
    assert "worker.ctl" not in {s.key for s in subjects.uses("gateway")[0]}  # adapters only: worker.adapters
    assert CATALOG["dispatch.submit"].queue_group == "dispatcher"
    assert subjects.uses("scheduler")[0] and all(
        s.key in {"worker.ctl", "worker.adapters", "registry.get", "registry.list"} for s in subjects.uses("scheduler")[0]
    )

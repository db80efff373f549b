"""Office: the persisted wakeup queue and its dispatcher (office-scheduler spec, API.md 7).

Each test is named after the spec scenario or rule it checks. Most drive the real Store
(one transaction per call, explicit ``now``); a few run the real claim actor under
MockClock with the demo agent in a real git worktree, end to end.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio
from conftest import T0

import outpost

PROFILES = {"demo": outpost.demo_profile()}
WS = outpost.DEFAULT_WORKSPACE
MINUTE = 60
HOUR = 3600
BACKOFF = (2 * MINUTE, 10 * MINUTE, 30 * MINUTE, 2 * HOUR)


# --- helpers -------------------------------------------------------------------------------------

def call(store: outpost.Store, fn, *args, **kwargs):
    """One store function in its own transaction."""
    return store.run(fn, *args, **kwargs)[0]


def at(seconds: float = 0, base: datetime = T0) -> datetime:
    return base + timedelta(seconds=seconds)


def instant(text: str | None) -> datetime | None:
    return outpost.parse_instant(text) if text else None


def set_repository(store: outpost.Store, repo: Path | str | None, workspace_id: str | None = None, **more) -> None:
    current = call(store, store.office_settings, workspace_id)
    raw = {"repository": str(repo) if repo else None, **more}
    call(store, store.update_office_settings, workspace_id,
         outpost.normalize_settings(raw, profiles=list(PROFILES), current=current))


def new_agent(store: outpost.Store, name: str, now: datetime = T0, workspace_id: str | None = None,
              profiles=("demo",), **fields) -> str:
    raw = {"name": name, "executor": "demo", **fields}
    if raw["executor"] is None:
        del raw["executor"]
    return call(store, store.create_agent, workspace_id, outpost.normalize_agent(raw, profiles=profiles), now)["id"]


def new_task(store: outpost.Store, title: str = "task", now: datetime = T0, workspace_id: str | None = None,
             profiles=("demo",), **fields) -> str:
    fields = outpost.normalize_task({"title": title, **fields}, profiles=profiles)
    return call(store, store.create_task, workspace_id, fields, now)["id"]


def edit_task(store: outpost.Store, task_id: str, now: datetime, **changes) -> dict:
    current = call(store, store.task_fields, task_id)
    fields = outpost.normalize_task(changes, profiles=list(PROFILES), current=current)
    return call(store, store.update_task, task_id, fields, now)


def move(store: outpost.Store, task_id: str, state: str, now: datetime, by_agent: str | None = None) -> dict:
    return call(store, store.move_task, task_id, state, now, by_agent)


def wakeups(store: outpost.Store, agent_id: str | None = None, *, source: str | None = None,
            status: str | None = None, workspace_id: str | None = None) -> list[dict]:
    """Wakeups oldest first."""
    rows = call(store, store.list_wakeups, workspace_id, agent_id, status, source, 10_000)
    return sorted(rows, key=lambda w: (w["requested_at"], w["id"]))


def wakeup(store: outpost.Store, wakeup_id: str, workspace_id: str | None = None) -> dict:
    (w,) = [w for w in wakeups(store, workspace_id=workspace_id) if w["id"] == wakeup_id]
    return w


def only(rows: list[dict]) -> dict:
    assert len(rows) == 1, rows
    return rows[0]


def dispatch(store: outpost.Store, now: datetime, profiles=None) -> list[str]:
    """One dispatcher pass: the runs it queued."""
    return call(store, store.dispatch_wakeups, now, profiles or PROFILES)[0]


def enqueue(store: outpost.Store, agent_id: str, source, payload: dict, now: datetime, **kw) -> str:
    return store.run(lambda: store.enqueue_wakeup(WS, agent_id, source, payload, now, **kw).id)[0]


def routine_wake(store: outpost.Store, agent_id: str, now: datetime, routine_id: str = "r1", **payload) -> str:
    return enqueue(store, agent_id, outpost.WakeupSource.ROUTINE, {"routine_id": routine_id, **payload}, now)


def start(store: outpost.Store, run_id: str, now: datetime) -> None:
    """Admit queued runs (FIFO) until ``run_id`` is running."""
    while True:
        admitted = call(store, store.admit_next, 100, now)
        assert admitted is not None, f"run {run_id} was never admitted"
        if admitted[0] == run_id:
            return


def settle(store: outpost.Store, run_id: str, status: str, now: datetime, **kw) -> None:
    if call(store, store.get_run, run_id)["status"] == "queued":
        start(store, run_id, now)
    assert call(store, store.settle_run, run_id, outpost.RunStatus(status), now, **kw)


def activity(store: outpost.Store, code: str, workspace_id: str | None = None) -> list[dict]:
    return call(store, store.list_activity, workspace_id, code, 1000)[::-1]


def attention(store: outpost.Store, kind: str) -> list[dict]:
    return [a for a in call(store, store.list_attention, False) if a["kind"] == kind]


def office_run(store: outpost.Store, run_id: str) -> dict:
    return call(store, store.office_run, run_id)


def task(store: outpost.Store, task_id: str) -> dict:
    return call(store, store.get_task, task_id)


def agent(store: outpost.Store, agent_id: str) -> dict:
    return call(store, store.get_agent, agent_id)


def runs_of_agent(store: outpost.Store, agent_id: str) -> list[dict]:
    return call(store, store.agent_runs, agent_id, 500)


def fail_and_reschedule(store: outpost.Store, wakeup_id: str, now: datetime, error: str = "network timeout") -> dict:
    """Dispatch the wakeup at ``now``, then fail its run: the wakeup as it is afterwards."""
    (run_id,) = dispatch(store, now)
    assert wakeup(store, wakeup_id)["run_id"] == run_id
    settle(store, run_id, "failed", now, error=error, exit_code=1)
    return wakeup(store, wakeup_id)


@pytest.fixture
def office(store: outpost.Store, git_repo: Path) -> outpost.Store:
    """The store with the default workspace's repository set (Office runs need one)."""
    set_repository(store, git_repo)
    return store


# --- typed payloads and keys (pure) ------------------------------------------------------------------

PAYLOAD_EXAMPLES = {
    "routine": ({"routine_id": "r1", "variables": {"x": 1}, "missed_ticks": 2}, outpost.RoutinePayload),
    "comment": ({"task_id": "tsk_1", "comment_id": "cmt_1"}, outpost.CommentPayload),
    "agent_error": ({"agent_profile_id": "agt_1", "run_id": "out_1", "error": "boom"}, outpost.AgentErrorPayload),
    "self": ({"reason": "later", "payload": {"k": "v"}}, outpost.SelfPayload),
    "user": ({"user_id": "dashboard", "context": "look"}, outpost.UserPayload),
    "task_assigned": ({"task_id": "tsk_1"}, outpost.TaskAssignedPayload),
    "task_blockers_resolved": ({"task_id": "tsk_1", "resolved_blocker_ids": ["tsk_0"]},
                               outpost.TaskBlockersResolvedPayload),
    "task_children_completed": ({"task_id": "tsk_1"}, outpost.TaskChildrenCompletedPayload),
    "approval_resolved": ({"approval_id": "apr_1", "status": "approved", "decision_note": "ok"},
                          outpost.ApprovalResolvedPayload),
    "budget_alert": ({"agent_instance_id": "agt_1", "budget_pct": 80}, outpost.BudgetAlertPayload),
}


def test_wakeup_payload_one_dataclass_per_source():
    assert set(PAYLOAD_EXAMPLES) == {str(s) for s in outpost.WakeupSource}
    for source, (raw, cls) in PAYLOAD_EXAMPLES.items():
        typed = outpost.wakeup_payload(source, raw)
        assert type(typed) is cls
        assert dataclasses.asdict(typed) == {**dataclasses.asdict(typed), **raw}
    # Optional fields take their defaults.
    assert outpost.wakeup_payload("routine", {"routine_id": "r1"}) == outpost.RoutinePayload("r1", {}, 0)
    assert outpost.wakeup_payload("self", {"reason": "x"}).payload is None


@pytest.mark.parametrize("source, raw, words", [
    ("comment", {"task_id": "t", "comment_id": "c", "extra": 1}, "unknown keys: extra"),
    ("task_assigned", {"task_id": "t", "agent": "a"}, "unknown keys: agent"),
    ("comment", {"task_id": "t"}, "needs comment_id"),
    ("routine", {}, "needs routine_id"),
    ("task_assigned", {"task_id": 5}, "task_id has the wrong type"),
    ("budget_alert", {"agent_instance_id": "a", "budget_pct": "80"}, "budget_pct has the wrong type"),
    ("budget_alert", {"agent_instance_id": "a", "budget_pct": True}, "budget_pct has the wrong type"),
    ("routine", {"routine_id": "r", "variables": []}, "variables has the wrong type"),
    ("task_blockers_resolved", {"task_id": "t", "resolved_blocker_ids": "tsk_0"}, "wrong type"),
    ("user", {"user_id": "u", "context": 3}, "context has the wrong type"),
    ("task_assigned", ["tsk_1"], "must be an object"),
])
def test_wakeup_payload_refuses_unknown_keys_and_wrong_types(source, raw, words):
    with pytest.raises(ValueError, match=words):
        outpost.wakeup_payload(source, raw)


def test_wakeup_payload_refuses_unknown_source():
    with pytest.raises(ValueError):
        outpost.wakeup_payload("heartbeat", {})


def test_wakeup_idempotency_key_formats():
    key = outpost.wakeup_idempotency_key
    assert key("comment", {"task_id": "tsk_1", "comment_id": "cmt_9"}, "agt_a") == "comment:cmt_9"
    assert key("task_assigned", {"task_id": "tsk_1"}, "agt_a") == "task_assigned:tsk_1:agt_a"
    assert key("task_assigned", {"task_id": "tsk_1"}, "agt_b") == "task_assigned:tsk_1:agt_b"
    assert key("approval_resolved", {"approval_id": "apr_1", "status": "approved", "decision_note": ""},
               "agt_a") == "approval_resolved:apr_1"
    # Sources without a source-level key: every request counts.
    for source in ("routine", "self", "user", "task_children_completed", "budget_alert"):
        assert key(source, PAYLOAD_EXAMPLES[source][0], "agt_a") is None
    # Cron routines: routine:<routine_id>:<trigger_id>:<unix_minute>.
    due = datetime(2026, 4, 25, 9, 0, 59, tzinfo=UTC)
    assert outpost.routine_idempotency_key("r1", "trg_1", due) == f"routine:r1:trg_1:{int(due.timestamp()) // 60}"
    assert (outpost.routine_idempotency_key("r1", "trg_1", due)
            == outpost.routine_idempotency_key("r1", "trg_1", due.replace(second=0)))
    assert (outpost.routine_idempotency_key("r1", "trg_1", due)
            != outpost.routine_idempotency_key("r1", "trg_1", due + timedelta(seconds=1)))


# --- retries and rate limits (pure) ------------------------------------------------------------------

@pytest.mark.parametrize("retry_count", [0, 1, 2, 3])
def test_plan_retry_backoff_table_with_25_percent_jitter(retry_count):
    base = BACKOFF[retry_count]
    now = T0
    lo = outpost.plan_retry("network timeout", retry_count, now, -1.0)
    hi = outpost.plan_retry("network timeout", retry_count, now, 1.0)
    mid = outpost.plan_retry("network timeout", retry_count, now, 0.0)
    assert (lo.source, lo.retry_count) == ("backoff", retry_count + 1)
    assert lo.retry_at == now + timedelta(seconds=base * 0.75)
    assert hi.retry_at == now + timedelta(seconds=base * 1.25)
    assert mid.retry_at == now + timedelta(seconds=base)
    # Out-of-range jitter is clamped to +-25%.
    assert outpost.plan_retry("x", retry_count, now, 7.0).retry_at == hi.retry_at
    assert outpost.plan_retry("x", retry_count, now, -7.0).retry_at == lo.retry_at
    for j in (-0.99, -0.5, 0.3, 0.99):
        plan = outpost.plan_retry("x", retry_count, now, j)
        assert lo.retry_at <= plan.retry_at <= hi.retry_at


def test_plan_retry_escalates_after_max_retry_count_even_for_rate_limits():
    assert outpost.MAX_RETRY_COUNT == 4
    plan = outpost.plan_retry("network timeout", 4, T0, 0.0)
    assert (plan.retry_count, plan.retry_at, plan.source) == (5, None, "escalated")
    rl = outpost.plan_retry("429 Too Many Requests; Retry-After: 60", 4, T0, 0.0)
    assert (rl.retry_count, rl.retry_at, rl.source) == (5, None, "escalated")
    # Below the cap a parsed reset wins over the table, whatever the retry count.
    rl3 = outpost.plan_retry("429 Too Many Requests; Retry-After: 60", 3, T0, 0.0)
    assert (rl3.retry_count, rl3.retry_at, rl3.source) == (4, T0 + timedelta(seconds=90), "rate_limit_parsed")


def test_rate_limit_detection_words():
    for text in ("Rate limit reached", "rate_limit_error", "HTTP 429", "Too Many Requests", "Quota exceeded"):
        assert outpost.is_rate_limit(text), text
    assert not outpost.is_rate_limit("connection reset by peer")


def test_parse_rate_limit_reset_patterns():
    now = datetime(2026, 4, 25, 3, 45, tzinfo=UTC)
    parse = outpost.parse_rate_limit_reset
    # "resets at HH:MM AM/PM": wall-clock time today, the next occurrence if past.
    assert parse("rate_limit_error: resets at 4:00 AM UTC", now) == datetime(2026, 4, 25, 4, 0, 30, tzinfo=UTC)
    assert parse("rate limit; resets at 4:30 PM", now) == datetime(2026, 4, 25, 16, 30, 30, tzinfo=UTC)
    assert parse("rate limit; resets at 12:15 AM", now) == datetime(2026, 4, 26, 0, 15, 30, tzinfo=UTC)
    assert parse("rate limit; resets at 3:00 AM", now) == datetime(2026, 4, 26, 3, 0, 30, tzinfo=UTC)
    assert parse("rate limit; resets at 9:00 AM Europe/Berlin", now) == datetime(2026, 4, 25, 7, 0, 30,
                                                                                 tzinfo=UTC)
    # "Retry-After: N": N seconds from now.
    assert parse("429 Too Many Requests\nRetry-After: 3600", now) == now + timedelta(seconds=3630)
    assert parse("429; retry-after:120", now) == now + timedelta(seconds=150)
    # "try again in X minutes / seconds".
    assert parse("Rate limit reached. Please try again in 5 minutes.", now) == now + timedelta(minutes=5, seconds=30)
    assert parse("rate limit: try again in 20 seconds", now) == now + timedelta(seconds=50)
    assert parse("rate limit: try again in 1 hour", now) == now + timedelta(hours=1, seconds=30)
    # "reset_time: <unix>": epoch seconds.
    reset = datetime(2026, 4, 25, 5, 0, tzinfo=UTC)
    assert (parse(f"rate limit exceeded for org; reset_time: {int(reset.timestamp())}", now)
            == reset + timedelta(seconds=30))
    # No pattern, or already past after the buffer: None (the backoff applies).
    assert parse("rate limit exceeded", now) is None
    past = int((now - timedelta(minutes=5)).timestamp())
    assert parse(f"rate limit exceeded; reset_time: {past}", now) is None


def test_rate_limit_without_parseable_reset_falls_through_to_backoff():
    plan = outpost.plan_retry("429 Too Many Requests", 0, T0, 0.0)
    assert (plan.source, plan.retry_at) == ("backoff", T0 + timedelta(minutes=2))
    # A reset pattern without a rate-limit word is not a rate limit.
    plan = outpost.plan_retry("server said: try again in 5 minutes", 1, T0, 0.0)
    assert (plan.source, plan.retry_at) == ("backoff", T0 + timedelta(minutes=10))

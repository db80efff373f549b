"""Office: the persisted wakeup queue and its dispatcher (docs/office.md, docs/office.md).

Each test is named after the spec scenario or rule it checks. Most drive the real Store
(one transaction per call, explicit ``now``); a few run the real claim actor under
MockClock with the demo agent in a real git worktree, end to end.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import trio
from conftest import (
    HOUR,
    MINUTE,
    PROFILES,
    T0,
    OfficeApi,
    activity,
    at,
    call,
    dispatch,
    ended,
    git,
    instant,
    new_agent,
    new_task,
    office_run,
    only,
    set_settings,
    settle,
    start,
    task,
    until,
    wakeup,
    wakeups,
)

import outpost

WS = outpost.DEFAULT_WORKSPACE
BACKOFF = (2 * MINUTE, 10 * MINUTE, 30 * MINUTE, 2 * HOUR)


# --- helpers -------------------------------------------------------------------------------------

def set_repository(store: outpost.Store, repo: Path | str | None, workspace_id: str | None = None, **more) -> None:
    set_settings(store, workspace_id, repository=str(repo) if repo else None, **more)


def edit_task(store: outpost.Store, task_id: str, now: datetime, **changes) -> dict:
    current = call(store, store.office.task_fields, task_id)
    fields = outpost.normalize_task(changes, profiles=list(PROFILES), current=current)
    return call(store, store.office.update_task, task_id, fields, now)


def edit_agent(store: outpost.Store, agent_id: str, now: datetime, **changes) -> dict:
    current = call(store, store.office.agent_fields, agent_id)
    return call(store, store.office.update_agent, agent_id,
                outpost.normalize_agent(changes, profiles=list(PROFILES), current=current), now)


def move(store: outpost.Store, task_id: str, state: str, now: datetime, by_agent: str | None = None) -> dict:
    return call(store, store.office.move_task, task_id, state, now, by_agent)


def retry_due(w: dict) -> datetime:
    """The first instant the dispatcher may promote a scheduled retry (views show milliseconds)."""
    return instant(w["scheduled_retry_at"]) + timedelta(milliseconds=1)


def enqueue(store: outpost.Store, agent_id: str, source, payload: dict, now: datetime, **kw) -> str:
    return store.transaction(store.wakeups.enqueue_wakeup, WS, agent_id, source, payload, now, **kw)[0]


def routine_wake(store: outpost.Store, agent_id: str, now: datetime, routine_id: str = "r1", **payload) -> str:
    """A lightweight routine's wakeup, as its fire queues it (the routine row exists: a wakeup of a
    deleted or paused routine ends without a session)."""
    def ensure_routine():
        if store.db.Routine.get(id=routine_id) is None:
            store.db.Routine(id=routine_id, workspace_id=WS, name=routine_id, assignee_agent_id=agent_id,
                             status="active", concurrency_policy="always_enqueue", catch_up_policy="skip_missed",
                             task_template={}, variables=[], created_at=outpost.naive(now),
                             updated_at=outpost.naive(now))
    store.transaction(ensure_routine)
    return enqueue(store, agent_id, outpost.WakeupSource.ROUTINE, {"routine_id": routine_id, **payload}, now)


def attention(store: outpost.Store, kind: str) -> list[dict]:
    return [a for a in call(store, store.list_attention, False) if a["kind"] == kind]


def agent(store: outpost.Store, agent_id: str) -> dict:
    return call(store, store.office.get_agent, agent_id)


def runs_of_agent(store: outpost.Store, agent_id: str) -> list[dict]:
    return call(store, store.office.agent_runs, agent_id, 500)


def fail_and_reschedule(store: outpost.Store, wakeup_id: str, now: datetime, error: str = "network timeout") -> dict:
    """Dispatch the wakeup at ``now``, then fail its run: the wakeup as it is afterwards."""
    (run_id,) = dispatch(store, now)
    assert wakeup(store, wakeup_id)["run_id"] == run_id
    settle(store, run_id, "failed", now, error=error, exit_code=1)
    return wakeup(store, wakeup_id)


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


def test_wakeup_payload_refuses_list_of_wrong_item_type():
    with pytest.raises(ValueError, match="resolved_blocker_ids"):
        outpost.wakeup_payload("task_blockers_resolved", {"task_id": "t", "resolved_blocker_ids": [1]})


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


def test_agent_and_settings_defaults():
    worker = outpost.normalize_agent({"name": "W"}, profiles=["demo"])
    assert (worker["role"], worker["status"], worker["max_concurrent_sessions"], worker["cooldown_sec"],
            worker["skip_idle_wakeups"]) == ("worker", "idle", 1, 10, True)
    for role, skip in (("specialist", True), ("assistant", True), ("coordinator", False), ("ceo", False)):
        assert outpost.normalize_agent({"name": "x", "role": role}, profiles=[])["skip_idle_wakeups"] is skip
    with pytest.raises(outpost.ValidationFailed):
        outpost.normalize_agent({"name": "x", "status": "working"}, profiles=[])
    with pytest.raises(outpost.ValidationFailed):
        outpost.normalize_agent({"name": "x", "executor": "nope"}, profiles=["demo"])
    current = {"name": "Default", "timezone": "UTC"}
    for given, kept in ((0, 1), (-5, 1), (24, 24), (720, 720), (10_000, 720), (12.7, 12)):
        settings = outpost.normalize_settings({"recovery_lookback_hours": given}, profiles=[], current=current)
        assert settings["recovery_lookback_hours"] == kept
    assert outpost.normalize_settings({}, profiles=[], current=current)["recovery_lookback_hours"] == 24


# --- retries and rate limits (pure) ------------------------------------------------------------------

@pytest.mark.parametrize("retry_count", [0, 1, 2, 3])
def test_plan_retry_backoff_table_with_25_percent_jitter(retry_count):
    base = BACKOFF[retry_count]
    now = T0
    lo = outpost.plan_retry(retry_count, now, -1.0)
    hi = outpost.plan_retry(retry_count, now, 1.0)
    mid = outpost.plan_retry(retry_count, now, 0.0)
    assert (lo.source, lo.retry_count) == ("backoff", retry_count + 1)
    assert lo.retry_at == now + timedelta(seconds=base * 0.75)
    assert hi.retry_at == now + timedelta(seconds=base * 1.25)
    assert mid.retry_at == now + timedelta(seconds=base)
    # Out-of-range jitter is clamped to +-25%.
    assert outpost.plan_retry(retry_count, now, 7.0).retry_at == hi.retry_at
    assert outpost.plan_retry(retry_count, now, -7.0).retry_at == lo.retry_at
    for j in (-0.99, -0.5, 0.3, 0.99):
        plan = outpost.plan_retry(retry_count, now, j)
        assert lo.retry_at <= plan.retry_at <= hi.retry_at


def test_plan_retry_escalates_after_max_retry_count_even_for_limits():
    assert outpost.MAX_RETRY_COUNT == 4
    plan = outpost.plan_retry(4, T0, 0.0)
    assert (plan.retry_count, plan.retry_at, plan.source) == (5, None, "escalated")
    limited = T0 + timedelta(seconds=90)
    rl = outpost.plan_retry(4, T0, 0.0, limited)
    assert (rl.retry_count, rl.retry_at, rl.source) == (5, None, "escalated")
    # Below the cap the profile's limit end wins over the table, whatever the retry count.
    rl3 = outpost.plan_retry(3, T0, 0.0, limited)
    assert (rl3.retry_count, rl3.retry_at, rl3.source) == (4, limited, "rate_limit_parsed")


@pytest.mark.parametrize("retry_count", [0, 1, 2, 3])
def test_a_limit_whose_named_reset_has_passed_falls_through_to_the_ladder(retry_count):
    """shared/API.md 7.3: a reset already past (the profile is held only the 30 s buffer) is no
    reset to wait for: the retry takes the backoff of its count, never "now + 30 s" again and again."""
    stale = T0 + timedelta(seconds=outpost.LIMIT_BUFFER_S)   # limit_wait of a reset clamped to now
    plan = outpost.plan_retry(retry_count, T0, 0.0, stale)
    assert (plan.source, plan.retry_at) == ("backoff", T0 + timedelta(seconds=BACKOFF[retry_count]))
    ahead = T0 + timedelta(hours=1)
    assert outpost.plan_retry(retry_count, T0, 0.0, ahead).retry_at == ahead, "a reset ahead is still waited for"


# --- the wakeup queue: producers ---------------------------------------------------------------------

def test_task_assigned_wakeup_is_queued_when_assignment_saved(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "Fix the login bug", assignee_agent_id=worker)
    w = only(wakeups(office, worker))
    assert (w["source"], w["status"], w["payload"]) == ("task_assigned", "queued", {"task_id": tid})
    assert w["idempotency_key"] == f"task_assigned:{tid}:{worker}"
    assert w["coalesced_count"] == 1 and w["retry_count"] == 0 and w["run_id"] is None
    # The scheduler claims it and queues the agent's run on the task.
    (run_id,) = dispatch(office, at(1))
    w = wakeup(office, w["id"])
    assert (w["status"], w["run_id"]) == ("claimed", run_id)
    run = office_run(office, run_id)
    assert (run["status"], run["trigger"], run["agent"]) == ("queued", "wakeup", "demo")
    assert (run["agent_id"], run["task_id"], run["wakeup_id"]) == (worker, tid, w["id"])
    assert "Fix the login bug" in run["assembled_prompt"]
    assert agent(office, worker)["status"] == "working"
    assert task(office, tid)["checkout_agent_id"] == worker
    # An assignment saved later (an edit) wakes the new assignee the same way.
    other = new_agent(office, "Other")
    later = new_task(office, "Unassigned for now", at(2))
    assert wakeups(office, other) == []
    edit_task(office, later, at(3), assignee_agent_id=other)
    w2 = only(wakeups(office, other))
    assert (w2["source"], w2["status"], w2["payload"]) == ("task_assigned", "queued", {"task_id": later})


def test_wakeup_for_paused_agent_waits_queued_without_session(office):
    """The claim takes only idle and working agents: a paused or stopped agent's wakeups are
    not claimed, not retried, not ended; they run once the agent is resumed."""
    paused = new_agent(office, "Sleepy", status="paused")
    new_task(office, "t", assignee_agent_id=paused)
    (w,) = wakeups(office, paused)
    assert dispatch(office, at(1)) == []
    w = wakeup(office, w["id"])
    assert (w["status"], w["run_id"], w["claimed_at"], w["finished_at"]) == ("queued", None, None, None)
    assert w["retry_count"] == 0 and w["scheduled_retry_at"] is None
    assert dispatch(office, at(HOUR)) == []
    assert wakeup(office, w["id"])["status"] == "queued"
    assert runs_of_agent(office, paused) == []
    stopped = new_agent(office, "Stopped", status="stopped", role="coordinator")
    routine_wake(office, stopped, at(2))
    assert dispatch(office, at(3)) == []
    assert only(wakeups(office, stopped))["status"] == "queued"
    # Resumed, each agent works what waited for it.
    edit_agent(office, paused, at(HOUR), status="idle")
    edit_agent(office, stopped, at(HOUR), status="idle")
    assert len(dispatch(office, at(HOUR + 1))) == 2
    assert wakeup(office, w["id"])["status"] == "claimed"
    assert only(wakeups(office, stopped))["status"] == "claimed"


def test_comment_wakeup_stays_queued_while_agent_at_capacity(office):
    worker = new_agent(office, "Worker")          # max_concurrent_sessions 1, cooldown 10 s
    tid = new_task(office, "Write docs", assignee_agent_id=worker)
    (run_id,) = dispatch(office, at(1))
    start(office, run_id, at(2))                 # the session is running
    call(office, office.office.add_comment, tid, "Also cover the CLI", at(3))
    comment = only(wakeups(office, worker, source="comment"))
    assert comment["status"] == "queued"
    other = new_task(office, "Another task", at(4), assignee_agent_id=worker)
    assert dispatch(office, at(5)) == []
    assert wakeup(office, comment["id"])["status"] == "queued"
    assert only(wakeups(office, worker, source="task_assigned", status="queued"))["payload"] == {"task_id": other}
    # The session completes; after the cooldown the next tick picks up the comment.
    settle(office, run_id, "succeeded", at(20), result={"summary": "docs written"})
    assert agent(office, worker)["status"] == "idle"
    assert call(office, office.office.next_wakeup_at, at(20)) == at(30)
    assert dispatch(office, at(25)) == []
    (next_run,) = dispatch(office, at(30))
    comment = wakeup(office, comment["id"])
    assert (comment["status"], comment["run_id"]) == ("claimed", next_run)
    assert "Also cover the CLI" in office_run(office, next_run)["assembled_prompt"]


def test_a_mention_wakes_the_named_agent_on_the_task_as_a_participant(office):
    """shared/API.md 7.3: ``@Bob please look`` wakes Bob (source user, payload task, comment and
    who mentioned him); the assignee is woken as ``comment`` once; the author and unknown names
    wake nobody and the comment lists them. Bob's wake runs though Alice holds the task."""
    alice, bob, bot = new_agent(office, "Alice"), new_agent(office, "Bob"), new_agent(office, "Release Bot")
    tid = new_task(office, "Ship 1.4", assignee_agent_id=alice)
    (alice_run,) = dispatch(office, at(1))
    start(office, alice_run, at(2))   # Alice's session holds the task's checkout
    body = '@bob please look, and @"Release Bot" cut it; cc @Alice @Nobody, mail me@example.com'
    c = call(office, office.office.add_comment, tid, body, at(3))
    assert c["mentions"] == [{"name": "Bob", "agent_id": bob}, {"name": "Release Bot", "agent_id": bot},
                             {"name": "Alice", "agent_id": alice}, {"name": "Nobody", "agent_id": None}]
    (woke_bob,) = wakeups(office, bob)
    assert (woke_bob["source"], woke_bob["reason"]) == ("user", "mentioned")
    assert woke_bob["payload"] == {"task_id": tid, "comment_id": c["id"], "mentioned_by": "user"}
    assert len(wakeups(office, bot)) == 1 and sorted(w["source"] for w in wakeups(office, alice)) == [
        "comment", "task_assigned"], "the assignee is woken as comment, not again as mentioned"
    assert call(office, office.office.get_task, tid)["comments"][0]["mentions"] == c["mentions"]
    runs = dispatch(office, at(4))
    assert wakeup(office, woke_bob["id"])["run_id"] in runs, "a mention takes no checkout: it runs beside Alice"
    mine = call(office, office.office.add_comment, tid, "@Bob I will do it myself", at(5), bob)
    assert len(wakeups(office, bob)) == 1 and mine["mentions"] == [{"name": "Bob", "agent_id": bob}]


def test_a_comment_that_mentions_everyone_wakes_at_most_ten(office):
    names = [f"agent{i}" for i in range(15)]
    ids = [new_agent(office, n) for n in names]
    tid = new_task(office, "Noisy")
    c = call(office, office.office.add_comment, tid, " ".join(f"@{n}" for n in names), at(1))
    assert len(c["mentions"]) == outpost.MAX_MENTIONS == 10
    assert sum(len(wakeups(office, a)) for a in ids) == 10


def test_three_subtasks_done_give_one_task_children_completed_wakeup(office):
    lead = new_agent(office, "Lead", role="coordinator")
    workers = [new_agent(office, f"Worker {i}") for i in range(3)]
    parent = new_task(office, "Ship v2", assignee_agent_id=lead)
    subtasks = [new_task(office, f"part {i}", parent_id=parent, assignee_agent_id=w) for i, w in enumerate(workers)]
    for i, sub in enumerate(subtasks):
        move(office, sub, "DONE", at(i + 1))
        if i < 2:
            assert wakeups(office, lead, source="task_children_completed") == []
    w = only(wakeups(office, lead, source="task_children_completed"))
    assert (w["status"], w["payload"], w["coalesced_count"]) == ("queued", {"task_id": parent}, 1)
    # Nobody else hears of it.
    for worker in workers:
        assert wakeups(office, worker, source="task_children_completed") == []


def test_children_completed_wakeups_within_window_coalesce_into_one(office):
    lead = new_agent(office, "Lead", role="coordinator")
    parent = new_task(office, "Epic", assignee_agent_id=lead)
    ids = [enqueue(office, lead, outpost.WakeupSource.TASK_CHILDREN_COMPLETED, {"task_id": parent}, at(i * 0.6))
           for i in range(5)]
    first = wakeup(office, ids[0])
    assert first["status"] == "queued" and first["coalesced_count"] == 5
    for wid in ids[1:]:
        w = wakeup(office, wid)
        assert (w["status"], w["coalesced_into"]) == ("coalesced", ids[0])
    assert only(wakeups(office, lead, source="task_children_completed", status="queued"))["id"] == ids[0]


def test_a_wakeup_merged_from_another_task_outlives_the_one_it_joined(office):
    """Issue 24.5: the window merges across the coordinator's tasks; when the wakeup the others
    joined is cancelled (its task was done meanwhile), they are not lost with it."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    epics = [new_task(office, f"Epic {i}", at(i), assignee_agent_id=lead) for i in range(3)]
    for i in range(3):
        settle_all(office, at(10 + i), dispatch(office, at(10 + i)))
    ids = [enqueue(office, lead, outpost.WakeupSource.TASK_CHILDREN_COMPLETED, {"task_id": e}, at(60 + i))
           for i, e in enumerate(epics)]
    assert [wakeup(office, i)["status"] for i in ids] == ["queued", "coalesced", "coalesced"]
    move(office, epics[0], "DONE", at(63))
    (run_id,) = dispatch(office, at(66))   # the first's window closes at 65, the second's at 66
    first, second, third = (wakeup(office, i) for i in ids)
    assert (first["status"], first["cancel_reason"]) == ("cancelled", "task_terminal")
    assert (second["status"], second["coalesced_count"], second["run_id"]) == ("claimed", 2, run_id)
    assert (third["status"], third["coalesced_into"], third["run_id"]) == ("coalesced", second["id"], run_id)
    run = office_run(office, run_id)
    assert run["task_id"] == epics[1] and f"Task {epics[2]}: Epic 2" in run["assembled_prompt"]


def test_kanban_task_with_assignee_wakes_nobody(office):
    worker = new_agent(office, "Worker")
    reviewer = new_agent(office, "Reviewer")
    lead = new_agent(office, "Lead", role="coordinator")
    parent = new_task(office, "Kanban parent", workflow="kanban", assignee_agent_id=lead)
    tid = new_task(office, "Kanban card", workflow="kanban", assignee_agent_id=worker, reviewers=[reviewer],
                   parent_id=parent)
    blocked = new_task(office, "Kanban follow-up", workflow="kanban", assignee_agent_id=worker, blocked_by=[tid])
    move(office, tid, "IN_PROGRESS", at(1))
    call(office, office.office.add_comment, tid, "any news?", at(2))
    move(office, tid, "IN_REVIEW", at(3))
    move(office, tid, "IN_PROGRESS", at(4))
    move(office, tid, "DONE", at(5))
    edit_task(office, blocked, at(6), assignee_agent_id=reviewer)
    assert wakeups(office) == []
    assert dispatch(office, at(7)) == []
    # Nor does the recovery sweep treat an assigned kanban card as unstarted Office work.
    call(office, office.routines.recovery_sweep, at(8))
    assert wakeups(office) == [] and activity(office, "recovery_dispatch") == []
    # A kanban-workflow task inside a project is an Office task.
    project = call(office, office.office.create_project, None, "App", None, None, at(8))["id"]
    in_project = new_task(office, "Project card", at(9), workflow="kanban", project_id=project,
                          assignee_agent_id=worker)
    assert only(wakeups(office, worker))["payload"] == {"task_id": in_project}


def test_cross_workspace_refused(office, tmp_path):
    ws_b = call(office, office.office.create_workspace, "B", T0)["id"]
    repo_b = tmp_path / "repo-b"
    set_repository(office, repo_b, ws_b)
    agent_a = new_agent(office, "A-worker")
    agent_b = new_agent(office, "B-worker", workspace_id=ws_b)
    task_a = new_task(office, "in A")
    with pytest.raises(outpost.ValidationFailed) as err:
        new_task(office, "in B", workspace_id=ws_b, assignee_agent_id=agent_a)
    assert err.value.status == 422 and err.value.problem()["code"] == "validation_failed"
    assert err.value.errors[0]["field"] == "assignee_agent_id"
    for field, value in (("reviewers", [agent_a]), ("blocked_by", [task_a]), ("parent_id", task_a)):
        with pytest.raises(outpost.ValidationFailed) as err:
            new_task(office, "in B", workspace_id=ws_b, **{field: value})
        assert err.value.errors[0]["field"] == field
    task_b = new_task(office, "in B", workspace_id=ws_b, assignee_agent_id=agent_b)
    with pytest.raises(outpost.ValidationFailed) as err:
        edit_task(office, task_b, at(1), assignee_agent_id=agent_a)
    assert err.value.errors[0]["field"] == "assignee_agent_id"
    assert task(office, task_b)["assignee_agent_id"] == agent_b
    assert wakeups(office, agent_a) == []
    # An agent of A cannot act on B's task through the workspace-scoped calls.
    with pytest.raises(outpost.NotFound):
        call(office, office.office.move_task, task_b, "DONE", at(2), None, WS)
    with pytest.raises(outpost.NotFound):
        call(office, office.office.add_comment, task_b, "hi", at(2), agent_a, WS)
    # The dispatcher never mixes: a wakeup of A naming B's task finds no such task in A.
    stray = enqueue(office, agent_a, outpost.WakeupSource.TASK_ASSIGNED, {"task_id": task_b}, at(3))
    queued = dispatch(office, at(4))
    w = wakeup(office, stray)
    assert (w["status"], w["cancel_reason"]) == ("cancelled", "task_not_found")
    assert task(office, task_b)["checkout_agent_id"] == agent_b
    (b_run,) = queued
    assert office_run(office, b_run)["workspace_id"] == ws_b
    assert office_run(office, b_run)["repository"] == str(repo_b)
    assert only(wakeups(office, workspace_id=ws_b))["agent_id"] == agent_b


# --- failures, retries and rate limits through the store --------------------------------------------------

def test_rate_limit_resets_at_4am_schedules_0400_30(office):
    now = datetime(2026, 4, 25, 3, 45, tzinfo=UTC)
    worker = new_agent(office, "Worker", now)
    new_task(office, "t", now, assignee_agent_id=worker)
    (w,) = wakeups(office, worker)
    w = fail_and_reschedule(office, w["id"], now, "rate_limit_error: resets at 4:00 AM UTC")
    assert w["status"] == "queued" and w["retry_count"] == 1
    assert instant(w["scheduled_retry_at"]) == datetime(2026, 4, 25, 4, 0, 30, tzinfo=UTC)
    assert w["last_error"] == "rate_limit_error: resets at 4:00 AM UTC"
    # The retry waits for that instant, then runs.
    after_cooldown = now + timedelta(seconds=11)
    assert call(office, office.office.next_wakeup_at, after_cooldown) == datetime(2026, 4, 25, 4, 0, 30, tzinfo=UTC)
    assert dispatch(office, datetime(2026, 4, 25, 4, 0, 29, tzinfo=UTC)) == []
    assert len(dispatch(office, datetime(2026, 4, 25, 4, 0, 30, tzinfo=UTC))) == 1


def test_a_pending_retry_meeting_a_new_wakeup_keeps_its_due_time_and_retry_count(office):
    """Defect 5: a retry waiting for a rate-limit reset merged with a new wakeup of the same
    agent and task ran at once, ignoring the reset and resetting retry_count (so escalation
    could be postponed forever). The merge keeps the later due time and the retry count."""
    now = datetime(2026, 4, 25, 3, 45, tzinfo=UTC)
    worker = new_agent(office, "Worker", now)
    tid = new_task(office, "t", now, assignee_agent_id=worker)
    (w,) = wakeups(office, worker)
    (run_id,) = dispatch(office, now)
    start(office, run_id, now)
    call(office, office.office.add_comment, tid, "one more thing", now + timedelta(seconds=30))   # during the run
    settle(office, run_id, "failed", now + timedelta(minutes=1), error="rate_limit_error: resets at 4:00 AM UTC",
           exit_code=1)
    assert wakeup(office, w["id"])["retry_count"] == 1
    reset = datetime(2026, 4, 25, 4, 0, 30, tzinfo=UTC)
    assert dispatch(office, now + timedelta(minutes=2)) == []   # the comment's wakeup waits with the retry
    assert dispatch(office, reset - timedelta(seconds=1)) == []
    (run_id,) = dispatch(office, reset)
    ran = only([x for x in wakeups(office, worker) if x["run_id"] == run_id and x["status"] == "claimed"])
    assert ran["retry_count"] == 1
    assert "one more thing" in office_run(office, run_id)["assembled_prompt"]


def test_rate_limit_reset_just_passed_still_schedules_within_the_buffer():
    now = datetime(2026, 4, 25, 4, 0, 10, tzinfo=UTC)
    limit = outpost.find_limit("rate_limit_error: resets at 4:00 AM UTC", now, ZoneInfo("UTC"))
    assert limit.resets_at == now   # a wall time just passed means now
    assert outpost.limit_wait(limit, 0, now, 0.0) == now + timedelta(seconds=30)


@pytest.mark.parametrize(("error", "wait"), [
    ("HTTP 429 Too Many Requests. Retry-After: 3600", timedelta(seconds=3600)),
    ("Rate limit reached for requests. Please try again in 5 minutes.", timedelta(minutes=5)),
], ids=["retry-after-3600", "try-again-in-5-minutes"])
def test_a_rate_limit_message_schedules_the_retry_30_s_after_the_wait_it_names(office, error, wait):
    worker = new_agent(office, "Worker")
    new_task(office, "t", assignee_agent_id=worker)
    (w,) = wakeups(office, worker)
    now = at(MINUTE)
    w = fail_and_reschedule(office, w["id"], now, error)
    assert (w["status"], w["retry_count"]) == ("queued", 1)
    assert instant(w["scheduled_retry_at"]) == now + wait + timedelta(seconds=30)


def test_a_limit_with_no_reset_after_earlier_failures_falls_through_to_the_backoff_of_its_retry_count(office):
    """Issue 24.6a: a rate limit that names no reset, met by a wakeup that had failed twice, was
    retried after 2 min (the profile's own ladder restarted); the spec falls through to the
    exponential backoff: the third retry comes after 30 min (+-25%)."""
    worker = new_agent(office, "Worker", cooldown_sec=0)
    new_task(office, "t", assignee_agent_id=worker)
    w, now = only(wakeups(office, worker)), at(1)
    for _ in range(2):
        w = fail_and_reschedule(office, w["id"], now)
        now = retry_due(w)
    w = fail_and_reschedule(office, w["id"], now, error="429 Too Many Requests: rate limit exceeded")
    assert call(office, office.runs.get_run, w["run_id"])["failure_kind"] == "limit"
    assert w["retry_count"] == 3
    retry_at = instant(w["scheduled_retry_at"])
    assert now + timedelta(minutes=22.5) <= retry_at <= now + timedelta(minutes=37.5)


def test_generic_failure_uses_backoff_and_escalates_after_4_retries(office):
    lead = new_agent(office, "Lead", role="coordinator")
    worker = new_agent(office, "Worker", cooldown_sec=0)
    tid = new_task(office, "Flaky", assignee_agent_id=worker)
    w = only(wakeups(office, worker))
    now, runs = at(1), []
    for attempt, base in enumerate(BACKOFF, start=1):
        runs += dispatch(office, now)
        settle(office, runs[-1], "failed", now, error="network timeout", exit_code=1)
        w = wakeup(office, w["id"])
        assert (w["status"], w["retry_count"], w["run_id"]) == ("queued", attempt, runs[-1])
        retry_at = instant(w["scheduled_retry_at"])
        assert now + timedelta(seconds=0.75 * base) <= retry_at <= now + timedelta(seconds=1.25 * base)
        assert task(office, tid)["checkout_agent_id"] is None, "the lock is released between attempts"
        assert dispatch(office, retry_at - timedelta(seconds=1)) == []
        now = retry_due(w)
    assert attention(office, "agent_error") == []
    # The fifth failure (the fourth retry) escalates.
    runs += dispatch(office, now)
    settle(office, runs[-1], "failed", now, error="network timeout", exit_code=1)
    w = wakeup(office, w["id"])
    assert (w["status"], w["retry_count"], w["cancel_reason"]) == ("failed", 5, None)
    assert "escalated" in w["note"]
    assert len(set(runs)) == 5
    item = only(attention(office, "agent_error"))
    assert "Worker" in item["title"] and item["detail"] == "network timeout"
    esc = only(wakeups(office, lead, source="agent_error"))
    assert esc["status"] == "queued"
    assert esc["payload"] == {"agent_profile_id": worker, "run_id": runs[-1], "error": "network timeout"}
    assert esc["idempotency_key"] == f"agent_error:{runs[-1]}:{lead}"
    # The coordinator is woken about it: its run is taskless and names the failed agent.
    (lead_run,) = dispatch(office, now + timedelta(seconds=1))
    lead_view = office_run(office, lead_run)
    assert (lead_view["agent_id"], lead_view["task_id"]) == (lead, None)
    assert worker in lead_view["assembled_prompt"] and "network timeout" in lead_view["assembled_prompt"]


def test_rate_limit_parsed_reset_still_counts_toward_escalation(office):
    new_agent(office, "Lead", role="coordinator")
    worker = new_agent(office, "Worker", cooldown_sec=0)
    new_task(office, "t", assignee_agent_id=worker)
    w = only(wakeups(office, worker))
    now = at(1)
    for attempt in range(1, 5):
        w = fail_and_reschedule(office, w["id"], now, "429 Too Many Requests; Retry-After: 60")
        assert (w["status"], w["retry_count"]) == ("queued", attempt)
        assert instant(w["scheduled_retry_at"]) == now + timedelta(seconds=90)
        now += timedelta(seconds=90)
    w = fail_and_reschedule(office, w["id"], now, "429 Too Many Requests; Retry-After: 60")
    assert (w["status"], w["retry_count"]) == ("failed", 5)
    assert len(attention(office, "agent_error")) == 1


def test_each_escalation_wakes_the_coordinator(office):
    lead = new_agent(office, "Lead", role="coordinator")
    w1 = new_agent(office, "W1", executor=None, cooldown_sec=0)     # no executor anywhere: no run is created
    w2 = new_agent(office, "W2", executor=None, cooldown_sec=0)
    new_task(office, "a", assignee_agent_id=w1)
    new_task(office, "b", assignee_agent_id=w2)
    now = at(1)
    for _ in range(outpost.MAX_RETRY_COUNT + 1):
        dispatch(office, now)
        now += timedelta(hours=3)
    assert {w["status"] for w in wakeups(office, source="task_assigned")} == {"failed"}
    assert len(attention(office, "agent_error")) == 2
    escalations = wakeups(office, lead, source="agent_error")
    assert sorted(w["payload"]["agent_profile_id"] for w in escalations) == sorted([w1, w2])


def test_a_wakeup_whose_workspace_has_no_repository_waits_without_counting_a_retry(store):
    """Defect 15: a workspace without a repository burned the wakeup's retries with backoff.
    It waits with the reason and starts as soon as a repository is set."""
    other = call(store, store.office.create_workspace, "Research", at(0))["id"]
    worker = new_agent(store, "Worker", workspace_id=other)
    tid = new_task(store, "t", assignee_agent_id=worker, workspace_id=other)
    (w,) = wakeups(store, worker, workspace_id=other)
    assert dispatch(store, at(1)) == []
    w = wakeup(store, w["id"], other)
    assert (w["status"], w["retry_count"], w["run_id"]) == ("queued", 0, None)
    assert w["last_error"] == "repository unavailable: the workspace has no repository: set one in Office settings"
    assert outpost.wakeup_label(w) == "Waiting for its repository"
    assert task(store, tid)["checkout_agent_id"] is None
    assert agent(store, worker)["status"] == "idle"
    assert call(store, store.runs.own_runs_in, ["queued", "running"]) == []
    # Once a repository is set, it starts at once.
    set_repository(store, Path("/srv/repos/app"), other)
    (run_id,) = dispatch(store, at(2))
    assert call(store, store.runs.get_run, run_id)["repository"] == "/srv/repos/app"
    assert wakeup(store, w["id"], other)["status"] == "claimed"


def test_the_default_workspace_runs_in_the_embedded_repository_while_it_names_none(store, tmp_path):
    """docs/office.md: Office works with no setup."""
    settings = call(store, store.office.office_settings, None)
    assert settings["repository"] is None
    assert settings["repository_in_use"] == str(tmp_path / "workspaces" / "ws_default")
    worker = new_agent(store, "Worker")
    new_task(store, "t", assignee_agent_id=worker)
    (run_id,) = dispatch(store, at(1))
    assert call(store, store.runs.get_run, run_id)["repository"] == str(tmp_path / "workspaces" / "ws_default")


def test_a_run_whose_repository_is_missing_leaves_its_wakeup_waiting_not_retrying(office):
    worker = new_agent(office, "Worker")
    new_task(office, "t", assignee_agent_id=worker)
    (w,) = wakeups(office, worker)
    w = fail_and_reschedule(office, w["id"], at(1), "repository unavailable: repository /srv/gone does not exist")
    assert (w["status"], w["retry_count"]) == ("queued", 0)
    assert instant(w["scheduled_retry_at"]) == at(1 + outpost.REPOSITORY_RECHECK_S)
    set_repository(office, Path("/srv/repos/app"))   # a settings change looks again at once
    (run_id,) = dispatch(office, at(20))
    assert call(office, office.runs.get_run, run_id)["repository"] == "/srv/repos/app"


def test_lists_made_at_one_instant_have_a_total_order_by_id(office):
    """Defect 19: lists were ordered by a timestamp alone, so ties listed in any order (a fresh
    clone saw ['Research', 'Default']). Every list breaks ties by id."""
    names = ["zeta", "alpha", "mid"]
    agents = [new_agent(office, name, at(0)) for name in names]
    tasks_ = [new_task(office, name, at(0)) for name in names]
    assert [a["id"] for a in call(office, office.office.list_agents, None)] == sorted(agents)
    assert [t["id"] for t in call(office, office.office.list_tasks, None)] == sorted(tasks_)
    for name in names:
        call(office, office.office.create_workspace, name, at(0))
    listed = call(office, office.office.list_workspaces)
    assert listed[0]["id"] == "ws_default" and [w["id"] for w in listed[1:]] == sorted(w["id"] for w in listed[1:])


# --- staleness and retry cancellation ------------------------------------------------------------------

def test_reassigned_before_claim_cancels_with_assignee_changed(office):
    a = new_agent(office, "A")
    b = new_agent(office, "B")
    tid = new_task(office, "t", assignee_agent_id=a)
    wa = only(wakeups(office, a))
    edit_task(office, tid, at(1), assignee_agent_id=b)
    assert wakeup(office, wa["id"])["status"] == "queued", "only scheduled retries are cancelled at the edit"
    queued = dispatch(office, at(2))
    wa = wakeup(office, wa["id"])
    assert (wa["status"], wa["cancel_reason"], wa["run_id"]) == ("cancelled", "assignee_changed", None)
    assert instant(wa["finished_at"]) == at(2)
    assert runs_of_agent(office, a) == [] and agent(office, a)["status"] == "idle"
    entry = only(activity(office, "wakeup_stale_cancelled"))
    assert (entry["agent_id"], entry["task_id"], entry["wakeup_id"]) == (a, tid, wa["id"])
    assert entry["data"] == {"reason": "assignee_changed"}
    (run_b,) = queued
    assert office_run(office, run_b)["agent_id"] == b


def test_retry_cancelled_at_promotion_retry_stale_assignee(office):
    a = new_agent(office, "A")
    b = new_agent(office, "B")
    tid = new_task(office, "t", assignee_agent_id=a)
    w = fail_and_reschedule(office, only(wakeups(office, a))["id"], at(1))
    retry_at = instant(w["scheduled_retry_at"])

    def reassign_behind_the_api():   # not through update_task: only promotion can catch it
        office.db.Task[tid].assignee_agent_id = b
    office.transaction(reassign_behind_the_api)
    assert dispatch(office, retry_at - timedelta(seconds=1)) == []
    assert wakeup(office, w["id"])["status"] == "queued"
    assert dispatch(office, retry_due(w)) == []
    w = wakeup(office, w["id"])
    assert (w["status"], w["cancel_reason"], w["retry_count"]) == ("cancelled", "retry_stale_assignee", 1)
    assert task(office, tid)["checkout_agent_id"] is None
    entry = only(activity(office, "wakeup_retry_cancelled"))
    assert entry["data"] == {"reason": "retry_stale_assignee", "old_agent": a}
    assert (entry["task_id"], entry["wakeup_id"]) == (tid, w["id"])
    assert len(runs_of_agent(office, a)) == 1


def test_patch_reassign_cancels_pending_retries_immediately(office):
    a = new_agent(office, "A")
    b = new_agent(office, "B")
    tid = new_task(office, "t", assignee_agent_id=a)
    w = fail_and_reschedule(office, only(wakeups(office, a))["id"], at(1))
    assert w["status"] == "queued" and w["scheduled_retry_at"] is not None
    edit_task(office, tid, at(5), assignee_agent_id=b)
    w = wakeup(office, w["id"])
    assert (w["status"], w["cancel_reason"]) == ("cancelled", "retry_stale_assignee")
    assert instant(w["finished_at"]) == at(5)
    entry = only(activity(office, "wakeup_retry_cancelled"))
    assert entry["data"] == {"reason": "retry_stale_assignee", "old_agent": a}
    assert only(wakeups(office, b))["status"] == "queued"
    assert call(office, office.office.next_wakeup_at, at(5)) is None, "nothing is left to retry"


def test_retry_task_cancelled(office):
    a = new_agent(office, "A")
    tid = new_task(office, "t", assignee_agent_id=a)
    w = fail_and_reschedule(office, only(wakeups(office, a))["id"], at(1))
    move(office, tid, "CANCELLED", at(10))
    assert dispatch(office, retry_due(w)) == []
    w = wakeup(office, w["id"])
    assert (w["status"], w["cancel_reason"]) == ("cancelled", "retry_task_cancelled")
    assert only(activity(office, "wakeup_retry_cancelled"))["data"] == {"reason": "retry_task_cancelled",
                                                                        "old_agent": a}
    assert len(runs_of_agent(office, a)) == 1


def test_done_task_wakeup_cancelled_task_terminal(office):
    a = new_agent(office, "A")
    tid = new_task(office, "t", assignee_agent_id=a)
    w = only(wakeups(office, a))
    move(office, tid, "DONE", at(1))
    assert dispatch(office, at(2)) == []
    w = wakeup(office, w["id"])
    assert (w["status"], w["cancel_reason"]) == ("cancelled", "task_terminal")
    assert only(activity(office, "wakeup_stale_cancelled"))["data"] == {"reason": "task_terminal"}
    assert runs_of_agent(office, a) == []
    # Archived counts as terminal too; a task that no longer exists is task_not_found.
    t2 = new_task(office, "t2", at(3), assignee_agent_id=a)
    w2 = only(wakeups(office, a, status="queued"))
    edit_task(office, t2, at(4), archived=True)
    gone = enqueue(office, a, outpost.WakeupSource.TASK_ASSIGNED, {"task_id": "tsk_nope"}, at(5))
    assert dispatch(office, at(6)) == []
    assert wakeup(office, w2["id"])["cancel_reason"] == "task_terminal"
    assert wakeup(office, gone)["cancel_reason"] == "task_not_found"


def test_review_participant_changed(office):
    worker = new_agent(office, "Worker")
    r1 = new_agent(office, "Reviewer 1")
    r2 = new_agent(office, "Reviewer 2")
    tid = new_task(office, "t", assignee_agent_id=worker, reviewers=[r1])
    move(office, tid, "IN_REVIEW", at(1))
    review = only(wakeups(office, r1))
    assert (review["source"], review["reason"], review["payload"]) == ("task_assigned", "review_requested",
                                                                       {"task_id": tid})
    edit_task(office, tid, at(2), reviewers=[r2])
    dispatch(office, at(3))
    review = wakeup(office, review["id"])
    assert (review["status"], review["cancel_reason"]) == ("cancelled", "review_participant_changed")
    assert only(activity(office, "wakeup_stale_cancelled"))["data"] == {"reason": "review_participant_changed"}
    # A reviewer whose task left review is no longer a participant either.
    t2 = new_task(office, "t2", at(4), assignee_agent_id=worker, reviewers=[r2])
    move(office, t2, "IN_REVIEW", at(5))
    r2_wake = only(wakeups(office, r2))
    move(office, t2, "IN_PROGRESS", at(6))
    dispatch(office, at(7))
    assert wakeup(office, r2_wake["id"])["cancel_reason"] == "review_participant_changed"
    # A reviewer still in review proceeds and gets the review run.
    t3 = new_task(office, "t3", at(8), assignee_agent_id=worker, reviewers=[r1])
    move(office, t3, "IN_REVIEW", at(9))
    (run_id,) = dispatch(office, at(60))
    assert (office_run(office, run_id)["agent_id"], office_run(office, run_id)["task_id"]) == (r1, t3)


# --- blockers, approvals and the subtask pipeline ---------------------------------------------------

def test_spec_build_pipeline_approval_then_blockers_resolved(office):
    lead = new_agent(office, "Lead", role="coordinator")
    planner = new_agent(office, "Planner")
    developer = new_agent(office, "Developer")
    parent = new_task(office, "Feature", assignee_agent_id=lead)
    spec = new_task(office, "Spec", parent_id=parent, requires_approval=True, assignee_agent_id=planner)
    build = new_task(office, "Build", parent_id=parent, blocked_by=[spec], assignee_agent_id=developer)
    # Build's assignment is held (queued) while Spec is open: no session for the developer.
    held = only(wakeups(office, developer))
    queued = dispatch(office, at(1))
    held = wakeup(office, held["id"])
    assert held["status"] == "queued" and held["run_id"] is None and spec in held["note"]
    assert {office_run(office, r)["agent_id"] for r in queued} == {lead, planner}
    assert task(office, build)["checkout_agent_id"] is None
    # The planner completes Spec: it goes to review with a pending approval, not to Done.
    planner_run = next(r for r in queued if office_run(office, r)["agent_id"] == planner)
    start(office, planner_run, at(2))
    moved = move(office, spec, "DONE", at(3), by_agent=planner)
    assert moved["state"] == "IN_REVIEW"
    approval = only(call(office, office.office.list_approvals, None, "pending"))
    assert (approval["task_id"], approval["requested_by_agent_id"]) == (spec, planner)
    assert len(attention(office, "approval")) == 1
    assert wakeups(office, developer, source="task_blockers_resolved") == []
    settle(office, planner_run, "succeeded", at(4))
    # The user approves: Spec is done, Build's blocker resolves and the developer is woken.
    call(office, office.office.resolve_approval, approval["id"], "approved", "looks good", at(5))
    assert task(office, spec)["state"] == "DONE"
    resolved = only(wakeups(office, developer, source="task_blockers_resolved"))
    assert resolved["status"] == "queued"
    assert resolved["payload"] == {"task_id": build, "resolved_blocker_ids": [spec]}
    told = only(wakeups(office, planner, source="approval_resolved"))
    assert told["payload"] == {"approval_id": approval["id"], "status": "approved", "decision_note": "looks good"}
    assert wakeups(office, lead, source="task_children_completed") == [], "Build is still open"
    # The developer starts working on Build automatically: the held assignment and the resolved wake.
    runs = dispatch(office, at(30))
    (dev_run,) = [r for r in runs if office_run(office, r)["agent_id"] == developer]
    assert office_run(office, dev_run)["task_id"] == build
    assert wakeup(office, held["id"])["run_id"] == wakeup(office, resolved["id"])["run_id"] == dev_run
    assert task(office, build)["checkout_agent_id"] == developer


def test_rejected_approval_sends_task_back_and_tells_the_agent(office):
    planner = new_agent(office, "Planner")
    spec = new_task(office, "Spec", requires_approval=True, assignee_agent_id=planner)
    move(office, spec, "DONE", at(1), by_agent=planner)
    approval = only(call(office, office.office.list_approvals, None, "pending"))
    call(office, office.office.resolve_approval, approval["id"], "rejected", "needs examples", at(2))
    assert task(office, spec)["state"] == "IN_PROGRESS"
    told = only(wakeups(office, planner, source="approval_resolved"))
    assert told["payload"]["status"] == "rejected" and told["payload"]["decision_note"] == "needs examples"
    with pytest.raises(outpost.Conflict):
        call(office, office.office.resolve_approval, approval["id"], "approved", "", at(3))


def test_move_back_from_review_wakes_assignee_with_rejection_comment(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "t", assignee_agent_id=worker)
    move(office, tid, "IN_REVIEW", at(1))
    move(office, tid, "IN_PROGRESS", at(2))
    w = only(wakeups(office, worker, source="comment"))
    assert w["reason"] == "review_rejected" and w["payload"]["task_id"] == tid
    comment = only(task(office, tid)["comments"])
    assert w["payload"]["comment_id"] == comment["id"] and "changes are needed" in comment["body"]


def test_move_to_in_progress_wakes_assignee(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "t", assignee_agent_id=worker)
    settle_all(office, at(10), dispatch(office, at(1)))
    move(office, tid, "IN_PROGRESS", at(25 * HOUR))
    woken = [w for w in wakeups(office, worker, source="task_assigned") if w["status"] == "queued"]
    assert only(woken)["payload"] == {"task_id": tid}
    # The agent's own comment does not wake it; someone else's does.
    other = new_agent(office, "Other")
    call(office, office.office.add_comment, tid, "note to self", at(25 * HOUR + 1), worker)
    assert wakeups(office, worker, source="comment") == []
    call(office, office.office.add_comment, tid, "from a colleague", at(25 * HOUR + 2), other)
    assert only(wakeups(office, worker, source="comment"))["status"] == "queued"


def test_reassigning_a_task_back_to_its_first_agent_wakes_it_again(office):
    """Defect 6: A -> B -> A within 24 h was deduplicated by task_assigned:<task>:<A>: B's
    wakeup was cancelled, A got none and the recovery sweep skipped the task. A new
    assignment is a new event."""
    a = new_agent(office, "A")
    b = new_agent(office, "B")
    tid = new_task(office, "t", assignee_agent_id=a)
    settle_all(office, at(10), dispatch(office, at(1)))     # A's first session left it in TODO
    edit_task(office, tid, at(HOUR), assignee_agent_id=b)
    edit_task(office, tid, at(HOUR + 1), assignee_agent_id=a)
    queued = wakeups(office, a, source="task_assigned", status="queued")
    assert len(queued) == 1, wakeups(office, a)
    (run_id,) = dispatch(office, at(HOUR + 10))
    assert office_run(office, run_id)["agent_id"] == a
    assert only(wakeups(office, b))["cancel_reason"] == "assignee_changed"


def test_drag_to_in_progress_wakes_assignee_within_24h_of_assignment(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "t", assignee_agent_id=worker)
    settle_all(office, at(10), dispatch(office, at(1)))     # the first session left it in TODO
    move(office, tid, "IN_PROGRESS", at(HOUR))              # the user drags the card
    assert len(wakeups(office, worker, source="task_assigned")) == 2


def test_self_wake_for_later_waits_for_its_time(office):
    lead = new_agent(office, "Lead", role="coordinator")
    w = call(office, office.office.wake_agent, lead, outpost.WakeupSource.SELF, {"reason": "check CI"}, at(0),
             wake_at=at(10 * MINUTE))
    assert (w["status"], w["wake_at"]) == ("queued", outpost.rfc3339(at(10 * MINUTE)))
    assert call(office, office.office.next_wakeup_at, at(1)) == at(10 * MINUTE)
    assert dispatch(office, at(10 * MINUTE - 1)) == []
    (run_id,) = dispatch(office, at(10 * MINUTE))
    assert "check CI" in office_run(office, run_id)["assembled_prompt"]


def test_second_review_round_wakes_the_reviewer_again(office):
    worker = new_agent(office, "Worker")
    reviewer = new_agent(office, "Reviewer")
    tid = new_task(office, "t", assignee_agent_id=worker, reviewers=[reviewer])
    settle_all(office, at(1), dispatch(office, at(1)))      # the worker's session ends
    move(office, tid, "IN_REVIEW", at(2))
    (run_id,) = dispatch(office, at(2))
    assert office_run(office, run_id)["agent_id"] == reviewer
    settle(office, run_id, "succeeded", at(3))
    move(office, tid, "IN_PROGRESS", at(4))         # the user sends it back; the worker fixes it
    move(office, tid, "IN_REVIEW", at(HOUR))        # ... and it is ready for review again
    assert len(wakeups(office, reviewer)) == 2


def test_reviewer_woken_while_assignee_run_holds_checkout_still_reviews(office):
    worker = new_agent(office, "Worker")
    reviewer = new_agent(office, "Reviewer")
    tid = new_task(office, "t", assignee_agent_id=worker, reviewers=[reviewer])
    (run_id,) = dispatch(office, at(1))
    start(office, run_id, at(2))
    move(office, tid, "IN_REVIEW", at(3), by_agent=worker)      # the agent API, during the run
    runs = dispatch(office, at(4))                               # the API write nudges the dispatcher
    # A reviewer reads the task and takes no lock: it starts while the assignee's run finishes.
    review = only(wakeups(office, reviewer))
    assert review["status"] == "claimed", review
    assert [office_run(office, r)["agent_id"] for r in runs] == [reviewer]
    assert task(office, tid)["checkout_agent_id"] == worker
    settle(office, run_id, "succeeded", at(5))
    assert task(office, tid)["checkout_agent_id"] is None


def failed_review(office: outpost.Store) -> tuple[str, str, dict]:
    """A task in review whose reviewer's run failed once: (task id, reviewer id, the review
    wakeup waiting for its retry)."""
    worker = new_agent(office, "Worker")
    reviewer = new_agent(office, "Reviewer")
    tid = new_task(office, "t", assignee_agent_id=worker, reviewers=[reviewer])
    (run_id,) = dispatch(office, at(1))
    settle(office, run_id, "succeeded", at(2))
    move(office, tid, "IN_REVIEW", at(3), by_agent=worker)
    return tid, reviewer, fail_and_reschedule(office, only(wakeups(office, reviewer))["id"], at(4))


def test_a_reviewers_failed_run_is_retried_not_cancelled_as_retry_stale_assignee(office):
    """Defect 4: retry_stale_assignee was applied to review wakeups, whose agent is a reviewer
    and never the assignee: every reviewer run that failed once was cancelled for good."""
    _, reviewer, failed = failed_review(office)
    assert (failed["status"], failed["retry_count"]) == ("queued", 1)
    (retry_run,) = dispatch(office, retry_due(failed))
    again = wakeup(office, failed["id"])
    assert (again["status"], again["cancel_reason"], again["run_id"]) == ("claimed", None, retry_run)
    assert office_run(office, retry_run)["agent_id"] == reviewer


def test_a_retry_of_a_reviewer_removed_from_the_task_is_cancelled_at_promotion(office):
    tid, _, failed = failed_review(office)

    def drop_reviewer_behind_the_api():   # only promotion can catch it
        office.db.Task[tid].reviewers = []
    office.transaction(drop_reviewer_behind_the_api)
    assert dispatch(office, retry_due(failed)) == []
    w = wakeup(office, failed["id"])
    assert (w["status"], w["cancel_reason"]) == ("cancelled", "review_participant_changed")


# --- idle skip -----------------------------------------------------------------------------------------

def test_changing_a_workers_role_to_coordinator_applies_the_coordinators_idle_default(office):
    """Defect 18: a worker made coordinator kept skip_idle_wakeups = true, so its heartbeats
    were skipped; role defaults apply unless the user set the field."""
    worker = new_agent(office, "Worker")
    assert agent(office, worker)["skip_idle_wakeups"] is True
    fields = outpost.normalize_agent({"role": "coordinator"}, profiles=list(PROFILES),
                                     current=call(office, office.office.agent_fields, worker))
    assert fields["skip_idle_wakeups"] is False
    chosen = new_agent(office, "Chosen", skip_idle_wakeups=False)   # the user's choice, not the default
    fields = outpost.normalize_agent({"role": "specialist"}, profiles=list(PROFILES),
                                     current=call(office, office.office.agent_fields, chosen))
    assert fields["skip_idle_wakeups"] is False
    both = outpost.normalize_agent({"role": "coordinator", "skip_idle_wakeups": True}, profiles=list(PROFILES),
                                   current=call(office, office.office.agent_fields, worker))
    assert both["skip_idle_wakeups"] is True


def test_idle_skip_worker_routine_wake_is_finished_with_activity(office):
    worker = new_agent(office, "Worker")
    assert agent(office, worker)["skip_idle_wakeups"] is True
    # Review-gated, terminal and archived tasks are not actionable.
    for state in ("IN_REVIEW", "DONE", "CANCELLED"):
        tid = new_task(office, state, assignee_agent_id=worker)
        move(office, tid, state, at(1))
    archived = new_task(office, "archived", assignee_agent_id=worker)
    edit_task(office, archived, at(1), archived=True)
    settle_all(office, at(3), dispatch(office, at(2)))     # the assignment wakes are done with
    wid = routine_wake(office, worker, at(HOUR))
    assert dispatch(office, at(HOUR + 1)) == []
    w = wakeup(office, wid)
    assert (w["status"], w["run_id"], w["cancel_reason"]) == ("finished", None, None)
    assert "idle" in w["note"]
    entry = only(activity(office, "wakeup_idle_skipped"))
    assert (entry["agent_id"], entry["wakeup_id"], entry["data"]) == (worker, wid, {"reason": "no_actionable_tasks"})


def test_idle_skip_does_not_apply_to_task_assigned(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "waiting for review", workflow="office")
    move(office, tid, "IN_REVIEW", at(1))
    skipped = routine_wake(office, worker, at(2))
    edit_task(office, tid, at(3), assignee_agent_id=worker)   # 0 actionable tasks, but an event wake
    runs = dispatch(office, at(4))
    assert wakeup(office, skipped)["status"] == "finished"
    assigned = only(wakeups(office, worker, source="task_assigned"))
    assert assigned["status"] == "claimed" and assigned["run_id"] in runs
    assert len(activity(office, "wakeup_idle_skipped")) == 1


def test_idle_skip_worker_with_actionable_task_proceeds(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "todo", assignee_agent_id=worker)
    settle_all(office, at(1), dispatch(office, at(1)))
    assert task(office, tid)["state"] == "TODO"
    wid = routine_wake(office, worker, at(HOUR))
    (run_id,) = dispatch(office, at(HOUR))
    assert wakeup(office, wid)["run_id"] == run_id
    assert activity(office, "wakeup_idle_skipped") == []


def test_idle_skip_coordinator_default_false_proceeds(office):
    lead = new_agent(office, "Lead", role="coordinator")
    assert agent(office, lead)["skip_idle_wakeups"] is False
    wid = routine_wake(office, lead, at(1))
    (run_id,) = dispatch(office, at(2))
    assert wakeup(office, wid)["status"] == "claimed"
    assert office_run(office, run_id)["task_id"] is None
    assert activity(office, "wakeup_idle_skipped") == []
    # skip_idle_wakeups is per agent: a worker may opt out, a coordinator in (ceo is a coordinator).
    eager = new_agent(office, "Eager", skip_idle_wakeups=False)
    ceo = new_agent(office, "Boss", role="ceo", skip_idle_wakeups=True)
    assert agent(office, ceo)["role"] == "coordinator"
    eager_wake, ceo_wake = routine_wake(office, eager, at(3)), routine_wake(office, ceo, at(3))
    dispatch(office, at(4))
    assert wakeup(office, eager_wake)["status"] == "claimed"
    assert wakeup(office, ceo_wake)["status"] == "finished"


def test_a_self_wake_merged_into_a_paused_routines_retry_still_runs(office):
    """Issue 24.2: what merged into a routine wakeup's pending retry ended with it when the
    routine was paused meanwhile. Only the routine's own part ends; the agent's self-wake runs."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    retry = fail_and_reschedule(office, routine_wake(office, lead, at(1), "r1"), at(2))
    selfwake = enqueue(office, lead, outpost.WakeupSource.SELF, {"reason": "check the deploy"}, at(3))
    assert wakeup(office, selfwake)["coalesced_into"] == retry["id"]

    def pause_routine():
        office.db.Routine["r1"].status = "paused"
    office.transaction(pause_routine)
    (run_id,) = dispatch(office, retry_due(retry))
    assert (wakeup(office, retry["id"])["status"], wakeup(office, selfwake)["run_id"]) == ("finished", run_id)
    assert "check the deploy" in office_run(office, run_id)["assembled_prompt"]


def test_wakeups_merged_into_one_that_then_joins_a_pending_retry_come_along(office):
    """Found with issue 24: a wakeup that joined a pending retry brought only its own payload;
    the requests merged into it earlier were left pointing at it and never reached a run."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    retrying = routine_wake(office, lead, at(0))
    (run1,) = dispatch(office, at(1))
    start(office, run1, at(1))
    first = enqueue(office, lead, outpost.WakeupSource.USER, {"user_id": "u", "context": "first look"}, at(2))
    second = enqueue(office, lead, outpost.WakeupSource.USER, {"user_id": "u", "context": "second look"}, at(3))
    assert wakeup(office, second)["coalesced_into"] == first   # the 5 s window
    settle(office, run1, "failed", at(4), error="network timeout", exit_code=1)
    assert dispatch(office, at(5)) == []   # the user's wakeup joins the pending retry
    assert wakeup(office, first)["coalesced_into"] == retrying
    (run2,) = dispatch(office, retry_due(wakeup(office, retrying)))
    prompt = office_run(office, run2)["assembled_prompt"]
    assert "first look" in prompt and "second look" in prompt
    assert wakeup(office, retrying)["coalesced_count"] == 3
    assert wakeup(office, first)["run_id"] == wakeup(office, second)["run_id"] == run2


def settle_all(store: outpost.Store, now: datetime, run_ids: list[str] | None = None,
               status: str = "succeeded") -> None:
    """Settle the given runs (default: every queued or running run)."""
    for run_id in run_ids if run_ids is not None else call(store, store.runs.own_runs_in, ["queued", "running"]):
        settle(store, run_id, status, now)


# --- coalescing, dedup and the claim query -------------------------------------------------------------

def test_two_wakeups_within_coalescing_window_merge(office):
    lead = new_agent(office, "Lead", role="coordinator")
    first = routine_wake(office, lead, at(0), "r1")
    second = routine_wake(office, lead, at(3), "r1", variables={"reason": "manual"})
    w1, w2 = wakeup(office, first), wakeup(office, second)
    assert (w1["status"], w1["coalesced_count"]) == ("queued", 2)
    assert (w2["status"], w2["coalesced_into"]) == ("coalesced", first)
    # The second's payload joins the first's context snapshot.
    (run_id,) = dispatch(office, at(4))
    snapshot = office_run(office, run_id)["context_snapshot"]
    assert [(x["source"], x["payload"]) for x in snapshot["wakeups"]] == [
        ("routine", {"routine_id": "r1", "variables": {}, "missed_ticks": 0}),
        ("routine", {"routine_id": "r1", "variables": {"reason": "manual"}, "missed_ticks": 0})]
    assert snapshot["wakeups"][1]["requested_at"] == outpost.rfc3339(at(3))
    assert wakeup(office, second)["run_id"] == run_id
    assert office_run(office, run_id)["coalesced_wakeups"] == [second]
    assert office_run(office, run_id)["assembled_prompt"].count("- routine: a routine fired") == 2
    # Outside the window, with no run in flight for it, a wakeup is queued on its own.
    settle(office, run_id, "succeeded", at(5))
    third = routine_wake(office, lead, at(100))
    fourth = routine_wake(office, lead, at(106))
    assert wakeup(office, third)["status"] == wakeup(office, fourth)["status"] == "queued"
    # Different sources do not share a window.
    user = enqueue(office, lead, outpost.WakeupSource.USER, {"user_id": "u"}, at(107))
    assert wakeup(office, user)["status"] == "queued"


def test_wakeup_merges_into_unstarted_run_of_same_scope(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "Refactor", assignee_agent_id=worker)
    (run_id,) = dispatch(office, at(1))
    claimed = only(wakeups(office, worker))
    call(office, office.office.add_comment, tid, "Keep the public API stable", at(MINUTE))
    comment = only(wakeups(office, worker, source="comment"))
    assert (comment["status"], comment["coalesced_into"], comment["run_id"]) == ("coalesced", claimed["id"], run_id)
    assert wakeup(office, claimed["id"])["coalesced_count"] == 2
    view = office_run(office, run_id)
    assert [x["source"] for x in view["context_snapshot"]["wakeups"]] == ["task_assigned", "comment"]
    assert "Keep the public API stable" in view["assembled_prompt"]
    assert call(office, office.runs.get_run, run_id)["status"] == "queued"
    assert "Keep the public API stable" in call(office, office.runs.launch_info, run_id)["prompt"]
    # Once the run has started, new context waits for the next session instead.
    start(office, run_id, at(MINUTE + 1))
    call(office, office.office.add_comment, tid, "One more thing", at(MINUTE + 2))
    assert only(wakeups(office, worker, source="comment", status="queued"))["payload"]["task_id"] == tid


def test_wakeup_for_other_task_stays_queued(office):
    worker = new_agent(office, "Worker")
    first = new_task(office, "first", assignee_agent_id=worker)
    (run_id,) = dispatch(office, at(1))
    second = new_task(office, "second", at(2), assignee_agent_id=worker)
    w2 = only(wakeups(office, worker, status="queued"))
    assert (w2["payload"], w2["coalesced_count"], w2["run_id"]) == ({"task_id": second}, 1, None)
    # A taskless wake does not join a task-bound run either.
    user = enqueue(office, worker, outpost.WakeupSource.USER, {"user_id": "u"}, at(3))
    assert wakeup(office, user)["status"] == "queued"
    assert office_run(office, run_id)["task_id"] == first
    assert len(office_run(office, run_id)["context_snapshot"]["wakeups"]) == 1


def test_idempotency_key_dedup_within_24h_and_free_after(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "t", assignee_agent_id=worker)
    payload = {"task_id": tid, "comment_id": "cmt_1"}
    first = enqueue(office, worker, outpost.WakeupSource.COMMENT, payload, at(0))
    assert wakeup(office, first)["idempotency_key"] == "comment:cmt_1"
    # A re-delivery within 24 h is the same request: nothing new is inserted, whatever became of it.
    assert enqueue(office, worker, outpost.WakeupSource.COMMENT, payload, at(HOUR)) == first
    settle_all(office, at(HOUR + 10), dispatch(office, at(HOUR + 1)))
    assert wakeup(office, first)["status"] == "coalesced"
    assert enqueue(office, worker, outpost.WakeupSource.COMMENT, payload, at(24 * HOUR - 1)) == first
    assert len(wakeups(office, worker, source="comment")) == 1
    # After 24 h the key is free again.
    again = enqueue(office, worker, outpost.WakeupSource.COMMENT, payload, at(24 * HOUR + 1))
    assert again != first
    assert wakeup(office, again)["idempotency_key"] == "comment:cmt_1"
    assert wakeup(office, again)["status"] == "queued"
    assert len(wakeups(office, worker, source="comment")) == 2
    # Assignment events dedup the same way: task_assigned:<task>:<agent>.
    assert enqueue(office, worker, outpost.WakeupSource.TASK_ASSIGNED, {"task_id": tid}, at(2 * HOUR)) == only(
        wakeups(office, worker, source="task_assigned"))["id"]


def test_cooldown_respected(office):
    worker = new_agent(office, "Worker", cooldown_sec=30)
    new_task(office, "one", assignee_agent_id=worker)
    (run_id,) = dispatch(office, at(1))
    settle(office, run_id, "succeeded", at(100))
    assert agent(office, worker)["last_wakeup_finished_at"] == outpost.rfc3339(at(100))
    t2 = new_task(office, "two", at(101), assignee_agent_id=worker)
    assert call(office, office.office.next_wakeup_at, at(101)) == at(130)
    assert dispatch(office, at(129)) == []
    assert only(wakeups(office, worker, status="queued"))["payload"] == {"task_id": t2}
    assert len(dispatch(office, at(130))) == 1


def test_max_concurrent_sessions_respected(office):
    worker = new_agent(office, "Worker", max_concurrent_sessions=2, cooldown_sec=0)
    tasks = [new_task(office, f"t{i}", at(i), assignee_agent_id=worker) for i in range(3)]
    runs = dispatch(office, at(10))
    assert len(runs) == 2
    assert [office_run(office, r)["task_id"] for r in runs] == tasks[:2], "oldest first"
    third = only(wakeups(office, worker, status="queued"))
    assert third["payload"] == {"task_id": tasks[2]}
    start(office, runs[0], at(11))
    assert dispatch(office, at(12)) == []
    settle(office, runs[0], "succeeded", at(13))
    (run3,) = dispatch(office, at(13))
    assert office_run(office, run3)["task_id"] == tasks[2]
    assert len(wakeups(office, worker, status="claimed")) == 2


def test_checkout_held_by_other_agent_skips_wakeup(office):
    worker = new_agent(office, "Worker")
    other = new_agent(office, "Other")
    tid = new_task(office, "t")

    def lock_for_other():   # another agent holds the task (as a second Outpost on the same database could)
        office.db.Task[tid].checkout_agent_id = other
    office.transaction(lock_for_other)
    edit_task(office, tid, at(3), assignee_agent_id=worker)
    w = only(wakeups(office, worker))
    assert dispatch(office, at(4)) == []
    w = wakeup(office, w["id"])
    assert (w["status"], w["run_id"], w["retry_count"], w["scheduled_retry_at"]) == ("skipped", None, 0, None)
    assert other in w["note"]
    assert task(office, tid)["checkout_agent_id"] == other, "the holder keeps its lock"
    assert dispatch(office, at(HOUR)) == [], "skipped is final: no retry"
    assert wakeup(office, w["id"])["status"] == "skipped"


def test_budget_exhausted_pauses_agent_and_skips(office):
    lead = new_agent(office, "Lead", role="coordinator")
    worker = new_agent(office, "Worker", budget_runs_per_day=2)
    first = new_task(office, "one", assignee_agent_id=worker)
    settle_all(office, at(10), dispatch(office, at(1)))
    assert wakeups(office, lead, source="budget_alert") == []
    second = new_task(office, "two", at(20), assignee_agent_id=worker)
    (run2,) = [r for r in dispatch(office, at(21)) if office_run(office, r)["agent_id"] == worker]
    # Crossing 80 % of its budget tells the coordinator.
    alert = only(wakeups(office, lead, source="budget_alert"))
    assert alert["payload"] == {"agent_instance_id": worker, "budget_pct": 100}
    settle(office, run2, "succeeded", at(30))
    third = new_task(office, "three", at(40), assignee_agent_id=worker)
    assert [r for r in dispatch(office, at(41)) if office_run(office, r)["agent_id"] == worker] == []
    w = only(wakeups(office, worker, source="task_assigned", status="skipped"))
    assert w["payload"] == {"task_id": third} and w["retry_count"] == 0 and w["scheduled_retry_at"] is None
    assert "budget" in w["note"]
    assert agent(office, worker)["status"] == "paused"
    assert task(office, third)["checkout_agent_id"] is None
    entry = only(activity(office, "wakeup_budget_blocked"))
    assert (entry["agent_id"], entry["task_id"], entry["wakeup_id"]) == (worker, third, w["id"])
    item = only(attention(office, "budget_blocked"))
    assert "Worker" in item["title"]
    assert {task(office, t)["state"] for t in (first, second)} == {"TODO"}


def test_a_budget_pause_keeps_the_agents_other_wakeups_queued_for_after_resume(office):
    """Issue 24.1: the budget pause drained the agent's other queued wakeups ("agent paused:
    no session"). The wakeup that met the used-up budget is skipped (the spec); the others
    wait and run once the agent is resumed."""
    worker = new_agent(office, "Worker", budget_runs_per_day=1, cooldown_sec=0)
    first = new_task(office, "one", assignee_agent_id=worker)
    settle_all(office, at(10), dispatch(office, at(1)))
    second = new_task(office, "two", at(20), assignee_agent_id=worker)
    call(office, office.office.add_comment, first, "one more detail", at(21))
    assert dispatch(office, at(22)) == []
    assert agent(office, worker)["status"] == "paused"
    assert only(wakeups(office, worker, status="skipped"))["payload"] == {"task_id": second}
    comment = only(wakeups(office, worker, source="comment"))
    assert (comment["status"], comment["run_id"], comment["note"]) == ("queued", None, None)
    # The user raises the budget and sets the agent back to idle: the comment is worked.
    edit_agent(office, worker, at(HOUR), budget_runs_per_day=10, status="idle")
    (run_id,) = dispatch(office, at(HOUR))
    assert wakeup(office, comment["id"])["run_id"] == run_id
    assert "one more detail" in office_run(office, run_id)["assembled_prompt"]


def test_a_budget_alert_fires_once_when_a_run_jumps_past_80_percent(office):
    """Defect 16: the alert fired only when the day's runs equalled 80 % exactly; after the
    budget was lowered the next run jumped past it and nobody heard. It fires once per window."""
    lead = new_agent(office, "Lead", role="coordinator")
    worker = new_agent(office, "Worker", budget_runs_per_day=10, cooldown_sec=0)
    for i in range(5):
        new_task(office, f"t{i}", at(10 * i), assignee_agent_id=worker)
        settle_all(office, at(10 * i + 5), dispatch(office, at(10 * i + 1)))
    assert wakeups(office, lead, source="budget_alert") == []
    edit = outpost.normalize_agent({"budget_runs_per_day": 6}, profiles=list(PROFILES),
                                   current=call(office, office.office.agent_fields, worker))
    call(office, office.office.update_agent, worker, edit, at(60))    # 80 % of 6 is 5: already reached
    new_task(office, "t5", at(70), assignee_agent_id=worker)
    settle_all(office, at(75), [r for r in dispatch(office, at(71)) if office_run(office, r)["agent_id"] == worker])
    alert = only(wakeups(office, lead, source="budget_alert"))
    assert alert["payload"] == {"agent_instance_id": worker, "budget_pct": 100}
    new_task(office, "t6", at(80), assignee_agent_id=worker)   # the 7th run of the day: over budget, no alert
    dispatch(office, at(81))
    assert len(wakeups(office, lead, source="budget_alert")) == 1


def test_the_continuation_summary_counts_only_its_own_workspaces_escalations(office):
    """Defect 16: the summary's escalation count read the agent errors of every workspace."""
    other = call(office, office.office.create_workspace, "Research", at(0))["id"]
    set_repository(office, "/tmp/repo", other)
    stranger = new_agent(office, "Stranger", workspace_id=other)
    call(office, office.office.wake_agent, stranger, outpost.WakeupSource.USER, {"user_id": "api"}, at(0),
         workspace_id=other)
    assert call(office, office.pipeline.fail_first_claimable, at(1), "boom")   # an escalation over there
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    routine_wake(office, lead, at(2), "r1")
    (run_id,) = dispatch(office, at(3))
    settle(office, run_id, "succeeded", at(4), result={"summary": "all quiet"})
    (row,) = call(office, office.office.summary_of, lead)
    assert " 0 agent errors in the last 24 h" in row["content"], row["content"]


def test_workspace_budget_exhausted_blocks_every_agent(office):
    set_repository(office, call(office, office.office.office_settings, None)["repository"], budget_runs_per_day=1)
    a, b = new_agent(office, "A"), new_agent(office, "B")
    new_task(office, "one", assignee_agent_id=a)
    new_task(office, "two", at(1), assignee_agent_id=b)
    (run_id,) = dispatch(office, at(2))
    assert office_run(office, run_id)["agent_id"] == a
    assert agent(office, b)["status"] == "paused"
    assert "workspace budget" in only(activity(office, "wakeup_budget_blocked"))["data"]["detail"]


def test_executor_resolution_order(office):
    demo = outpost.demo_profile()
    profiles = {name: dataclasses.replace(demo, name=name) for name in ("task-x", "agent-x", "project-x", "ws-x")}
    names = list(profiles)
    current = call(office, office.office.office_settings, None)
    call(office, office.office.update_office_settings, None,
         outpost.normalize_settings({"default_executor": "ws-x"}, profiles=names, current=current))
    project = call(office, office.office.create_project, None, "App", None, "project-x", T0)["id"]
    with_pref = new_agent(office, "Pref", executor="agent-x", profiles=names, cooldown_sec=0)
    no_pref = new_agent(office, "NoPref", executor=None, profiles=names, cooldown_sec=0)
    cases = [
        (new_task(office, "override", at(1), profiles=names, executor="task-x", project_id=project,
                  assignee_agent_id=with_pref), "task-x"),
        (new_task(office, "agent", at(2), profiles=names, project_id=project, assignee_agent_id=with_pref),
         "agent-x"),
        (new_task(office, "project", at(3), profiles=names, project_id=project, assignee_agent_id=no_pref),
         "project-x"),
        (new_task(office, "workspace", at(4), profiles=names, assignee_agent_id=no_pref), "ws-x"),
    ]
    by_task, now = {}, at(10)
    while run_ids := dispatch(office, now, profiles):
        by_task |= {office_run(office, r)["task_id"]: r for r in run_ids}
        settle_all(office, now, run_ids)
        now += timedelta(seconds=1)
    assert {tid: call(office, office.runs.get_run, by_task[tid])["agent"] for tid, _ in cases} == dict(cases)
    assert outpost.resolve_executor(None, None, None, None) is None
    assert outpost.resolve_executor("t", "a", "p", "w") == "t"
    assert outpost.resolve_executor(None, None, "p", "w") == "p"


def test_no_executor_anywhere_fails_into_retry(office):
    idle = new_agent(office, "Nobody", executor=None)
    wid = enqueue(office, idle, outpost.WakeupSource.USER, {"user_id": "u"}, at(1))
    assert dispatch(office, at(2)) == []
    w = wakeup(office, wid)
    assert (w["status"], w["retry_count"]) == ("queued", 1)
    assert w["last_error"].startswith("no executor")


# --- prompts, sessions and the continuation summary -------------------------------------------------------

def test_continuation_summary_upserted_after_taskless_success_and_kept_on_builder_failure(office, monkeypatch):
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    routine_wake(office, lead, at(0), "r1")
    (run1,) = dispatch(office, at(1))
    assert office_run(office, run1)["summary_injected"] == ""
    settle(office, run1, "succeeded", at(2), result={"status": "succeeded", "summary": "Reviewed 3 upstream PRs"})
    (row,) = call(office, office.office.summary_of, lead)
    assert (row["scope"], row["updated_by_run_id"]) == ("routine:r1", run1)
    assert row["updated_at"] == outpost.rfc3339(at(2))
    for section in ("## Active focus", "## Open blockers", "## Recent decisions", "## Next action"):
        assert section in row["content"]
    assert "Reviewed 3 upstream PRs" in row["content"] and "Continue monitoring." in row["content"]
    assert row["content_tokens"] == len(row["content"]) // 4
    # The next fire of that routine reads it; a failed run leaves it alone.
    routine_wake(office, lead, at(10), "r1")
    (run2,) = dispatch(office, at(10))
    view = office_run(office, run2)
    assert view["summary_injected"] == row["content"]
    assert "## Continuation summary\n" + row["content"] in view["assembled_prompt"]
    settle(office, run2, "failed", at(11), error="boom", exit_code=1)
    assert call(office, office.office.summary_of, lead) == [row]
    # A builder failure on a successful run: the last good summary stays; the wakeup still finishes.
    def broken(*args, **kwargs):
        raise RuntimeError("builder exploded")
    monkeypatch.setattr(outpost, "build_summary", broken)
    (retried,) = dispatch(office, at(10 * HOUR))    # the failed r1 fire, retried
    settle(office, retried, "succeeded", at(10 * HOUR + 1), result={"summary": "new facts"})
    assert call(office, office.office.summary_of, lead) == [row]
    assert wakeup(office, office_run(office, retried)["wakeup_id"])["status"] == "finished"
    monkeypatch.undo()
    # The next successful run rebuilds; each routine has its own chain; task-bound runs never write one.
    routine_wake(office, lead, at(11 * HOUR), "r2")
    (run3,) = dispatch(office, at(11 * HOUR))
    settle(office, run3, "succeeded", at(11 * HOUR + 1), result={"message": "r2 checked"})
    summaries = {s["scope"]: s for s in call(office, office.office.summary_of, lead)}
    assert set(summaries) == {"routine:r1", "routine:r2"}
    assert summaries["routine:r1"] == row
    assert "r2 checked" in summaries["routine:r2"]["content"]
    assert "r2 checked" not in summaries["routine:r1"]["content"]
    new_task(office, "bound", at(12 * HOUR), assignee_agent_id=lead)
    (run4,) = dispatch(office, at(12 * HOUR))
    settle(office, run4, "succeeded", at(12 * HOUR + 1), result={"summary": "task work"})
    assert {s["scope"] for s in call(office, office.office.summary_of, lead)} == {"routine:r1", "routine:r2"}


def test_summary_builder_is_deterministic_and_capped_8kb():
    now = datetime(2026, 4, 25, 9, 0, tzinfo=UTC)
    stats = {"open_tasks": 4, "in_progress": 1, "in_review": 2, "failed_runs": 0, "escalations": 0}
    first = outpost.build_summary("", {"summary": "Merged the lockfile update"}, stats, [], now)
    assert first == outpost.build_summary("", {"summary": "Merged the lockfile update"}, stats, [], now)
    assert first.splitlines()[0] == "## Active focus"
    assert "4 open tasks (1 in progress, 2 in review)" in first
    assert "- 2026-04-25: Merged the lockfile update" in first
    assert first.rstrip().endswith("Follow up on the tasks waiting in review.")
    # The fallback chain: summary -> result -> message -> error.
    assert "- 2026-04-25: from result" in outpost.build_summary("", {"result": "from result", "error": "e"},
                                                                stats, [], now)
    assert "- 2026-04-25: from error" in outpost.build_summary("", {"error": "from error"}, stats, [], now)
    # Decisions carry over from the previous summary, the last five kept.
    text = ""
    for i in range(8):
        text = outpost.build_summary(text, {"summary": f"decision {i}"}, stats, [], now + timedelta(days=i))
    decisions = outpost._section(text, "Recent decisions")
    assert [d.split(": ", 1)[1] for d in decisions] == [f"decision {i}" for i in range(3, 8)]
    # Escalations and blockers drive the next action.
    assert "Look into the agent errors" in outpost.build_summary("", None, {**stats, "escalations": 1}, [], now)
    assert "Unblock the blocked tasks above." in outpost.build_summary("", None, {}, ["Build waits on Spec"], now)
    # Never above 8 KB, even with many long multi-byte blockers, and still valid text.
    blockers = [("é" * 400) + f" #{i}" for i in range(40)]
    huge = outpost.build_summary("## Recent decisions\n" + "- x\n" * 5000, {"summary": "ü" * 5000}, stats,
                                 blockers, now)
    assert len(huge.encode()) <= 8 * 1024
    assert huge == outpost.build_summary("## Recent decisions\n" + "- x\n" * 5000, {"summary": "ü" * 5000},
                                         stats, blockers, now)


def test_prompt_has_summary_slice_1500_chars(office):
    summary = "".join(f"{i:05d}|" for i in range(1000))           # 6,000 characters
    prompt = outpost.assemble_prompt(agent={"name": "Lead", "role": "coordinator", "instructions": None},
                                     wakeups=[{"source": "routine", "reason": "routine",
                                               "payload": {"routine_id": "r1"}}],
                                     task=None, comments=[], blockers=[], summary=summary, resume=False)
    assert "## Continuation summary\n" + summary[:1500] + "\n" in prompt
    assert summary[:1501] not in prompt
    # Through the store: the injected snapshot is the same 1,500-character slice.
    lead = new_agent(office, "Lead", role="coordinator")
    office.transaction(lambda: office.db.ContinuationSummary(agent_id=lead, scope="routine:r1", content=summary,
                                                     updated_at=outpost.naive(T0)))
    routine_wake(office, lead, at(1), "r1")
    (run_id,) = dispatch(office, at(2))
    view = office_run(office, run_id)
    assert view["summary_injected"] == summary[:1500]
    assert summary[:1500] in view["assembled_prompt"] and summary[:1501] not in view["assembled_prompt"]


def test_task_bound_resume_uses_session_and_delta_prompt(office):
    worker = new_agent(office, "Worker", instructions="Always write tests.")
    tid = new_task(office, "Add caching", description="SECRET-DESCRIPTION: use an LRU", assignee_agent_id=worker)
    call(office, office.office.add_comment, tid, "early comment", at(1))
    (run1,) = dispatch(office, at(2))
    first = office_run(office, run1)
    assert first["resumed"] is False and first["session_id"] is None
    assert "SECRET-DESCRIPTION" in first["assembled_prompt"] and "Always write tests." in first["assembled_prompt"]
    assert "early comment" in first["assembled_prompt"]
    assert call(office, office.runs.launch_info, run1)["resume_session"] is None
    settle(office, run1, "succeeded", at(10), result={"status": "succeeded", "session_id": "sess-42"})
    assert office_run(office, run1)["session_id"] == "sess-42"
    call(office, office.office.add_comment, tid, "Please also handle eviction", at(20))
    (run2,) = dispatch(office, at(21))
    second = office_run(office, run2)
    assert (second["resumed"], second["session_id"]) == (True, "sess-42")
    assert call(office, office.runs.launch_info, run2)["resume_session"] == "sess-42"
    prompt = second["assembled_prompt"]
    assert "SECRET-DESCRIPTION" not in prompt and "Always write tests." not in prompt
    assert "## New comments" in prompt and "Please also handle eviction" in prompt
    assert "early comment" not in prompt
    assert "## Why you woke (since your last run)" in prompt


@pytest.mark.parametrize("error", ["No conversation found with session ID: sess-42", "Error: session not found"])
def test_a_dead_session_is_dropped_and_the_wakeup_runs_once_fresh_without_a_retry(office, error):
    """Defect 7: when resuming a stored session failed, the session was kept: every retry
    resumed the same dead session, failed, and escalated. It is dropped and the same wakeup
    runs once fresh, its retry count untouched."""
    worker = new_agent(office, "Worker")
    tid = new_task(office, "Add caching", description="THE-DESCRIPTION", assignee_agent_id=worker)
    (run1,) = dispatch(office, at(2))
    settle(office, run1, "succeeded", at(10), result={"status": "succeeded", "session_id": "sess-42"})
    call(office, office.office.add_comment, tid, "Please also handle eviction", at(20))
    (run2,) = dispatch(office, at(21))
    assert office_run(office, run2)["resumed"] is True
    settle(office, run2, "failed", at(25), error=error, exit_code=1)
    w = wakeup(office, office_run(office, run2)["wakeup_id"])
    assert (w["status"], w["retry_count"], w["scheduled_retry_at"]) == ("queued", 0, None)
    (run3,) = dispatch(office, at(40))   # after the agent's cooldown
    fresh = office_run(office, run3)
    assert (fresh["resumed"], fresh["session_id"]) == (False, None)
    assert "THE-DESCRIPTION" in fresh["assembled_prompt"]   # a fresh session gets the whole task again
    assert call(office, office.runs.launch_info, run3)["resume_session"] is None


def test_resumed_session_prompt_has_comment_posted_during_previous_run(office):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "t", assignee_agent_id=worker)
    (run1,) = dispatch(office, at(1))
    start(office, run1, at(2))
    call(office, office.office.add_comment, tid, "PLEASE-SEE-THIS", at(3))       # the agent is busy: queued
    settle(office, run1, "succeeded", at(20), result={"session_id": "sess-1"})
    (run2,) = dispatch(office, at(40))
    view = office_run(office, run2)
    assert view["resumed"] is True
    assert "PLEASE-SEE-THIS" in view["assembled_prompt"]


def test_taskless_runs_never_resume(office):
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    routine_wake(office, lead, at(0))
    (run1,) = dispatch(office, at(1))
    settle(office, run1, "succeeded", at(2), result={"summary": "ok", "session_id": "sess-taskless"})
    assert office_run(office, run1)["session_id"] is None
    routine_wake(office, lead, at(10))
    (run2,) = dispatch(office, at(10))
    view = office_run(office, run2)
    assert (view["resumed"], view["session_id"]) == (False, None)
    assert call(office, office.runs.launch_info, run2)["resume_session"] is None
    assert "You are Lead, a coordinator agent" in view["assembled_prompt"]


# --- durability --------------------------------------------------------------------------------------------

def test_restart_resumes_queued_and_scheduled_retries(tmp_path):
    path = tmp_path / "office.sqlite3"
    store = outpost.Store(path)
    set_repository(store, tmp_path / "repo")
    a, b = new_agent(store, "A"), new_agent(store, "B")
    t_a = new_task(store, "a's", assignee_agent_id=a)
    retry = fail_and_reschedule(store, only(wakeups(store, a))["id"], at(1))
    t_b = new_task(store, "b's", at(2), assignee_agent_id=b)
    queued = only(wakeups(store, b))
    store.close()

    store = outpost.Store(path)   # the restart
    try:
        assert wakeup(store, retry["id"])["status"] == "queued"
        assert wakeup(store, retry["id"])["scheduled_retry_at"] == retry["scheduled_retry_at"]
        next_at = call(store, store.office.next_wakeup_at, at(20))
        assert abs(next_at - instant(retry["scheduled_retry_at"])) < timedelta(milliseconds=1)
        (run_b,) = dispatch(store, at(20))
        assert office_run(store, run_b)["task_id"] == t_b
        assert wakeup(store, queued["id"])["status"] == "claimed"
        (run_a,) = dispatch(store, retry_due(retry))
        assert office_run(store, run_a)["task_id"] == t_a
        assert wakeup(store, retry["id"])["run_id"] == run_a
    finally:
        store.close()


@pytest.mark.parametrize("step", ["_checkout", "budget_exceeded"])   # during, then after the checkout
def test_crash_between_pipeline_steps_leaves_wakeup_consistent(office, monkeypatch, step):
    worker = new_agent(office, "Worker")
    tid = new_task(office, "t", assignee_agent_id=worker)
    w = only(wakeups(office, worker))

    def crash(self, *args, **kwargs):
        raise RuntimeError(f"power cut in {step}")
    monkeypatch.setattr(outpost.PipelineStore, step, crash)
    with pytest.raises(RuntimeError):
        call(office, office.pipeline.dispatch_wakeups, at(1), PROFILES)
    # The claim and the checkout were one transaction with the crash: nothing of them stayed.
    after = wakeup(office, w["id"])
    assert (after["status"], after["claimed_at"], after["run_id"]) == ("queued", None, None)
    assert task(office, tid)["checkout_agent_id"] is None
    assert agent(office, worker)["status"] == "idle"
    assert call(office, office.runs.own_runs_in, ["queued", "running"]) == []
    monkeypatch.undo()
    (run_id,) = dispatch(office, at(2))
    assert wakeup(office, w["id"])["run_id"] == run_id


def test_run_interrupted_at_boot_is_claimed_again_with_a_new_run(office):
    """A session the daemon's death interrupted is not the agent's failure: the wakeup is
    claimed again (spec: claimed wakeups are re-claimed on restart) with a fresh run; the
    interrupted run itself is never replayed. Issue 24.6b: it is no retry either, so five
    restarts during a long run do not escalate it."""
    lead = new_agent(office, "Lead", role="coordinator")
    worker = new_agent(office, "Worker", cooldown_sec=0)
    tid = new_task(office, "t", assignee_agent_id=worker)
    w = only(wakeups(office, worker))
    (run_id,) = dispatch(office, at(1))
    start(office, run_id, at(2))
    # The daemon died; at the next start recover_at_boot settles the run failed/interrupted.
    assert call(office, office.runs.settle_run, run_id, ended(outpost.RunStatus.FAILED, error="interrupted"), at(HOUR))
    w = wakeup(office, w["id"])
    assert (w["status"], w["retry_count"], w["scheduled_retry_at"]) == ("queued", 0, None)
    assert task(office, tid)["checkout_agent_id"] is None
    assert call(office, office.runs.get_run, run_id)["status"] == "failed"
    (again,) = dispatch(office, at(HOUR))
    assert again != run_id and wakeup(office, w["id"])["run_id"] == again
    assert call(office, office.runs.own_runs_in, ["queued"]) == [again]
    # Restarted again and again during a long session: never escalated, never a retry counted.
    now = at(HOUR)
    for _ in range(outpost.MAX_RETRY_COUNT + 1):
        latest = wakeup(office, w["id"])["run_id"]
        settle(office, latest, "failed", now, error="interrupted")
        now += timedelta(seconds=1)
        dispatch(office, now)
    w = wakeup(office, w["id"])
    assert (w["status"], w["retry_count"]) == ("claimed", 0)
    assert attention(office, "agent_error") == [] and wakeups(office, lead, source="agent_error") == []
    # The agent's own failure still counts.
    settle(office, w["run_id"], "failed", now, error="network timeout", exit_code=1)
    assert wakeup(office, w["id"])["retry_count"] == 1


def test_claimed_wakeup_with_queued_run_is_not_redispatched_after_restart(tmp_path):
    path = tmp_path / "office.sqlite3"
    store = outpost.Store(path)
    set_repository(store, tmp_path / "repo")
    worker = new_agent(store, "Worker")
    new_task(store, "t", assignee_agent_id=worker)
    (run_id,) = dispatch(store, at(1))
    store.close()
    store = outpost.Store(path)
    try:
        assert dispatch(store, at(2 * 24 * HOUR)) == []
        assert only(wakeups(store, worker))["status"] == "claimed"
        assert call(store, store.runs.admit_next, 2, at(2 * 24 * HOUR)) == (run_id, False)
    finally:
        store.close()


# --- the real claim actor under MockClock: worktree, demo agent, settlement -------------------------------

def office_deps(mock_deps: outpost.Deps, repo: Path) -> outpost.Deps:
    set_repository(mock_deps.store, repo)
    return mock_deps


async def test_actor_task_assigned_runs_end_to_end_and_resumes_its_session(autojump_clock, mock_deps, git_repo):
    deps = office_deps(mock_deps, git_repo)
    store = deps.store
    worker = new_agent(store, "Worker", deps.clock.now())
    tid = new_task(store, "Write notes", deps.clock.now(), description="@commit notes.txt hello\n@print working",
                   assignee_agent_id=worker)
    w = only(wakeups(store, worker))
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.claim_actor, deps)
            await until(lambda: wakeup(store, w["id"])["status"] == "finished")
            run1 = office_run(store, wakeup(store, w["id"])["run_id"])
            assert run1["status"] == "succeeded", run1
            assert run1["changes"]["commits"] == 1
            assert run1["result"]["session_id"].startswith("demo-")
            assert run1["session_id"] == run1["result"]["session_id"]
            assert "working" in outpost.read_log(deps.log_path(run1["id"]))[0]
            assert agent(store, worker)["status"] == "idle"
            assert task(store, tid)["checkout_agent_id"] is None
            assert not deps.worktree(run1["id"]).exists()
            # A comment from the user: the next session resumes the first one, with only the delta.
            call(store, store.office.add_comment, tid, "@print resumed-with-delta", deps.clock.now())
            deps.claim_wake.poke()
            comment = only(wakeups(store, worker, source="comment"))
            await until(lambda: wakeup(store, comment["id"])["status"] == "finished")
            run2 = office_run(store, wakeup(store, comment["id"])["run_id"])
            nursery.cancel_scope.cancel()
    assert run2["status"] == "succeeded", run2
    assert (run2["resumed"], run2["session_id"]) == (True, run1["session_id"])
    assert run2["result"]["session_id"] == run1["session_id"], "the demo agent continued that session"
    assert "@commit" not in run2["assembled_prompt"]
    assert "resumed-with-delta" in outpost.read_log(deps.log_path(run2["id"]))[0]
    # The cooldown (10 s) separated the two sessions.
    assert instant(run2["started_at"]) >= instant(run1["finished_at"]) + timedelta(seconds=10)


async def test_actor_comment_waits_for_running_session_then_runs(autojump_clock, mock_deps, git_repo):
    deps = office_deps(mock_deps, git_repo)
    store = deps.store
    worker = new_agent(store, "Worker", deps.clock.now(), cooldown_sec=0)
    tid = new_task(store, "Slow", deps.clock.now(), description="@sleep 1", assignee_agent_id=worker)
    first = only(wakeups(store, worker))
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.claim_actor, deps)
            run_id = await until(lambda: wakeup(store, first["id"])["run_id"])
            await until(lambda: call(store, store.runs.launch_info, run_id)["pid"])
            call(store, store.office.add_comment, tid, "@print saw-the-comment", deps.clock.now())
            deps.claim_wake.poke()
            comment = only(wakeups(store, worker, source="comment"))
            await trio.sleep(0.2)
            assert call(store, store.runs.get_run, run_id)["status"] == "running"
            assert wakeup(store, comment["id"])["status"] == "queued"
            await until(lambda: wakeup(store, comment["id"])["status"] == "finished")
            nursery.cancel_scope.cancel()
    run1, run2 = office_run(store, run_id), office_run(store, wakeup(store, comment["id"])["run_id"])
    assert run1["status"] == run2["status"] == "succeeded"
    assert instant(run2["started_at"]) >= instant(run1["finished_at"])
    assert run2["resumed"] is True
    assert f'comment_id="{comment["payload"]["comment_id"]}"' in run2["assembled_prompt"]
    assert "saw-the-comment" in run2["assembled_prompt"]   # the comment's own text reaches the resumed session


async def test_actor_reassigned_mid_run_the_new_agent_continues_the_task_branch_as_it_was_left(
        autojump_clock, mock_deps, git_repo):
    """Issue 24.4: reassigning a task during a run cancels that run; its edits (committed or
    not) are saved on its branch, and only then does the new assignee start, from that branch."""
    deps = office_deps(mock_deps, git_repo)
    store = deps.store
    api = OfficeApi(deps, git_repo)
    ada, bob = new_agent(store, "Ada", deps.clock.now(), cooldown_sec=0), new_agent(store, "Bob", deps.clock.now())
    tid = new_task(store, "Port the parser", deps.clock.now(), assignee_agent_id=ada,
                   description="@commit a.txt first\n@edit b.txt draft\n@sleep 600")
    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.claim_actor, deps)
            run_a = await until(lambda: only(wakeups(store, ada))["run_id"])
            branch_a = outpost.office_branch(tid, "Ada")
            await until(lambda: (deps.worktree(run_a, branch_a) / "b.txt").exists())   # Ada is at work
            edited = await api.patch(f"/api/office/tasks/{tid}", {"assignee_agent_id": bob,
                                                                  "description": "@print bob takes over"},
                                     headers={"Authorization": f"Bearer {deps.token}"})
            assert edited.status == 200, edited.body
            deps.claim_wake.poke()
            bobs = await until(lambda: (w := wakeups(store, bob)) and w[0]["status"] == "finished" and w[0])
            assert call(store, store.runs.get_run, run_a)["status"] == "cancelled", "Bob worked beside Ada"
            nursery.cancel_scope.cancel()
    first, second = office_run(store, run_a), office_run(store, bobs["run_id"])
    assert first["status"] == "cancelled" and first["changes"]["commits"] == 2   # Ada's commit and her leftovers
    assert second["status"] == "succeeded", second
    assert instant(second["started_at"]) >= instant(first["finished_at"])
    assert second["resolved_commit"] == git(git_repo, "rev-parse", branch_a)
    branch_b = outpost.office_branch(tid, "Bob")
    assert git(git_repo, "show", f"{branch_b}:a.txt") == "first"
    assert git(git_repo, "show", f"{branch_b}:b.txt") == "draft"


async def test_actor_rate_limited_run_is_retried_at_the_parsed_reset(autojump_clock, mock_deps, git_repo):
    deps = office_deps(mock_deps, git_repo)
    store = deps.store
    worker = new_agent(store, "Worker", deps.clock.now())
    new_task(store, "Busy API", deps.clock.now(), description="@fail rate limit: try again in 20 seconds",
             assignee_agent_id=worker)
    w = only(wakeups(store, worker))
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.claim_actor, deps)
            first = await until(lambda: (x := wakeup(store, w["id"]))["retry_count"] == 1 and x)
            second = await until(lambda: (x := wakeup(store, w["id"]))["retry_count"] == 2 and x)
            nursery.cancel_scope.cancel()
    run1 = call(store, store.runs.get_run, first["run_id"])
    run2 = call(store, store.runs.get_run, second["run_id"])
    assert run1["status"] == "failed" and "try again in 20 seconds" in run1["error"]
    assert first["status"] == "queued"
    # 20 s from the moment the agent said so (while its run went on: under autojump, the real time
    # that starting and settling take moves the mock clock too), plus the 30 s buffer.
    retry = instant(first["scheduled_retry_at"])
    assert instant(run1["started_at"]) + timedelta(seconds=50) <= retry <= instant(run1["finished_at"]) + timedelta(
        seconds=50)
    assert run1["failure_kind"] == "limit"
    # The actor slept until the parsed reset (+30 s), not less.
    assert instant(run2["started_at"]) >= instant(first["scheduled_retry_at"])
    assert instant(run2["started_at"]) < instant(first["scheduled_retry_at"]) + timedelta(seconds=10)


async def test_a_wakeup_that_breaks_the_pipeline_is_failed_and_the_others_go_on(autojump_clock, mock_deps, git_repo,
                                                                                 monkeypatch):
    """A bug in one request (simulated: process_wakeup raises for it) must not stop the
    dispatcher, nor crash the daemon at every start: that wakeup fails, visibly, and the
    rest are dispatched."""
    deps = office_deps(mock_deps, git_repo)
    store = deps.store
    a, b = new_agent(store, "A", deps.clock.now()), new_agent(store, "B", deps.clock.now())
    bad = new_task(store, "bad", deps.clock.now(), assignee_agent_id=a)
    good = new_task(store, "good", deps.clock.now(), assignee_agent_id=b)
    bad_wakeup, good_wakeup = only(wakeups(store, a)), only(wakeups(store, b))
    real = outpost.PipelineStore.process_wakeup

    def broken(self, wakeup_id, now, profiles):
        if self.db.Wakeup[wakeup_id].task_id == bad:
            raise KeyError("a bug")
        return real(self, wakeup_id, now, profiles)
    monkeypatch.setattr(outpost.PipelineStore, "process_wakeup", broken)
    await outpost.dispatch_wakeups(deps)
    failed = wakeup(store, bad_wakeup["id"])
    assert (failed["status"], failed["run_id"]) == ("failed", None)
    assert "internal error while dispatching: KeyError" in failed["note"]
    assert [x["kind"] for x in attention(store, "agent_error")] == ["agent_error"]
    assert wakeup(store, good_wakeup["id"])["status"] == "claimed"
    assert task(store, good)["checkout_agent_id"] == b

"""The Office API (docs/office.md) and the agent API with its run-scoped token.

The first part runs in process through Quart's test client, like test_api.py: no actors run,
so a wakeup becomes a run only when a test calls the dispatcher and admission through the
store. The second part starts a real ``outpost serve`` with the demo agent."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from conftest import (
    PROBLEM,
    RFC3339_Z,
    SETTLED,
    T0,
    OfficeApi,
    Server,
    assert_problem,
    dispatch,
    git,
    make_deps,
    make_repo,
    wait_for,
)

import outpost

AGENT_FIELDS = {"id", "name", "role", "status", "executor", "max_concurrent_sessions", "cooldown_sec",
                "skip_idle_wakeups"}
TASK_FIELDS = {"id", "title", "description", "state", "assignee_agent_id", "parent_id", "blocked_by",
               "requires_approval", "reviewers", "project_id", "archived_at"}
WAKEUP_FIELDS = {"id", "agent_id", "source", "reason", "status", "cancel_reason", "coalesced_count", "retry_count",
                 "scheduled_retry_at", "idempotency_key", "payload", "run_id", "requested_at", "finished_at"}


@pytest.fixture
async def office_api(tmp_path: Path, git_repo: Path):
    deps = make_deps(tmp_path)
    api = OfficeApi(deps, git_repo)
    patched = await api.patch("/api/office/settings", {"repository": str(git_repo)})
    assert patched.status == 200, patched.body
    yield api
    deps.store.close()


###############################################################################
# 1. The Office API in process.
###############################################################################

# --- agents ---------------------------------------------------------------------------------------

async def test_create_read_list_and_edit_an_agent(office_api):
    created = await office_api.post("/api/office/agents", {"name": "Builder", "executor": "demo"})
    assert created.status == 201, created.body
    agent = created.body
    assert set(agent) >= AGENT_FIELDS
    assert agent["id"].startswith("agt_")
    assert (agent["name"], agent["role"], agent["status"], agent["executor"]) == ("Builder", "worker", "idle", "demo")
    assert (agent["max_concurrent_sessions"], agent["cooldown_sec"], agent["skip_idle_wakeups"]) == (1, 10, True)
    boss = (await office_api.post("/api/office/agents", {"name": "Boss", "role": "coordinator"})).body
    assert boss["role"] == "coordinator" and boss["skip_idle_wakeups"] is False and boss["executor"] is None

    listed = await office_api.get("/api/office/agents")
    assert listed.status == 200
    assert [a["id"] for a in listed.body["agents"]] == [agent["id"], boss["id"]]
    got = await office_api.get(f"/api/office/agents/{agent['id']}")
    assert got.status == 200 and got.body["name"] == "Builder"

    edited = await office_api.patch(f"/api/office/agents/{agent['id']}",
                                    {"status": "paused", "max_concurrent_sessions": 3, "cooldown_sec": 0})
    assert edited.status == 200, edited.body
    assert (edited.body["status"], edited.body["max_concurrent_sessions"], edited.body["cooldown_sec"]) == (
        "paused", 3, 0)
    assert edited.body["name"] == "Builder" and edited.body["executor"] == "demo"   # untouched fields stay
    assert (await office_api.get(f"/api/office/agents/{agent['id']}")).body["status"] == "paused"


BAD_AGENTS = [
    ({"name": "x", "bogus": 1}, "bogus"),
    ({"name": "x", "role": "boss"}, "role"),
    ({"name": "x", "role": ["worker"]}, "role"),
    ({"name": "x", "max_concurrent_sessions": 0}, "max_concurrent_sessions"),
    ({"name": "x", "max_concurrent_sessions": "1"}, "max_concurrent_sessions"),
    ({"name": "x", "cooldown_sec": -1}, "cooldown_sec"),
    ({"name": "x", "status": "working"}, "status"),
    ({"name": "x", "executor": "no-such-profile"}, "executor"),
    ({"name": "x", "skip_idle_wakeups": "yes"}, "skip_idle_wakeups"),
    ({"name": "   "}, "name"),
    ({}, "name"),
    ([], "body"),
    ("agent", "body"),
    (7, "body"),
]


async def test_bad_agent_is_422_naming_the_field(office_api):
    for body, field in BAD_AGENTS:
        reply = await office_api.post("/api/office/agents", body)
        assert_problem(reply, 422, "validation_failed", field)
    assert (await office_api.get("/api/office/agents")).body["agents"] == []


async def test_bad_agent_edit_is_422_and_changes_nothing(office_api):
    agent = await office_api.agent()
    for body, field in [({"max_concurrent_sessions": 0}, "max_concurrent_sessions"), ({"role": "boss"}, "role"),
                        ({"workspace_id": "ws_default"}, "workspace_id"), ({"nope": True}, "nope"),
                        ([1], "body")]:
        reply = await office_api.patch(f"/api/office/agents/{agent['id']}", body)
        assert_problem(reply, 422, "validation_failed", field)
    assert (await office_api.get("/api/office/agents")).body["agents"] == [agent]


async def test_malformed_json_on_the_office_api_is_422(office_api):
    reply = await office_api.request("POST", "/api/office/agents", raw=b'{"name": ')
    assert_problem(reply, 422, "validation_failed", "body")


async def test_unknown_ids_are_404(office_api):
    for method, path, body in [
            ("GET", "/api/office/agents/agt_nope", None), ("PATCH", "/api/office/agents/agt_nope", {"name": "x"}),
            ("POST", "/api/office/agents/agt_nope/wake", {}), ("GET", "/api/office/agents/agt_nope/runs", None),
            ("GET", "/api/office/tasks/tsk_nope", None), ("PATCH", "/api/office/tasks/tsk_nope", {"title": "x"}),
            ("POST", "/api/office/tasks/tsk_nope/move", {"state": "DONE"}),
            ("POST", "/api/office/tasks/tsk_nope/comments", {"body": "hi"}),
            ("POST", "/api/office/approvals/apr_nope/resolve", {"status": "approved"}),
            ("GET", "/api/office/runs/out_nope", None),
            ("GET", "/api/office/agents?workspace_id=ws_nope", None),
            ("GET", "/api/office/tasks?workspace_id=ws_nope", None),
            ("GET", "/api/office/settings?workspace_id=ws_nope", None),
            ("PATCH", "/api/office/settings?workspace_id=ws_nope", {"recovery_lookback_hours": 5})]:
        reply = await office_api.request(method, path, body)
        assert_problem(reply, 404, "not_found")


# --- tasks, moves and comments ---------------------------------------------------------------------

async def test_create_read_list_and_edit_a_task(office_api):
    worker = await office_api.agent("w")
    reviewer = await office_api.agent("r")
    parent = await office_api.task("parent")
    created = await office_api.post("/api/office/tasks", {
        "title": "Build it", "description": "the details", "assignee_agent_id": worker["id"],
        "parent_id": parent["id"], "reviewers": [reviewer["id"]], "requires_approval": True})
    assert created.status == 201, created.body
    task = created.body
    assert set(task) >= TASK_FIELDS
    assert task["id"].startswith("tsk_")
    assert (task["state"], task["assignee_agent_id"], task["parent_id"]) == ("TODO", worker["id"], parent["id"])
    assert (task["blocked_by"], task["reviewers"], task["requires_approval"]) == ([], [reviewer["id"]], True)
    assert task["project_id"] is None and task["archived_at"] is None

    listed = (await office_api.get("/api/office/tasks")).body["tasks"]
    assert {t["id"] for t in listed} == {parent["id"], task["id"]}
    mine = (await office_api.get(f"/api/office/tasks?assignee_agent_id={worker['id']}")).body["tasks"]
    assert [t["id"] for t in mine] == [task["id"]]
    got = (await office_api.get(f"/api/office/tasks/{parent['id']}")).body
    assert [s["id"] for s in got["subtasks"]] == [task["id"]]

    edited = await office_api.patch(f"/api/office/tasks/{task['id']}",
                                    {"title": "Build it well", "assignee_agent_id": None})
    assert edited.status == 200, edited.body
    assert edited.body["title"] == "Build it well" and edited.body["assignee_agent_id"] is None
    assert edited.body["description"] == "the details"

    archived = await office_api.patch(f"/api/office/tasks/{task['id']}", {"archived": True})
    assert RFC3339_Z.match(archived.body["archived_at"])
    assert [t["id"] for t in (await office_api.get("/api/office/tasks")).body["tasks"]] == [parent["id"]]
    every = (await office_api.get("/api/office/tasks?include_archived=true")).body["tasks"]
    assert {t["id"] for t in every} == {parent["id"], task["id"]}


async def test_bad_task_is_422_naming_the_field(office_api):
    other_ws = await office_api.workspace("Elsewhere")
    stranger = await office_api.agent("stranger", workspace_id=other_ws["id"])
    foreign_task = await office_api.task("theirs", workspace_id=other_ws["id"])
    for body, field in [
            ({"title": "t", "colour": "red"}, "colour"),
            ({"title": "t", "state": "DONE"}, "state"),
            ({"title": "t", "state": "NOPE"}, "state"),
            ({"title": "t", "assignee_agent_id": stranger["id"]}, "assignee_agent_id"),
            ({"title": "t", "assignee_agent_id": "agt_nope"}, "assignee_agent_id"),
            ({"title": "t", "reviewers": [stranger["id"]]}, "reviewers"),
            ({"title": "t", "parent_id": foreign_task["id"]}, "parent_id"),
            ({"title": "t", "blocked_by": [foreign_task["id"]]}, "blocked_by"),
            ({"title": "t", "blocked_by": "tsk_x"}, "blocked_by"),
            ({"title": ""}, "title"),
            ({"description": "no title"}, "title"),
            (["t"], "body")]:
        reply = await office_api.post("/api/office/tasks", body)
        assert_problem(reply, 422, "validation_failed", field)
    assert (await office_api.get("/api/office/tasks")).body["tasks"] == []
    assert await office_api.wakeups() == []


async def test_a_blocked_by_cycle_is_refused(office_api):
    a = await office_api.task("A")
    b = await office_api.task("B", blocked_by=[a["id"]])
    c = await office_api.task("C", blocked_by=[b["id"]])
    for task, blockers in [(a, [c["id"]]), (a, [b["id"]]), (a, [a["id"]])]:
        reply = await office_api.patch(f"/api/office/tasks/{task['id']}", {"blocked_by": blockers})
        assert_problem(reply, 422, "validation_failed", "blocked_by")
    assert (await office_api.get(f"/api/office/tasks/{a['id']}")).body["blocked_by"] == []
    fine = await office_api.patch(f"/api/office/tasks/{c['id']}", {"blocked_by": [a["id"], b["id"]]})
    assert fine.status == 200 and fine.body["blocked_by"] == [a["id"], b["id"]]


async def test_state_changes_only_through_move(office_api):
    task = await office_api.task()
    reply = await office_api.patch(f"/api/office/tasks/{task['id']}", {"state": "DONE"})
    assert_problem(reply, 422, "validation_failed", "state")
    for state in ("IN_PROGRESS", "IN_REVIEW", "DONE", "CANCELLED", "TODO"):
        moved = await office_api.post(f"/api/office/tasks/{task['id']}/move", {"state": state})
        assert moved.status == 200, moved.body
        assert moved.body["state"] == state
    for body in ({"state": "done"}, {"state": "ARCHIVED"}, {}, {"state": None}, {"state": 3}):
        reply = await office_api.post(f"/api/office/tasks/{task['id']}/move", body)
        assert_problem(reply, 422, "validation_failed", "state")
    assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["state"] == "TODO"


async def test_move_with_a_non_string_state_is_422_not_500(office_api):
    task = await office_api.task()
    for state in ([], {}, ["DONE"]):
        reply = await office_api.post(f"/api/office/tasks/{task['id']}/move", {"state": state})
        assert_problem(reply, 422, "validation_failed", "state")


async def test_move_with_an_unknown_field_is_422(office_api):
    task = await office_api.task()
    reply = await office_api.post(f"/api/office/tasks/{task['id']}/move", {"state": "DONE", "note": "shipped"})
    assert_problem(reply, 422, "validation_failed", "note")
    assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["state"] == "TODO"


async def test_a_non_string_workspace_id_is_422_not_500(office_api):
    for path, body in [("/api/office/agents", {"name": "n"}), ("/api/office/tasks", {"title": "t"}),
                       ("/api/office/projects", {"name": "p"})]:
        for workspace_id in (5, ["ws_default"]):
            reply = await office_api.post(path, {**body, "workspace_id": workspace_id})
            assert_problem(reply, 422, "validation_failed", "workspace_id")


async def test_assigning_a_task_wakes_its_agent_once(office_api):
    agent = await office_api.agent()
    task = await office_api.task(assignee_agent_id=agent["id"])
    [wakeup] = await office_api.wakeups()
    assert set(wakeup) >= WAKEUP_FIELDS
    assert wakeup["id"].startswith("wk_")
    assert (wakeup["agent_id"], wakeup["source"], wakeup["status"]) == (agent["id"], "task_assigned", "queued")
    assert wakeup["payload"] == {"task_id": task["id"]}
    assert wakeup["idempotency_key"] == f"task_assigned:{task['id']}:{agent['id']}"
    assert (wakeup["coalesced_count"], wakeup["retry_count"], wakeup["run_id"]) == (1, 0, None)
    assert RFC3339_Z.match(wakeup["requested_at"]) and wakeup["finished_at"] is None
    # Moving it to In Progress asks again (a move is its own event); still queued, it merges: one run.
    await office_api.post(f"/api/office/tasks/{task['id']}/move", {"state": "IN_PROGRESS"})
    rows = {w["id"]: w for w in await office_api.wakeups()}
    first = rows.pop(wakeup["id"])
    [moved] = rows.values()
    assert (moved["status"], moved["coalesced_into"], first["coalesced_count"]) == ("coalesced", wakeup["id"], 2)
    # An unassigned or kanban task wakes nobody.
    await office_api.task("loose")
    await office_api.task("kanban", assignee_agent_id=agent["id"], workflow="kanban")
    assert len(await office_api.wakeups()) == 2


async def test_a_comment_is_stored_and_wakes_the_assignee(office_api):
    agent = await office_api.agent()
    task = await office_api.task(assignee_agent_id=agent["id"])
    reply = await office_api.post(f"/api/office/tasks/{task['id']}/comments", {"body": "please also add tests"})
    assert reply.status == 201, reply.body
    comment = reply.body
    assert comment["id"].startswith("cmt_")
    assert (comment["task_id"], comment["author_agent_id"], comment["body"]) == (
        task["id"], None, "please also add tests")
    got = (await office_api.get(f"/api/office/tasks/{task['id']}")).body
    assert [c["id"] for c in got["comments"]] == [comment["id"]]
    [woken] = await office_api.wakeups("?source=comment")
    assert woken["agent_id"] == agent["id"]
    assert woken["payload"] == {"task_id": task["id"], "comment_id": comment["id"]}
    for body, field in [({"body": ""}, "body"), ({"body": 5}, "body"), ({"body": "x", "author": "me"}, "author"),
                        ("hi", "body")]:
        assert_problem(await office_api.post(f"/api/office/tasks/{task['id']}/comments", body), 422,
                       "validation_failed", field)


async def test_wakeups_list_filters_by_agent_and_status(office_api):
    a = await office_api.agent("a")
    b = await office_api.agent("b")
    ta = await office_api.task("for a", assignee_agent_id=a["id"])
    await office_api.task("for b", assignee_agent_id=b["id"])
    await office_api.patch(f"/api/office/agents/{b['id']}", {"status": "paused"})
    office_api.dispatch()   # a: claimed with a run; b (paused): still queued, no session
    mine = await office_api.wakeups(f"?agent_id={a['id']}")
    assert [(w["agent_id"], w["status"], w["payload"]["task_id"]) for w in mine] == [(a["id"], "claimed", ta["id"])]
    assert mine[0]["run_id"].startswith("out_")
    waiting = await office_api.wakeups("?status=queued")
    assert [(w["agent_id"], w["run_id"]) for w in waiting] == [(b["id"], None)]
    assert await office_api.wakeups(f"?agent_id={b['id']}&status=claimed") == []
    assert len(await office_api.wakeups()) == 2
    assert_problem(await office_api.get("/api/office/wakeups?status=sleeping"), 422, "validation_failed", "status")
    assert_problem(await office_api.get("/api/office/wakeups?source=whim"), 422, "validation_failed", "source")


async def test_a_paused_agents_wakeups_wait_and_run_after_it_is_resumed(office_api):
    """Issue 24.1: a comment posted while its agent was paused ended its wakeup ``finished``
    ("agent paused: no session") and nothing ran after resume. A paused agent claims nothing:
    its wakeups stay queued and run once it is idle again."""
    agent = await office_api.agent("Sleepy")
    assert (await office_api.patch(f"/api/office/agents/{agent['id']}", {"status": "paused"})).status == 200
    task = await office_api.task("Write the changelog", assignee_agent_id=agent["id"])
    reply = await office_api.post(f"/api/office/tasks/{task['id']}/comments", {"body": "mention the new flag"})
    assert reply.status == 201, reply.body
    assert office_api.dispatch() == []
    waiting = await office_api.wakeups(f"?agent_id={agent['id']}")
    assert sorted((w["source"], w["status"], w["run_id"]) for w in waiting) == [
        ("comment", "queued", None), ("task_assigned", "queued", None)]
    assert office_api.dispatch() == [], "a later pass leaves them waiting too"
    assert (await office_api.patch(f"/api/office/agents/{agent['id']}", {"status": "idle"})).status == 200
    [run_id] = office_api.dispatch()
    run = (await office_api.get(f"/api/office/runs/{run_id}")).body
    assert (run["agent_id"], run["task_id"]) == (agent["id"], task["id"])
    assert "mention the new flag" in run["assembled_prompt"]
    after = {w["source"]: w for w in await office_api.wakeups(f"?agent_id={agent['id']}")}
    assert after["task_assigned"]["status"] == "claimed" and after["comment"]["status"] == "coalesced"
    assert after["comment"]["run_id"] == run_id


async def test_user_wake_of_an_agent(office_api):
    agent = await office_api.agent()
    reply = await office_api.post(f"/api/office/agents/{agent['id']}/wake", {"context": "look at the flaky test"})
    assert reply.status == 202, reply.body
    assert (reply.body["source"], reply.body["status"], reply.body["agent_id"]) == ("user", "queued", agent["id"])
    assert reply.body["payload"]["context"] == "look at the flaky test"
    assert [w["id"] for w in await office_api.wakeups()] == [reply.body["id"]]
    assert_problem(await office_api.post(f"/api/office/agents/{agent['id']}/wake", {"why": "x"}), 422,
                   "validation_failed", "why")
    [run_id] = office_api.dispatch()
    run = (await office_api.get(f"/api/office/runs/{run_id}")).body
    assert "look at the flaky test" in run["assembled_prompt"]
    assert run["task_id"] is None


async def test_a_user_wake_merged_into_a_routine_retry_runs_when_the_routine_is_idle_skipped(office_api):
    """Issue 24.2: a Wake now that merged into a routine wakeup's pending retry was thrown away
    when that wakeup was idle-skipped. Only the routine's own part may be skipped: the user's
    wake still runs."""
    agent = await office_api.agent("Worker")
    task = await office_api.task("Fix the flaky test", assignee_agent_id=agent["id"])
    [task_run] = office_api.dispatch()
    office_api.settle(task_run)
    routine = (await office_api.post("/api/office/routines", {"name": "Poll", "assignee_agent_id": agent["id"]})).body
    fired = (await office_api.post(f"/api/office/routines/{routine['id']}/fire", {"variables": {}})).body
    [routine_run] = office_api.dispatch()   # a TODO task: not idle, the routine runs
    office_api.settle(routine_run, outpost.RunStatus.FAILED, error="network timeout")
    retry = [w for w in await office_api.wakeups() if w["id"] == fired["wakeup_id"]][0]
    assert retry["status"] == "queued" and retry["scheduled_retry_at"]
    # The task is done (nothing actionable is left), then the user wakes the agent.
    assert (await office_api.post(f"/api/office/tasks/{task['id']}/move", {"state": "DONE"})).status == 200
    woken = (await office_api.post(f"/api/office/agents/{agent['id']}/wake", {"context": "check the nightly"})).body
    assert (woken["status"], woken["coalesced_into"]) == ("coalesced", retry["id"])
    office_api.clock.at = outpost.parse_instant(retry["scheduled_retry_at"]) + timedelta(seconds=1)
    [run_id] = dispatch(office_api.store, office_api.clock.now())   # the claim actor's passes
    run = (await office_api.get(f"/api/office/runs/{run_id}")).body
    assert "check the nightly" in run["assembled_prompt"] and run["task_id"] is None
    rows = {w["id"]: w for w in await office_api.wakeups()}
    assert (rows[woken["id"]]["status"], rows[woken["id"]]["run_id"]) == ("claimed", run_id)
    assert (rows[retry["id"]]["status"], rows[retry["id"]]["run_id"]) == ("finished", routine_run)   # no new run
    assert "idle skip" in rows[retry["id"]]["note"]
    [skipped] = (await office_api.get("/api/office/activity?code=wakeup_idle_skipped")).body["activity"]
    assert skipped["wakeup_id"] == retry["id"]


async def test_unblocking_an_in_progress_task_by_editing_its_blockers_wakes_its_agent(office_api):
    """Issue 24.3: PATCH {"blocked_by": []} on an In Progress task gave no wakeup, ever. Its held
    assignment runs as soon as the task has no open blocker, however that came about."""
    builder = await office_api.agent("Builder")
    spec = await office_api.task("Spec")
    build = await office_api.task("Build", state="IN_PROGRESS", blocked_by=[spec["id"]],
                                  assignee_agent_id=builder["id"])
    assert office_api.dispatch() == [], "held while Spec is open"
    [held] = await office_api.wakeups(f"?agent_id={builder['id']}")
    assert "held until its blockers are done" in held["note"] and spec["id"] in held["note"]
    assert office_api.dispatch() == []
    assert (await office_api.patch(f"/api/office/tasks/{build['id']}", {"blocked_by": []})).status == 200
    [run_id] = office_api.dispatch()
    run = (await office_api.get(f"/api/office/runs/{run_id}")).body
    assert (run["agent_id"], run["task_id"]) == (builder["id"], build["id"])
    sources = sorted(w["source"] for w in await office_api.wakeups(f"?agent_id={builder['id']}"))
    assert sources == ["task_assigned", "task_blockers_resolved"]
    assert [x["source"] for x in run["context_snapshot"]["wakeups"]] == ["task_assigned", "task_blockers_resolved"]


async def test_archiving_or_cancelling_the_last_open_blocker_wakes_the_blocked_tasks_agent(office_api):
    """Issue 24.3: a TODO task whose last open blocker was archived waited for the 5-minute
    sweep (which still counted the archived blocker). An archived blocker blocks nothing; like
    a cancelled one, it wakes the blocked task's agent at once."""
    writer = await office_api.agent("Writer")
    draft, review = await office_api.task("Draft"), await office_api.task("Review")
    docs = await office_api.task("Docs", blocked_by=[draft["id"], review["id"]], assignee_agent_id=writer["id"])
    assert office_api.dispatch() == []
    assert (await office_api.patch(f"/api/office/tasks/{draft['id']}", {"archived": True})).status == 200
    assert office_api.dispatch() == [], "Review is still open"
    assert (await office_api.post(f"/api/office/tasks/{review['id']}/move", {"state": "CANCELLED"})).status == 200
    [run_id] = office_api.dispatch()
    assert (await office_api.get(f"/api/office/runs/{run_id}")).body["task_id"] == docs["id"]


async def test_reassigning_a_task_mid_run_lets_the_new_agent_start_only_after_that_run_ends(office_api):
    """Issue 24.4: the checkout lock was released at the reassignment while the first agent's
    run went on, and the new assignee's run started beside it. Reassigning asks the running
    agent to stop (a cancel); the lock holds until its run has ended, then the new agent runs."""
    first, task, run_id, _ = await office_api.running()
    second = await office_api.agent("Second")
    reassigned = await office_api.patch(f"/api/office/tasks/{task['id']}", {"assignee_agent_id": second["id"]})
    assert reassigned.status == 200, reassigned.body
    assert office_api.dispatch() == [], "the first agent's run is still going"
    assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["checkout_agent_id"] == first["id"]
    assert (await office_api.get(f"/v1/outpost/runs/{run_id}")).body["status"] == "running"
    # Its process ends (the cancel reached it): the run settles cancelled, and only now B starts.
    office_api.settle(run_id, outpost.RunStatus.FAILED, error="terminated")
    assert (await office_api.get(f"/v1/outpost/runs/{run_id}")).body["status"] == "cancelled"
    [second_run] = office_api.dispatch()
    run = (await office_api.get(f"/api/office/runs/{second_run}")).body
    assert (run["agent_id"], run["task_id"]) == (second["id"], task["id"])
    assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["checkout_agent_id"] == second["id"]
    # A run that had not started yet is cancelled at once: nothing to wait for.
    third = await office_api.agent("Third")
    assert (await office_api.patch(f"/api/office/tasks/{task['id']}", {"assignee_agent_id": third["id"]})).status == 200
    assert (await office_api.get(f"/v1/outpost/runs/{second_run}")).body["status"] == "cancelled"
    [third_run] = office_api.dispatch()
    assert (await office_api.get(f"/api/office/runs/{third_run}")).body["agent_id"] == third["id"]


async def test_children_of_three_parents_completed_within_5_s_give_one_coordinator_wakeup(office_api):
    """Issue 24.5: the 5 s coalescing window merged per task, so three task_children_completed
    for one coordinator's three parents within 5 s gave three runs. The window is per agent and
    source: one wakeup, coalesced_count 3, each parent named in its payload and in the prompt."""
    lead = await office_api.agent("Lead", role="coordinator")
    parents = [await office_api.task(f"Epic {i}", assignee_agent_id=lead["id"]) for i in range(3)]
    children = [await office_api.task(f"Part of epic {i}", parent_id=p["id"]) for i, p in enumerate(parents)]
    for _ in parents:   # the coordinator's first look at each epic
        [run_id] = office_api.dispatch()
        office_api.settle(run_id)
    for i, child in enumerate(children):
        office_api.clock.at = T0 + timedelta(minutes=1, seconds=2 * i)   # 0, 2 and 4 s apart
        assert (await office_api.post(f"/api/office/tasks/{child['id']}/move", {"state": "DONE"})).status == 200
        # The claim actor looks at once (issue 34: it claimed the first, and the window never held).
        assert office_api.dispatch() == []
    office_api.clock.at = T0 + timedelta(minutes=1, seconds=4.999)
    assert office_api.dispatch() == [], "the first wakeup's window is still open"
    office_api.clock.at = T0 + timedelta(minutes=1, seconds=5)
    [run_id] = office_api.dispatch()
    assert office_api.dispatch() == []
    woken = sorted(await office_api.wakeups("?source=task_children_completed"), key=lambda w: w["requested_at"])
    assert [w["payload"] for w in woken] == [{"task_id": p["id"]} for p in parents]
    kept, *merged = woken
    assert (kept["status"], kept["coalesced_count"], kept["run_id"]) == ("claimed", 3, run_id)
    assert [(w["status"], w["coalesced_into"], w["run_id"]) for w in merged] == [("coalesced", kept["id"], run_id)] * 2
    prompt = (await office_api.get(f"/api/office/runs/{run_id}")).body["assembled_prompt"]
    for parent in parents:
        assert parent["id"] in prompt and parent["title"] in prompt


# --- run detail ---------------------------------------------------------------------------------------

async def test_run_detail_shows_what_the_agent_was_given_and_gave_back(office_api):
    agent = await office_api.agent("Reporter")
    task = await office_api.task("Write the report", description="@print report", assignee_agent_id=agent["id"])
    [run_id] = office_api.dispatch()
    detail = await office_api.get(f"/api/office/runs/{run_id}")
    assert detail.status == 200, detail.body
    run = detail.body
    assert (run["id"], run["trigger"], run["status"], run["agent"]) == (run_id, "wakeup", "queued", "demo")
    assert (run["agent_id"], run["task_id"]) == (agent["id"], task["id"])
    assert "Reporter" in run["assembled_prompt"] and "Write the report" in run["assembled_prompt"]
    assert "@print report" in run["assembled_prompt"]
    assert run["summary_injected"] == ""
    assert run["result_json"] == {}
    assert [w["source"] for w in run["context_snapshot"]["wakeups"]] == ["task_assigned"]
    office_api.admit_all()
    office_api.settle(run_id, result={"status": "succeeded", "summary": "wrote it", "session_id": "demo-1"},
                      exit_code=0)
    run = (await office_api.get(f"/api/office/runs/{run_id}")).body
    assert run["status"] == "succeeded"
    assert run["result_json"] == {"status": "succeeded", "summary": "wrote it", "session_id": "demo-1"}
    assert run["session_id"] == "demo-1"
    [wakeup] = await office_api.wakeups()
    assert (wakeup["status"], wakeup["run_id"]) == ("finished", run_id)
    assert RFC3339_Z.match(wakeup["finished_at"])
    # Schedules' run list and Office's agree on the run.
    assert (await office_api.get(f"/v1/outpost/runs/{run_id}")).body["status"] == "succeeded"
    runs = (await office_api.get(f"/api/office/agents/{agent['id']}/runs")).body["runs"]
    assert [(r["id"], r["task_id"]) for r in runs] == [(run_id, task["id"])]


async def test_a_taskless_run_gets_the_continuation_summary_of_the_last_one(office_api):
    agent = await office_api.agent("Watcher")
    await office_api.post(f"/api/office/agents/{agent['id']}/wake", {})
    [first] = office_api.dispatch()
    assert (await office_api.get(f"/api/office/runs/{first}")).body["summary_injected"] == ""
    office_api.admit_all()
    office_api.settle(first, result={"status": "succeeded", "summary": "checked the upstream PRs"}, exit_code=0)
    office_api.clock.at += timedelta(minutes=5)
    await office_api.post(f"/api/office/agents/{agent['id']}/wake", {})
    [second] = office_api.dispatch()
    run = (await office_api.get(f"/api/office/runs/{second}")).body
    assert "checked the upstream PRs" in run["summary_injected"]
    assert "## Continuation summary" in run["assembled_prompt"]
    assert "checked the upstream PRs" in run["assembled_prompt"]
    summaries = (await office_api.get(f"/api/office/agents/{agent['id']}")).body["continuation_summaries"]
    assert [s["updated_by_run_id"] for s in summaries] == [first]


async def test_run_detail_of_a_run_that_is_not_an_office_run_is_404(office_api):
    reply = await office_api.post("/v1/outpost/dispatches",
                                  {"brief": "@print x", "repository": str(office_api.repo), "agent": "demo"},
                                  key=uuid.uuid4().hex)
    assert reply.status == 202, reply.body
    assert_problem(await office_api.get(f"/api/office/runs/{reply.body['run_id']}"), 404, "not_found")


# --- approvals ----------------------------------------------------------------------------------------

async def test_approval_gate_resolve_and_the_requesting_agent_wakes(office_api):
    agent, task, run_id, token = await office_api.running(title="Spec", requires_approval=True)
    moved = await office_api.as_run(token, "POST", f"/api/agent/tasks/{task['id']}/move", {"state": "DONE"})
    assert moved.status == 200, moved.body
    assert moved.body["state"] == "IN_REVIEW"   # the gate: the user decides when it is done
    listed = await office_api.get("/api/office/approvals")
    assert listed.status == 200
    [approval] = listed.body["approvals"]
    assert approval["id"].startswith("apr_")
    assert (approval["task_id"], approval["requested_by_agent_id"], approval["status"]) == (
        task["id"], agent["id"], "pending")
    assert (await office_api.get("/api/office/approvals?status=approved")).body["approvals"] == []

    for body, field in [({"status": "maybe"}, "status"), ({}, "status"),
                        ({"status": "approved", "why": "x"}, "why"), ({"status": "approved", "decision_note": 1},
                                                                        "decision_note")]:
        assert_problem(await office_api.post(f"/api/office/approvals/{approval['id']}/resolve", body), 422,
                       "validation_failed", field)
    office_api.settle(run_id)
    resolved = await office_api.post(f"/api/office/approvals/{approval['id']}/resolve",
                                     {"status": "approved", "decision_note": "ship it"})
    assert resolved.status == 200, resolved.body
    assert (resolved.body["status"], resolved.body["decision_note"]) == ("approved", "ship it")
    assert RFC3339_Z.match(resolved.body["resolved_at"])
    assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["state"] == "DONE"
    [woken] = await office_api.wakeups("?source=approval_resolved")
    assert woken["agent_id"] == agent["id"]
    assert woken["payload"] == {"approval_id": approval["id"], "status": "approved", "decision_note": "ship it"}
    again = await office_api.post(f"/api/office/approvals/{approval['id']}/resolve", {"status": "rejected"})
    assert_problem(again, 409, "conflict")
    assert len(await office_api.wakeups("?source=approval_resolved")) == 1


async def test_a_rejected_approval_sends_the_task_back_to_in_progress(office_api):
    agent, task, run_id, token = await office_api.running(title="Spec")
    asked = await office_api.as_run(token, "POST", "/api/agent/approvals", {"note": "is this right?"})
    assert asked.status == 201, asked.body
    assert (asked.body["task_id"], asked.body["status"], asked.body["note"]) == (task["id"], "pending",
                                                                                 "is this right?")
    await office_api.post(f"/api/office/tasks/{task['id']}/move", {"state": "IN_REVIEW"})
    resolved = await office_api.post(f"/api/office/approvals/{asked.body['id']}/resolve",
                                     {"status": "rejected", "decision_note": "no"})
    assert resolved.status == 200 and resolved.body["status"] == "rejected"
    assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["state"] == "IN_PROGRESS"


# --- activity, settings, workspaces, projects -----------------------------------------------------------

async def test_activity_lists_a_stale_wakeup_by_code(office_api):
    first = await office_api.agent("first")
    second = await office_api.agent("second")
    task = await office_api.task(assignee_agent_id=first["id"])
    await office_api.patch(f"/api/office/tasks/{task['id']}", {"assignee_agent_id": second["id"]})
    office_api.dispatch()
    stale = [w for w in await office_api.wakeups(f"?agent_id={first['id']}")]
    assert [(w["status"], w["cancel_reason"]) for w in stale] == [("cancelled", "assignee_changed")]
    reply = await office_api.get("/api/office/activity?code=wakeup_stale_cancelled")
    assert reply.status == 200
    [entry] = reply.body["activity"]
    assert (entry["code"], entry["agent_id"], entry["task_id"], entry["wakeup_id"]) == (
        "wakeup_stale_cancelled", first["id"], task["id"], stale[0]["id"])
    assert entry["data"]["reason"] == "assignee_changed"
    assert (await office_api.get("/api/office/activity?code=recovery_dispatch")).body["activity"] == []
    assert len((await office_api.get("/api/office/activity")).body["activity"]) >= 1


async def test_settings_read_edit_and_lookback_clamped(office_api):
    got = await office_api.get("/api/office/settings")
    assert got.status == 200
    assert got.body["recovery_lookback_hours"] == 24
    assert got.body["repository"] == str(office_api.repo)
    for given, kept in [(0, 1), (-5, 1), (1, 1), (48, 48), (720, 720), (721, 720), (100000, 720), (2.5, 2)]:
        reply = await office_api.patch("/api/office/settings", {"recovery_lookback_hours": given})
        assert reply.status == 200, reply.body
        assert reply.body["recovery_lookback_hours"] == kept, given
        assert (await office_api.get("/api/office/settings")).body["recovery_lookback_hours"] == kept
    assert (await office_api.get("/api/office/settings")).body["repository"] == str(office_api.repo)   # untouched
    for body, field in [({"recovery_lookback_hours": "5"}, "recovery_lookback_hours"),
                        ({"recovery_lookback_hours": None}, "recovery_lookback_hours"),
                        ({"recovery_lookback_hours": True}, "recovery_lookback_hours"),
                        ({"repository": "relative/path"}, "repository"),
                        ({"timezone": "Mars/Olympus"}, "timezone"),
                        ({"default_executor": "nobody"}, "default_executor"),
                        ({"lookback": 5}, "lookback"), ([], "body")]:
        assert_problem(await office_api.patch("/api/office/settings", body), 422, "validation_failed", field)
    assert (await office_api.get("/api/office/settings")).body["recovery_lookback_hours"] == 2


async def test_a_huge_lookback_is_clamped_not_a_500(office_api):
    reply = await office_api.patch("/api/office/settings", {"recovery_lookback_hours": 10 ** 400})
    assert reply.status == 200, reply.body
    assert reply.body["recovery_lookback_hours"] == 720


async def test_workspaces_and_projects(office_api, tmp_path):
    listed = (await office_api.get("/api/office/workspaces")).body["workspaces"]
    assert [w["id"] for w in listed] == ["ws_default"]
    created = await office_api.post("/api/office/workspaces", {"name": "Research"})
    assert created.status == 201, created.body
    ws = created.body
    assert ws["id"].startswith("ws_") and ws["name"] == "Research" and ws["recovery_lookback_hours"] == 24
    assert [w["name"] for w in (await office_api.get("/api/office/workspaces")).body["workspaces"]] == [
        "Default", "Research"]
    assert_problem(await office_api.post("/api/office/workspaces", {"name": "Research"}), 409, "conflict")
    for body, field in [({}, "name"), ({"name": ""}, "name"), ({"name": 4}, "name"), (["x"], "body")]:
        assert_problem(await office_api.post("/api/office/workspaces", body), 422, "validation_failed", field)

    repo = make_repo(tmp_path / "research-repo")
    project = await office_api.post("/api/office/projects", {"workspace_id": ws["id"], "name": "Paper",
                                                             "repository": str(repo), "executor": "demo"})
    assert project.status == 201, project.body
    assert project.body["id"].startswith("prj_")
    assert (project.body["workspace_id"], project.body["repository"]) == (ws["id"], str(repo))
    assert [p["id"] for p in (await office_api.get(f"/api/office/projects?workspace_id={ws['id']}")).body[
        "projects"]] == [project.body["id"]]
    assert (await office_api.get("/api/office/projects")).body["projects"] == []
    assert_problem(await office_api.post("/api/office/projects", {"name": "p", "repository": "rel"}), 422,
                   "validation_failed", "repository")
    assert_problem(await office_api.post("/api/office/projects", {"name": "p", "owner": "me"}), 422,
                   "validation_failed", "owner")
    # A task of the project runs in the project's repository, with the project's executor.
    agent = await office_api.agent("scholar", workspace_id=ws["id"], executor=None)
    in_default_ws = await office_api.post("/api/office/tasks", {"title": "t", "project_id": project.body["id"]})
    assert_problem(in_default_ws, 422, "validation_failed", "project_id")
    await office_api.task("Draft", workspace_id=ws["id"], project_id=project.body["id"], assignee_agent_id=agent["id"])
    [run_id] = office_api.dispatch()
    run = (await office_api.get(f"/v1/outpost/runs/{run_id}")).body
    assert (run["repository"], run["agent"]) == (str(repo), "demo")


# --- idempotency on the Office API -----------------------------------------------------------------------

async def test_idempotency_key_replays_a_comment_and_nothing_happens_twice(office_api):
    agent = await office_api.agent()
    task = await office_api.task(assignee_agent_id=agent["id"])
    path = f"/api/office/tasks/{task['id']}/comments"
    first = await office_api.post(path, {"body": "once"}, key="comment-1")
    assert first.status == 201, first.body
    assert "Idempotent-Replayed" not in first.headers
    again = await office_api.post(path, {"body": "once"}, key="comment-1")
    assert again.status == 201
    assert again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len((await office_api.get(f"/api/office/tasks/{task['id']}")).body["comments"]) == 1
    assert len(await office_api.wakeups("?source=comment")) == 1
    reused = await office_api.post(path, {"body": "twice"}, key="comment-1")
    assert_problem(reused, 422, "idempotency_key_reused")
    # Without a key, every request counts.
    await office_api.post(path, {"body": "no key"})
    await office_api.post(path, {"body": "no key"})
    assert len((await office_api.get(f"/api/office/tasks/{task['id']}")).body["comments"]) == 3


async def test_idempotency_key_replays_a_wake_and_a_create(office_api):
    agent = await office_api.agent()
    wakes = [await office_api.post(f"/api/office/agents/{agent['id']}/wake", {}, key="wake-1") for _ in range(3)]
    assert [w.status for w in wakes] == [202, 202, 202]
    assert wakes[1].body == wakes[0].body and wakes[2].headers["Idempotent-Replayed"] == "true"
    assert len(await office_api.wakeups(f"?agent_id={agent['id']}")) == 1
    created = [await office_api.post("/api/office/agents", {"name": "twin"}, key="agent-1") for _ in range(2)]
    assert [c.status for c in created] == [201, 201]
    assert created[1].body["id"] == created[0].body["id"]
    assert [a["name"] for a in (await office_api.get("/api/office/agents")).body["agents"]].count("twin") == 1
    # A refused request is replayed as refused, with its problem type.
    bad = [await office_api.post("/api/office/agents", {"name": "x", "role": "boss"}, key="agent-2") for _ in range(2)]
    assert bad[1].status == 422 and bad[1].mimetype == PROBLEM and bad[1].headers["Idempotent-Replayed"] == "true"


async def test_a_create_honours_the_workspace_id_query(office_api):
    other = await office_api.workspace("Other")
    for path, body in [("/api/office/agents", {"name": "placed"}), ("/api/office/tasks", {"title": "placed"})]:
        reply = await office_api.post(f"{path}?workspace_id={other['id']}", body)
        assert reply.status == 201, reply.body
        assert reply.body["workspace_id"] == other["id"]


async def test_idempotency_key_is_bound_to_the_workspace_query(office_api):
    other = await office_api.workspace("Other")
    first = await office_api.patch("/api/office/settings", {"recovery_lookback_hours": 5}, key="settings-1")
    assert first.status == 200 and first.body["id"] == "ws_default"
    second = await office_api.patch(f"/api/office/settings?workspace_id={other['id']}",
                                    {"recovery_lookback_hours": 5}, key="settings-1")
    assert_problem(second, 422, "idempotency_key_reused")   # a key names one request, path and query included
    untouched = await office_api.get(f"/api/office/settings?workspace_id={other['id']}")
    assert untouched.body["recovery_lookback_hours"] == 24


###############################################################################
# 2. The run-scoped token of the agent API.
###############################################################################

async def test_run_token_works_only_while_its_run_is_running(office_api):
    agent, task, run_id, token = await office_api.running()
    me = await office_api.as_run(token, "GET", "/api/agent/me")
    assert me.status == 200, me.body
    assert (me.body["run_id"], me.body["agent_id"], me.body["task_id"]) == (run_id, agent["id"], task["id"])
    assert me.body["task"]["id"] == task["id"]
    commented = await office_api.as_run(token, "POST", "/api/agent/comments", {"body": "on it"})
    assert commented.status == 201, commented.body
    assert (commented.body["author_agent_id"], commented.body["task_id"]) == (agent["id"], task["id"])
    assert await office_api.wakeups("?source=comment") == []   # the assignee's own comment wakes nobody

    office_api.settle(run_id)
    for method, path, body in [("GET", "/api/agent/me", None), ("POST", "/api/agent/comments", {"body": "late"}),
                               ("POST", f"/api/agent/tasks/{task['id']}/move", {"state": "DONE"}),
                               ("POST", "/api/agent/wake", {"reason": "again"})]:
        assert_problem(await office_api.as_run(token, method, path, body), 401, "unauthorized")
    got = (await office_api.get(f"/api/office/tasks/{task['id']}")).body
    assert [c["body"] for c in got["comments"]] == ["on it"] and got["state"] == "TODO"


async def test_a_queued_or_paused_run_has_no_voice(office_api):
    agent = await office_api.agent()
    await office_api.task(assignee_agent_id=agent["id"])
    [run_id] = office_api.dispatch()
    assert_problem(await office_api.as_run(office_api.token(run_id), "GET", "/api/agent/me"), 401, "unauthorized")
    office_api.admit_all()
    assert (await office_api.as_run(office_api.token(run_id), "GET", "/api/agent/me")).status == 200
    office_api.store.transaction(office_api.store.runs.control_run, run_id, "pause", office_api.clock.now())
    assert (await office_api.get(f"/v1/outpost/runs/{run_id}")).body["status"] == "paused"
    assert_problem(await office_api.as_run(office_api.token(run_id), "GET", "/api/agent/me"), 401, "unauthorized")


async def test_made_up_tampered_and_foreign_tokens_are_401(office_api):
    _, _, run_id, token = await office_api.running()
    other_key = outpost.Deps(config=office_api.deps.config, store=office_api.store, clock=office_api.clock,
                             token="another daemon's token").run_token_key
    run_part, signature = token.split(".")
    flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    for given in [f"{run_part}.{flipped}", f"{run_part}.", run_part, f"{run_part}.{signature}x",
                  f"out_01AAAAAAAAAAAAAAAAAAAAAAAA.{signature}", outpost.run_token(other_key, run_id),
                  "", ".", "Bearer", token.upper()]:
        reply = await office_api.as_run(given, "GET", "/api/agent/me")
        assert_problem(reply, 401, "unauthorized")
    for headers in [{}, {"Authorization": f"Basic {token}"}, {"Authorization": token}]:
        reply = await office_api.request("GET", "/api/agent/me", auth=False, headers=headers)
        assert_problem(reply, 401, "unauthorized")
    assert (await office_api.as_run(token, "GET", "/api/agent/me")).status == 200


async def test_the_api_token_is_not_an_agent_token(office_api):
    _, task, _, _ = await office_api.running()
    for method, path, body in [("GET", "/api/agent/me", None), ("POST", "/api/agent/comments",
                                                                  {"task_id": task["id"], "body": "x"}),
                               ("POST", f"/api/agent/tasks/{task['id']}/move", {"state": "DONE"}),
                               ("POST", "/api/agent/wake", {"reason": "x"})]:
        reply = await office_api.request(method, path, body)   # with the API token
        assert_problem(reply, 401, "unauthorized")
    assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["comments"] == []


async def test_a_running_dispatch_token_may_only_ask_for_a_human(office_api):
    """docs/agent-clis.md: every run gets a run token; a dispatch's (or a schedule's) may only call
    POST /api/agent/needs-you, never the Office agent API."""
    reply = await office_api.post("/v1/outpost/dispatches",
                                  {"brief": "@print x", "repository": str(office_api.repo), "agent": "demo"},
                                  key=uuid.uuid4().hex)
    run_id = reply.body["run_id"]
    office_api.admit_all()
    assert (await office_api.get(f"/v1/outpost/runs/{run_id}")).body["status"] == "running"
    token = office_api.token(run_id)
    assert_problem(await office_api.as_run(token, "GET", "/api/agent/me"), 403, "forbidden")
    assert_problem(await office_api.as_run(token, "POST", "/api/agent/comments", {"task_id": "tsk_x", "body": "x"}),
                   403, "forbidden")
    asked = await office_api.as_run(token, "POST", "/api/agent/needs-you", {"question": "Which branch?"})
    assert asked.status == 200 and asked.body["question"] == "Which branch?"
    office_api.settle(run_id, outpost.RunStatus.SUCCEEDED)
    run = (await office_api.get(f"/v1/outpost/runs/{run_id}")).body
    assert (run["status"], run["question"]) == ("needs_you", "Which branch?")
    assert_problem(await office_api.as_run(token, "POST", "/api/agent/needs-you", {"question": "again?"}),
                   401, "unauthorized")   # a settled run's token speaks for nobody


async def test_a_run_token_cannot_reach_the_operator_api(office_api):
    agent, task, _, token = await office_api.running()
    sid = "sch_nope"
    for method, path, body in [
            ("GET", "/v1/outpost/schedules", None),
            ("POST", "/v1/outpost/schedules/compose", {"name": "x"}),
            ("POST", "/v1/outpost/schedules", {"definition": {}, "confirmation": "sha256:0"}),
            ("POST", f"/v1/outpost/schedules/{sid}/control", {"action": "fire"}),
            ("POST", "/v1/outpost/dispatches", {"brief": "@print x", "repository": str(office_api.repo),
                                                "agent": "demo"}),
            ("GET", "/v1/outpost/runs", None),
            ("GET", "/api/office/tasks", None),
            ("POST", "/api/office/tasks", {"title": "sneaky", "assignee_agent_id": agent["id"]}),
            ("PATCH", f"/api/office/tasks/{task['id']}", {"title": "renamed"}),
            ("POST", f"/api/office/agents/{agent['id']}/wake", {}),
            ("PATCH", f"/api/office/agents/{agent['id']}", {"max_concurrent_sessions": 16}),
            ("PATCH", "/api/office/settings", {"repository": "/"}),
            ("GET", "/api/office/routines", None),
            ("POST", "/api/office/routines", {"name": "r"}),
            ("POST", "/api/office/routines/rtn_any/fire", {"variables": {}})]:
        reply = await office_api.as_run(token, method, path, body)
        assert_problem(reply, 401, "unauthorized")
    assert (await office_api.get("/v1/outpost/runs")).body["runs"][0]["trigger"] == "wakeup"
    assert len((await office_api.get("/v1/outpost/runs")).body["runs"]) == 1   # no dispatch got through
    assert [t["title"] for t in (await office_api.get("/api/office/tasks")).body["tasks"]] == ["a task"]
    assert (await office_api.get(f"/api/office/agents/{agent['id']}")).body["max_concurrent_sessions"] == 1


async def test_a_run_token_cannot_touch_another_workspace(office_api, tmp_path):
    _, _, _, token = await office_api.running()
    other = await office_api.workspace("Other", make_repo(tmp_path / "other-repo"))
    stranger = await office_api.agent("stranger", workspace_id=other["id"])
    theirs = await office_api.task("theirs", workspace_id=other["id"], assignee_agent_id=stranger["id"])
    for method, path, body in [("POST", "/api/agent/comments", {"task_id": theirs["id"], "body": "hi"}),
                               ("POST", f"/api/agent/tasks/{theirs['id']}/move", {"state": "CANCELLED"}),
                               ("POST", "/api/agent/approvals", {"task_id": theirs["id"]})]:
        assert_problem(await office_api.as_run(token, method, path, body), 404, "not_found")
    sub = await office_api.as_run(token, "POST", "/api/agent/tasks",
                                  {"title": "sub", "assignee_agent_id": stranger["id"]})
    assert_problem(sub, 422, "validation_failed", "assignee_agent_id")
    sub = await office_api.as_run(token, "POST", "/api/agent/tasks", {"title": "sub", "workspace_id": other["id"]})
    assert_problem(sub, 422, "validation_failed", "workspace_id")
    got = (await office_api.get(f"/api/office/tasks/{theirs['id']}")).body
    assert got["comments"] == [] and got["state"] == "TODO" and got["approvals"] == []
    assert len((await office_api.get(f"/api/office/tasks?workspace_id={other['id']}")).body["tasks"]) == 1


async def test_a_run_token_cannot_move_another_agents_task(office_api):
    agent, own, _, token = await office_api.running()
    colleague = await office_api.agent("colleague")
    theirs = await office_api.task("theirs", assignee_agent_id=colleague["id"])
    unassigned = await office_api.task("nobody's")
    for task in (theirs, unassigned):
        reply = await office_api.as_run(token, "POST", f"/api/agent/tasks/{task['id']}/move", {"state": "DONE"})
        assert_problem(reply, 403, "forbidden")
        assert (await office_api.get(f"/api/office/tasks/{task['id']}")).body["state"] == "TODO"
    asked = await office_api.as_run(token, "POST", "/api/agent/approvals", {"task_id": theirs["id"]})
    assert_problem(asked, 403, "forbidden")
    moved = await office_api.as_run(token, "POST", f"/api/agent/tasks/{own['id']}/move", {"state": "IN_PROGRESS"})
    assert moved.status == 200 and moved.body["state"] == "IN_PROGRESS"
    # A subtask it creates is a child of its own task, in its workspace.
    sub = await office_api.as_run(token, "POST", "/api/agent/tasks", {"title": "split off",
                                                                      "assignee_agent_id": colleague["id"]})
    assert sub.status == 201, sub.body
    assert (sub.body["parent_id"], sub.body["assignee_agent_id"]) == (own["id"], colleague["id"])


async def test_agent_self_wake(office_api):
    agent, _, run_id, token = await office_api.running()
    now = office_api.clock.now()
    reply = await office_api.as_run(token, "POST", "/api/agent/wake", {"reason": "check CI", "delay_sec": 600})
    assert reply.status == 202, reply.body
    later = reply.body
    assert (later["agent_id"], later["source"], later["status"]) == (agent["id"], "self", "queued")
    assert later["payload"] == {"reason": "check CI", "payload": None}
    assert later["wake_at"] == outpost.rfc3339(now + timedelta(seconds=600))
    soon = await office_api.as_run(token, "POST", "/api/agent/wake", {"reason": "next step", "payload": {"step": 2}})
    assert soon.status == 202 and soon.body["wake_at"] is None
    assert soon.body["payload"] == {"reason": "next step", "payload": {"step": 2}}
    for body, field in [({}, "reason"), ({"reason": "x", "delay_sec": -1}, "delay_sec"),
                        ({"reason": "x", "delay_sec": "10"}, "delay_sec"), ({"reason": "x", "payload": [1]}, "payload"),
                        ({"reason": "x", "agent_id": "agt_other"}, "agent_id")]:
        assert_problem(await office_api.as_run(token, "POST", "/api/agent/wake", body), 422, "validation_failed", field)
    office_api.settle(run_id)
    office_api.clock.at = T0 + timedelta(seconds=1)
    [next_run] = office_api.dispatch()   # the delayed wake waits for its time
    assert (await office_api.get(f"/api/office/runs/{next_run}")).body["wakeup_id"] == soon.body["id"]
    office_api.admit_all()
    office_api.settle(next_run)
    office_api.clock.at = T0 + timedelta(seconds=601)
    [delayed_run] = office_api.dispatch()
    assert (await office_api.get(f"/api/office/runs/{delayed_run}")).body["wakeup_id"] == later["id"]


async def test_an_agent_that_wakes_itself_without_end_is_stopped_at_the_daily_limit(office_api, monkeypatch):
    """docs/office.md, self-wakes: at most SELF_WAKES_PER_DAY in 24 h; the next is refused (429,
    saying why) and nothing is queued; a day later it may again, and a person may wake it any time."""
    monkeypatch.setattr(outpost, "SELF_WAKES_PER_DAY", 3)
    agent, _, run_id, token = await office_api.running()
    wakes = [await office_api.as_run(token, "POST", "/api/agent/wake", {"reason": f"again {i}", "delay_sec": 600 * i})
             for i in (1, 2, 3)]
    assert [w.status for w in wakes] == [202] * 3 and len({w.body["id"] for w in wakes}) == 3
    queued = (await office_api.get(f"/api/office/wakeups?agent_id={agent['id']}")).body
    refused = await office_api.as_run(token, "POST", "/api/agent/wake", {"reason": "and again", "delay_sec": 4000})
    assert_problem(refused, 429, "self_wake_limit")
    assert "3 times in the last 24 hours" in refused.body["detail"]
    assert (await office_api.get(f"/api/office/wakeups?agent_id={agent['id']}")).body == queued
    by_a_person = await office_api.post(f"/api/office/agents/{agent['id']}/wake", {"context": "look now"})
    assert by_a_person.status in (200, 201, 202), by_a_person.body
    office_api.clock.at = office_api.clock.now() + timedelta(days=1, seconds=1)
    again = await office_api.as_run(token, "POST", "/api/agent/wake", {"reason": "next day", "delay_sec": 600})
    assert again.status == 202, again.body


###############################################################################
# 3. Workspaces: everything is per workspace, nothing crosses.
###############################################################################

async def test_agents_and_tasks_are_listed_per_workspace(office_api):
    other = await office_api.workspace("Second")
    here = await office_api.agent("same-name")
    there = await office_api.agent("same-name", workspace_id=other["id"])   # names are unique per workspace
    assert there["id"] != here["id"]
    assert_problem(await office_api.post("/api/office/agents", {"name": "same-name"}), 409, "conflict")
    t_here = await office_api.task("here", assignee_agent_id=here["id"])
    t_there = await office_api.task("there", workspace_id=other["id"], assignee_agent_id=there["id"])
    assert [a["id"] for a in (await office_api.get("/api/office/agents")).body["agents"]] == [here["id"]]
    assert [a["id"] for a in (await office_api.get(f"/api/office/agents?workspace_id={other['id']}")).body[
        "agents"]] == [there["id"]]
    assert [t["id"] for t in (await office_api.get("/api/office/tasks")).body["tasks"]] == [t_here["id"]]
    assert [t["id"] for t in (await office_api.get(f"/api/office/tasks?workspace_id={other['id']}")).body[
        "tasks"]] == [t_there["id"]]
    assert [w["agent_id"] for w in await office_api.wakeups()] == [here["id"]]
    assert [w["agent_id"] for w in await office_api.wakeups(f"?workspace_id={other['id']}")] == [there["id"]]
    assert (await office_api.get(f"/api/office/settings?workspace_id={other['id']}")).body["name"] == "Second"


async def test_nothing_is_dispatched_across_workspaces(office_api, tmp_path):
    other_repo = make_repo(tmp_path / "other-repo")
    other = await office_api.workspace("Second", other_repo)
    bare = await office_api.workspace("Bare")   # no repository of its own
    here = await office_api.agent("here")
    there = await office_api.agent("there", workspace_id=other["id"])
    lost = await office_api.agent("lost", workspace_id=bare["id"])
    await office_api.task("A", assignee_agent_id=here["id"])
    await office_api.task("B", workspace_id=other["id"], assignee_agent_id=there["id"])
    await office_api.task("C", workspace_id=bare["id"], assignee_agent_id=lost["id"])
    # A cross-workspace assignment or blocker is refused outright.
    cross = await office_api.post("/api/office/tasks", {"title": "x", "workspace_id": other["id"],
                                                        "assignee_agent_id": here["id"]})
    assert_problem(cross, 422, "validation_failed", "assignee_agent_id")
    cross = await office_api.post("/api/office/tasks", {"title": "x", "blocked_by": [(await office_api.task(
        "y", workspace_id=other["id"]))["id"]]})
    assert_problem(cross, 422, "validation_failed", "blocked_by")
    queued = office_api.dispatch()
    assert len(queued) == 2
    repos = {}
    for run_id in queued:
        run = (await office_api.get(f"/api/office/runs/{run_id}")).body
        repos[run["agent_id"]] = (run["workspace_id"], run["repository"])
    assert repos == {here["id"]: ("ws_default", str(office_api.repo)), there["id"]: (other["id"], str(other_repo))}
    # The bare workspace does not borrow the default workspace's repository: its wakeup waits for
    # one (not counted as a retry: defect 15).
    [w] = await office_api.wakeups(f"?workspace_id={bare['id']}")
    assert (w["status"], w["run_id"], w["retry_count"]) == ("queued", None, 0)
    assert w["scheduled_retry_at"] and "repository" in w["last_error"]


###############################################################################
# 4-5. End to end: a real ``outpost serve`` with the demo agent.
###############################################################################

@contextlib.contextmanager
def office_client(server) -> Iterator[httpx.Client]:
    """A client of the server, whose default workspace works in the test's repository."""
    with server.client() as client:
        reply = client.patch("/api/office/settings", json={"repository": str(server.repo)})
        assert reply.status_code == 200, reply.text
        yield client


def create(client: httpx.Client, path: str, body: dict) -> dict:
    reply = client.post(path, json=body)
    assert reply.status_code == 201, reply.text
    return reply.json()


def wakeups_of(client: httpx.Client, agent_id: str, **params) -> list[dict]:
    reply = client.get("/api/office/wakeups", params={"agent_id": agent_id, **params})
    assert reply.status_code == 200, reply.text
    return reply.json()["wakeups"]


def wait_wakeup(client: httpx.Client, agent_id: str, source: str, timeout_s: float = 20) -> dict:
    """The agent's (newest) wakeup of that source, once it ended (finished, failed, ...)."""
    def ended():
        found = [w for w in wakeups_of(client, agent_id) if w["source"] == source]
        return found and found[0]["status"] not in ("queued", "claimed") and found[0]
    return wait_for(ended, timeout_s)


def wait_run(client: httpx.Client, run_id: str, timeout_s: float = 20) -> dict:
    return wait_for(lambda: (r := client.get(f"/api/office/runs/{run_id}").json())["status"] in SETTLED and r,
                    timeout_s)


@pytest.fixture
def office_server(server_factory, git_repo):
    def start(*args: str, **kw):
        server = server_factory(*args, **kw)
        server.repo = git_repo
        return server
    return start


def test_a_task_wakes_the_agent_and_a_comment_resumes_its_session(office_server):
    server = office_server()
    with office_client(server) as client:
        agent = create(client, "/api/office/agents", {"name": "Builder", "executor": "demo", "cooldown_sec": 0})
        task = create(client, "/api/office/tasks", {
            "title": "Say hello", "description": "Print a greeting.\n@print hello\n@print from the task",
            "assignee_agent_id": agent["id"]})
        first = wait_wakeup(client, agent["id"], "task_assigned")
        assert first["status"] == "finished", first
        run = wait_run(client, first["run_id"])
        assert run["status"] == "succeeded", run
        assert run["trigger"] == "wakeup" and run["task_id"] == task["id"]
        log = client.get(f"/v1/outpost/runs/{run['id']}/log")
        assert log.status_code == 200
        assert "hello\n" in log.text and "from the task" in log.text
        assert "Say hello" in run["assembled_prompt"] and "@print hello" in run["assembled_prompt"]
        session_id = run["result_json"]["session_id"]
        assert run["result"]["session_id"] == session_id and run["resumed"] is False
        assert client.get(f"/api/office/agents/{agent['id']}").json()["status"] == "idle"

        said = client.post(f"/api/office/tasks/{task['id']}/comments", json={"body": "@comment got it"})
        assert said.status_code == 201, said.text
        second = wait_wakeup(client, agent["id"], "comment")
        assert second["status"] == "finished", second
        assert second["payload"] == {"task_id": task["id"], "comment_id": said.json()["id"]}
        rerun = wait_run(client, second["run_id"])
        assert rerun["status"] == "succeeded", client.get(f"/v1/outpost/runs/{rerun['id']}/log").text
        assert rerun["resumed"] is True
        assert rerun["session_id"] == session_id and rerun["result_json"]["session_id"] == session_id
        assert "@comment got it" in rerun["assembled_prompt"]
        assert "@print hello" not in rerun["assembled_prompt"]   # a resumed session gets only the delta
        comments = client.get(f"/api/office/tasks/{task['id']}").json()["comments"]
        assert [(c["author_agent_id"], c["body"]) for c in comments] == [(None, "@comment got it"),
                                                                          (agent["id"], "got it")]
        # The agent's own comment woke nobody: two wakeups, two runs.
        assert len(wakeups_of(client, agent["id"])) == 2
        runs = client.get(f"/api/office/agents/{agent['id']}/runs").json()["runs"]
        assert {r["id"] for r in runs} == {run["id"], rerun["id"]}
    assert server.stop() == 0


def test_a_fresh_install_runs_an_assigned_task_in_the_embedded_repository(server_factory):
    """Defect 15 (docs/office.md): in a fresh install an assigned agent silently retried with
    backoff because the default workspace had no repository. Office works with no setup."""
    server = server_factory()
    embedded = server.data_dir / "workspaces" / "ws_default"
    with server.client() as client:
        settings = client.get("/api/office/settings").json()
        assert settings["repository"] is None and settings["repository_in_use"] == str(embedded)
        agent = create(client, "/api/office/agents", {"name": "Builder", "executor": "demo", "cooldown_sec": 0})
        create(client, "/api/office/tasks", {"title": "Note", "description": "@commit notes.txt hi",
                                             "assignee_agent_id": agent["id"]})
        woke = wait_wakeup(client, agent["id"], "task_assigned")
        assert (woke["status"], woke["retry_count"]) == ("finished", 0), woke
        run = wait_run(client, woke["run_id"])
        assert run["status"] == "succeeded" and run["changes"]["commits"] == 1, run
    assert git(embedded, "rev-list", "--count", "HEAD") == "1"   # one empty commit; the run's is on its branch
    assert git(embedded, "show", f"{run['result_branch']}:notes.txt") == "hi"
    assert server.stop() == 0


def test_finishing_a_blocker_wakes_the_blocked_tasks_assignee(office_server):
    server = office_server()
    with office_client(server) as client:
        first = create(client, "/api/office/agents", {"name": "First", "executor": "demo", "cooldown_sec": 0})
        second = create(client, "/api/office/agents", {"name": "Second", "executor": "demo", "cooldown_sec": 0})
        blocker = create(client, "/api/office/tasks", {"title": "B", "assignee_agent_id": first["id"]})
        blocked = create(client, "/api/office/tasks", {"title": "A", "description": "@print unblocked",
                                                       "assignee_agent_id": second["id"],
                                                       "blocked_by": [blocker["id"]]})
        done = wait_wakeup(client, first["id"], "task_assigned")
        assert wait_run(client, done["run_id"])["status"] == "succeeded"
        (held,) = wakeups_of(client, second["id"])   # queued until its blocker is done
        assert (held["status"], held["run_id"]) == ("queued", None) and "held until its blockers" in held["note"]

        moved = client.post(f"/api/office/tasks/{blocker['id']}/move", json={"state": "DONE"})
        assert moved.status_code == 200 and moved.json()["state"] == "DONE"
        woken = wait_wakeup(client, second["id"], "task_assigned")
        assert woken["status"] == "finished", woken
        (resolved,) = [w for w in wakeups_of(client, second["id"]) if w["source"] == "task_blockers_resolved"]
        assert (resolved["status"], resolved["coalesced_into"]) == ("coalesced", woken["id"])
        assert resolved["payload"] == {"task_id": blocked["id"], "resolved_blocker_ids": [blocker["id"]]}
        run = wait_run(client, woken["run_id"])
        assert run["status"] == "succeeded" and run["task_id"] == blocked["id"]
        assert "unblocked" in client.get(f"/v1/outpost/runs/{run['id']}/log").text
        assert [w["source"] for w in wakeups_of(client, first["id"])] == ["task_assigned"]
    assert server.stop() == 0


def test_queued_wakeups_survive_a_restart_and_each_runs_once(office_server):
    server = office_server("--max-running", "1")
    with office_client(server) as client:
        # A one-shot run holds the only slot, so every Office run is still queued at shutdown.
        hold = client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": "hold"},
                           json={"brief": "@sleep 60", "repository": str(server.repo), "agent": "demo"})
        assert hold.status_code == 202, hold.text
        wait_for(lambda: client.get(f"/v1/outpost/runs/{hold.json()['run_id']}").json()["status"] == "running")
        agents = [create(client, "/api/office/agents", {"name": f"agent-{i}", "executor": "demo", "cooldown_sec": 0})
                  for i in range(3)]
        markers = {}
        for i, agent in enumerate(agents):
            for j in range(2 if i == 0 else 1):
                task = create(client, "/api/office/tasks", {"title": f"t{i}{j}", "description": f"@print mark-{i}-{j}",
                                                            "assignee_agent_id": agent["id"]})
                markers[task["id"]] = f"mark-{i}-{j}"
        # One claimed wakeup per agent (its run queued); the first agent's second waits for its one session.
        wait_for(lambda: sorted(w["status"] for w in client.get("/api/office/wakeups").json()["wakeups"])
                 == ["claimed"] * 3 + ["queued"])
    assert server.stop() == 0

    server = office_server("--max-running", "1", data_dir=server.data_dir)
    with server.client() as client:
        def all_finished():
            wakeups = client.get("/api/office/wakeups").json()["wakeups"]
            return all(w["status"] == "finished" for w in wakeups) and wakeups
        wakeups = wait_for(all_finished, 40)
        assert len(wakeups) == len(markers) == 4
        office_runs = [r for r in client.get("/v1/outpost/runs", params={"limit": 500}).json()["runs"]
                       if r["trigger"] == "wakeup"]
        assert len(office_runs) == 4   # none lost, none run twice
        assert sorted(w["run_id"] for w in wakeups) == sorted(r["id"] for r in office_runs)
        assert {r["status"] for r in office_runs} == {"succeeded"}
        for w in wakeups:
            assert w["retry_count"] == 0
            log = client.get(f"/v1/outpost/runs/{w['run_id']}/log").text
            assert log.count(markers[w["payload"]["task_id"]]) == 1, log
        for agent, count in zip(agents, (2, 1, 1), strict=True):
            assert len(client.get(f"/api/office/agents/{agent['id']}/runs").json()["runs"]) == count
    assert server.stop() == 0


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """An Office run that was running when the daemon was stopped (SIGTERM), seen after the
    restart: {"run": ..., "wakeup": ...}. One scenario, shared by the tests below."""
    base = tmp_path_factory.mktemp("interrupted")
    data_dir, repo = base / "data", make_repo(base / "repo")
    servers = [Server(data_dir, ("--max-running", "1")).start()]
    try:
        with servers[0].client() as client:
            assert client.patch("/api/office/settings", json={"repository": str(repo)}).status_code == 200
            agent = create(client, "/api/office/agents", {"name": "Sleeper", "executor": "demo", "cooldown_sec": 0})
            create(client, "/api/office/tasks", {"title": "long", "description": "@sleep 60\n@print awake",
                                                 "assignee_agent_id": agent["id"]})
            [w] = wait_for(lambda: [w for w in wakeups_of(client, agent["id"]) if w["run_id"]])
            wait_for(lambda: client.get(f"/v1/outpost/runs/{w['run_id']}").json()["status"] == "running")
        assert servers[0].stop() == 0
        servers.append(Server(data_dir, ("--max-running", "1")).start())
        with servers[1].client() as client:
            def taken_up() -> dict | None:   # the same wakeup, claimed again with a new run that started
                again = next(x for x in wakeups_of(client, agent["id"]) if x["id"] == w["id"])
                new_run = again["run_id"] not in (None, w["run_id"]) and client.get(
                    f"/v1/outpost/runs/{again['run_id']}").json()
                return again if new_run and new_run["status"] == "running" else None
            again = wait_for(taken_up)
            seen = {"run": client.get(f"/v1/outpost/runs/{w['run_id']}").json(), "wakeup": again,
                    "new_run": client.get(f"/v1/outpost/runs/{again['run_id']}").json()}
        assert servers[1].stop() == 0
        return seen
    finally:
        for server in servers:
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()


def test_an_office_run_interrupted_by_shutdown_keeps_its_wakeup(interrupted):
    assert (interrupted["run"]["status"], interrupted["run"]["error"]) == ("failed", "interrupted")
    # Not lost: not failed, not cancelled, not finished; it is being done again.
    assert interrupted["wakeup"]["status"] == "claimed", interrupted["wakeup"]


def test_an_office_run_interrupted_by_shutdown_is_taken_up_again_at_restart(interrupted):
    """Not the agent's failure: no backoff and no retry counted (issue 24.6b), claimed again at
    once with a new run."""
    w = interrupted["wakeup"]
    assert w["retry_count"] == 0 and w["scheduled_retry_at"] is None, w
    assert w["run_id"] != interrupted["run"]["id"]
    new_run = interrupted["new_run"]
    assert (new_run["status"], new_run["trigger"], new_run["error"]) == ("running", "wakeup", None), new_run


def test_no_office_route_answers_500_to_junk(office_server):
    """A handful of junk bodies on a real server: refused with a problem, never a 500."""
    server = office_server()
    with office_client(server) as client:
        agent = create(client, "/api/office/agents", {"name": "a"})
        task = create(client, "/api/office/tasks", {"title": "t"})
        for method, path in [("POST", "/api/office/agents"), ("PATCH", f"/api/office/agents/{agent['id']}"),
                             ("POST", "/api/office/tasks"), ("PATCH", f"/api/office/tasks/{task['id']}"),
                             ("POST", f"/api/office/tasks/{task['id']}/comments"),
                             ("PATCH", "/api/office/settings"), ("POST", "/api/office/workspaces"),
                             ("POST", f"/api/office/agents/{agent['id']}/wake")]:
            for junk in (b"null", b"[]", b'"x"', b"{", b"\xff\xfe", b'{"name": {"$ne": 1}}', b"1e999"):
                reply = client.request(method, path, content=junk, headers={"Content-Type": "application/json"})
                assert 400 <= reply.status_code < 500, (method, path, junk, reply.text)
                assert reply.headers["Content-Type"].startswith(PROBLEM)
    assert server.stop() == 0


"""Office routines (docs/office.md: Routines, Routine runs, Heavy vs lightweight,
Concurrency policy, Catch-up policy, The pre-installed coordinator routine, Idle wakeup skip,
Recovery sweep, and its Scenarios; docs/office.md and 7.2 for the webhook signature contract).

Each test is named after the spec scenario or rule it checks. Time-based scenarios run the
real cron (and claim / recovery) actors under MockClock; the downtime scenarios start the
cron actor with a wall clock three hours after the routine was made. Webhooks go through
Quart's test client with a FixedClock (signatures are computed here), and once through a
real ``outpost serve`` with curl, as the README shows it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from conftest import (
    HOUR,
    MINUTE,
    PROBLEM,
    PROFILES,
    T0,
    TOKEN,
    OfficeApi,
    Reply,
    activity,
    at,
    call,
    dispatch,
    instant,
    make_deps,
    new_agent,
    new_task,
    normalized,
    office_run,
    only,
    set_settings,
    settle,
    sign_in_client,
    task,
    until,
    wakeup,
    wakeups,
)

import outpost

# --- store helpers (one transaction per call, explicit ``now``) ---------------------------------------

def edit_agent(store: outpost.Store, agent_id: str, now: datetime, **changes) -> dict:
    current = call(store, store.office.agent_fields, agent_id)
    return call(store, store.office.update_agent, agent_id,
                outpost.normalize_agent(changes, profiles=list(PROFILES), current=current), now)


def new_routine(store: outpost.Store, assignee: str, *, triggers=(), now: datetime = T0,
                workspace_id: str | None = None, **fields) -> dict:
    """A routine as the API makes it: the create answer (webhook secrets included, this once)."""
    raw = {"name": "Routine", "assignee_agent_id": assignee, **fields}
    tz = call(store, store.office.office_settings, workspace_id)["timezone"]
    checked = [outpost.normalize_trigger(t, i, now, tz) for i, t in enumerate(triggers)]
    return call(store, store.routines.create_routine, workspace_id, outpost.normalize_routine(raw), checked, now)


def edit_routine(store: outpost.Store, routine_id: str, now: datetime, **changes) -> dict:
    current = call(store, store.routines.routine_fields, routine_id)
    return call(store, store.routines.update_routine, routine_id, outpost.normalize_routine(changes, current=current),
                now)


def routine(store: outpost.Store, routine_id: str) -> dict:
    return call(store, store.routines.get_routine, routine_id)


def routine_runs(store: outpost.Store, routine_id: str) -> list[dict]:
    """The routine's history, oldest first."""
    return sorted(routine(store, routine_id)["runs"], key=lambda x: (x["started_at"], x["due_at"] or "", x["id"]))


def fire(store: outpost.Store, routine_id: str, now: datetime, variables: dict | None = None) -> dict:
    """Run now (manual fire)."""
    return call(store, store.routines.fire_routine, routine_id, None, "manual", variables or {}, now)


def tasks(store: outpost.Store, agent_id: str | None = None, workspace_id: str | None = None) -> list[dict]:
    return call(store, store.office.list_tasks, workspace_id, agent_id)


# --- actors under MockClock ------------------------------------------------------------------------

async def run_actors(deps: outpost.Deps, until: datetime, *actors) -> None:
    """Run the given actors (default: the cron actor) from the clock's now until ``until``."""
    async with trio.open_nursery() as nursery:
        for actor in actors or (outpost.cron_actor,):
            nursery.start_soon(actor, deps)
        await trio.sleep(max(0.0, (until - deps.clock.now()).total_seconds()))
        nursery.cancel_scope.cancel()


# --- the HTTP API in process (Quart's test client, FixedClock) ----------------------------------------

class RoutinesApi(OfficeApi):
    """The in-process Office client (FixedClock at T0, no Idempotency-Key unless sent), with the
    conversations the routine tests share."""

    async def agent(self, name: str, **fields) -> dict:
        reply = await self.post("/api/office/agents", {"name": name, "executor": "demo", **fields})
        assert reply.status == 201, reply.body
        return reply.body

    async def routine(self, **fields) -> dict:
        reply = await self.post("/api/office/routines", fields)
        assert reply.status == 201, reply.body
        return reply.body

    async def detail(self, routine_id: str) -> dict:
        reply = await self.get(f"/api/office/routines/{routine_id}")
        assert reply.status == 200, reply.body
        return reply.body

    async def deliver(self, public_id: str, body: bytes, headers: dict[str, str]) -> Reply:
        """A webhook delivery: no API token, only what the sender signs."""
        return await self.post(f"/api/routine-triggers/{public_id}/fire", raw=body, auth=False,
                               headers={"Content-Type": "application/json", **headers})

    async def page(self, path: str) -> tuple[int, str]:
        """A dashboard page with a signed-in session."""
        sign_in_client(self.client, self.store, self.clock.now())
        response = await self.client.get(path, headers={"Accept": "text/html"})
        return response.status_code, await response.get_data(as_text=True)


@pytest.fixture
async def api(tmp_path: Path):
    client = RoutinesApi(make_deps(tmp_path), tmp_path / "repo")
    set_settings(client.store, repository=str(tmp_path / "repo"))
    yield client
    client.store.close()


def outpost_signature(secret: str, body: bytes, t: int) -> dict[str, str]:
    """docs/office.md hmac_sha256: X-Outpost-Signature: t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>."""
    digest = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return {"X-Outpost-Signature": f"t={t},v1={digest}"}


def github_signature(secret: str, body: bytes, delivery: str) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"X-Hub-Signature-256": f"sha256={digest}", "X-GitHub-Delivery": delivery, "X-GitHub-Event": "push"}


def unix(dt: datetime) -> int:
    return int(dt.timestamp())


SCHEDULE_5MIN = {"kind": "schedule", "cron_expression": "*/5 * * * *", "timezone": "UTC"}


###############################################################################
# Variables: {{name}} in title and description, types, built-ins, resolution order.
###############################################################################

async def test_saving_template_with_new_variable_auto_declares_it_text_no_default_not_required(api):
    worker = await api.agent("Worker")
    created = await api.routine(name="Bump", assignee_agent_id=worker["id"],
                                task_template={"title": "Bump {{package}} on {{date}}", "description": "{{datetime}}"},
                                variables=[{"name": "version", "type": "number", "default": 2}])
    assert created["variables"] == [
        {"name": "version", "type": "number", "default": 2, "required": False, "options": [], "description": ""},
        {"name": "package", "type": "text", "default": None, "required": False, "options": [], "description": ""}]
    # An edit that uses a new name declares it too; the existing declarations keep their types.
    patched = await api.patch(f"/api/office/routines/{created['id']}", {"task_template": {
        "title": "Bump {{package}} to {{version}}", "description": "In {{repository.full_name}}"}})
    assert patched.status == 200, patched.body
    assert [(v["name"], v["type"], v["default"], v["required"]) for v in patched.body["variables"]] == [
        ("version", "number", 2, False), ("package", "text", None, False),
        ("repository.full_name", "text", None, False)]
    assert (await api.detail(created["id"]))["variables"] == patched.body["variables"]
    # The built-ins are never declared (nor declarable).
    refused = await api.post("/api/office/routines", {"name": "x", "assignee_agent_id": worker["id"],
                                                      "variables": [{"name": "date"}]})
    assert refused.status == 422 and refused.body["errors"][0]["field"] == "variables[0].name"


def test_triggers_are_checked_with_their_defaults():
    hook = outpost.normalize_trigger({"kind": "webhook"}, 0, T0, "Europe/Berlin")
    assert hook == {"kind": "webhook", "enabled": True, "signing_mode": "hmac_sha256"}
    cron = outpost.normalize_trigger({"kind": "schedule", "cron_expression": "0 9 * * 1-5"}, 1, T0, "Europe/Berlin")
    assert (cron["cron_expression"], cron["timezone"]) == ("0 9 * * 1-5", "Europe/Berlin")   # the workspace's
    for raw, field in (({"kind": "schedule", "cron_expression": "61 * * * *"}, "triggers[0].cron_expression"),
                       ({"kind": "schedule", "cron_expression": "* * * * *", "timezone": "Mars/Base"},
                        "triggers[0].timezone"),
                       ({"kind": "webhook", "signing_mode": "md5"}, "triggers[0].signing_mode"),
                       ({"kind": "schedule", "cron_expression": "* * * * *", "signing_mode": "none"},
                        "triggers[0].signing_mode"),
                       ({"kind": "email"}, "triggers[0].kind")):
        with pytest.raises(outpost.ValidationFailed) as err:
            outpost.normalize_trigger(raw, 0, T0, "UTC")
        assert err.value.errors[0]["field"] == field
    assert outpost.cron_words("*/5 * * * *") == "every 5 minutes"
    assert outpost.cron_words("0 9 * * *") == "at 09:00 every day"
    assert outpost.cron_words("0 9 * * 1-5") == "at 09:00 on Monday-Friday"


def test_variable_types_text_number_boolean_select_are_coerced_and_checked(office):
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Deploy", concurrency_policy="always_enqueue",
                    task_template={"title": "{{count}} {{dry_run}} {{env}} {{note}}"},
                    variables=[{"name": "count", "type": "number"}, {"name": "dry_run", "type": "boolean"},
                               {"name": "env", "type": "select", "options": ["staging", "production"],
                                "default": "staging"},
                               {"name": "note", "type": "text"}])
    # The Run now form sends text: "3" is a number, "on" a boolean.
    x = fire(office, r["id"], at(0), {"count": "3", "dry_run": "on", "note": 42})
    assert task(office, x["linked_task_id"])["title"] == "3 true staging 42"
    assert x["trigger_payload"] == {"count": 3, "dry_run": True, "env": "staging", "note": "42"}
    for bad, field in (({"env": "moon"}, "variables.env"), ({"count": "many"}, "variables.count"),
                       ({"dry_run": "maybe"}, "variables.dry_run"), ({"note": {"a": 1}}, "variables.note")):
        with pytest.raises(outpost.ValidationFailed) as err:
            fire(office, r["id"], at(1), bad)
        assert err.value.errors[0]["field"] == field
    assert len(routine_runs(office, r["id"])) == 1 and len(tasks(office, worker)) == 1


def test_variable_resolution_order_builtins_then_defaults_then_provided(office):
    set_settings(office, timezone="Pacific/Auckland")
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Digest", concurrency_policy="always_enqueue",
                    task_template={"title": "{{date}} for {{who}}",
                                   "description": "{{datetime}} {{who}} in {{channel}}"},
                    variables=[{"name": "who", "default": "the team"}, {"name": "channel", "default": "#ops"}])
    # 20:00 UTC on 30 November is 09:00 on 1 December in Auckland: built-ins are local.
    first = fire(office, r["id"], at(12 * HOUR))
    t = task(office, first["linked_task_id"])
    assert (t["title"], t["description"]) == ("2026-12-01 for the team",
                                              "2026-12-01T09:00:00+13:00 the team in #ops")
    second = fire(office, r["id"], at(12 * HOUR), {"who": "Ada"})     # provided beats the default
    assert task(office, second["linked_task_id"])["title"] == "2026-12-01 for Ada"
    assert second["trigger_payload"] == {"who": "Ada", "channel": "#ops"}


def test_webhook_body_values_by_top_level_key_and_dotted_path():
    declared = outpost.normalize_routine({"name": "Push", "assignee_agent_id": "agt_x", "task_template": {
        "title": "{{ref}} of {{repository.full_name}} by {{pusher.name}} ({{head_commit.id}})"}})["variables"]
    push = {"ref": "refs/heads/main", "repository": {"full_name": "acme/app", "private": False},
            "pusher": {"name": "ada"}, "head_commit": None}
    values = outpost.resolve_variables(declared, push, T0, outpost.ZoneInfo("UTC"))
    assert values["ref"] == "refs/heads/main" and values["repository.full_name"] == "acme/app"
    title = outpost.render_variables("{{ref}} of {{repository.full_name}} by {{pusher.name}} ({{head_commit.id}})",
                                     values)
    assert title == "refs/heads/main of acme/app by ada ({{head_commit.id}})"   # absent: left as written
    # A top-level key spelled with the dot is taken by name before the path is walked.
    flat = outpost.resolve_variables(declared, {"repository.full_name": "flat/name", **push}, T0,
                                     outpost.ZoneInfo("UTC"))
    assert flat["repository.full_name"] == "flat/name"


def test_lightweight_routine_description_variable_from_webhook_reaches_the_prompt(office):
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    r = new_routine(office, lead, name="CI watch", description="Check the CI of {{branch}}.",
                    triggers=[{"kind": "webhook", "signing_mode": "none"}])
    fired = call(office, office.routines.fire_webhook, r["triggers"][0]["id"], {"branch": "release/2.0"}, (), 0,
                 at(0))[0]
    (run_id,) = dispatch(office, at(1))
    assert "Check the CI of release/2.0." in office_run(office, run_id)["assembled_prompt"]
    assert fired["trigger_payload"] == {"branch": "release/2.0"}


def test_lightweight_routine_builtin_date_is_in_workspace_timezone(office):
    set_settings(office, timezone="Pacific/Auckland")
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    r = new_routine(office, lead, name="Standup", description="Standup notes for {{date}}.")
    fire(office, r["id"], at(12 * HOUR))            # 1 December, 09:00 in Auckland
    (run_id,) = dispatch(office, at(12 * HOUR))
    assert "Standup notes for 2026-12-01." in office_run(office, run_id)["assembled_prompt"]


###############################################################################
# Heavy vs lightweight; routine runs; concurrency policy.
###############################################################################

async def test_heavy_routine_daily_dep_update_creates_task_at_0900_utc(autojump_clock, mock_deps, tmp_path):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(tmp_path / "repo"))
    worker = new_agent(store, "Frontend Worker", cooldown_sec=0)
    r = new_routine(store, worker, name="Daily Dep Update", task_template={"description": "Update the dependencies."},
                    triggers=[{"kind": "schedule", "cron_expression": "0 9 * * *", "timezone": "UTC"}])
    assert r["triggers"][0]["next_run_at"] == "2026-11-30T09:00:00Z"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.cron_actor, deps)
        await trio.sleep(HOUR - 1)                                      # 08:59:59
        assert tasks(store) == [] and routine_runs(store, r["id"]) == [] and wakeups(store) == []
        await trio.sleep(2)                                             # 09:00:01
        nursery.cancel_scope.cancel()
    t = only(tasks(store))
    assert (t["title"], t["description"], t["assignee_agent_id"]) == (
        "Daily Dep Update - 2026-11-30", "Update the dependencies.", worker)
    assert (t["workflow"], t["state"]) == ("routine", "IN_PROGRESS")
    assert abs(instant(t["created_at"]) - at(HOUR)) < timedelta(seconds=1)
    w = only(wakeups(store, worker))
    assert (w["source"], w["status"], w["task_id"]) == ("task_assigned", "queued", t["id"])
    x = only(routine_runs(store, r["id"]))
    assert (x["source"], x["status"], x["linked_task_id"], x["due_at"]) == (
        "cron", "task_created", t["id"], "2026-11-30T09:00:00Z")
    assert x["trigger_id"] == r["triggers"][0]["id"] and x["dispatch_fingerprint"]
    trigger = only(routine(store, r["id"])["triggers"])
    assert trigger["next_run_at"] == "2026-12-01T09:00:00Z"
    assert abs(instant(trigger["last_fired_at"]) - at(HOUR)) < timedelta(seconds=1)


def test_heavy_routine_task_auto_completes_when_its_run_succeeds(office):
    worker = new_agent(office, "Frontend Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Daily review", task_template={"title": "Review {{date}}"})
    x = fire(office, r["id"], at(0))
    assert (x["source"], x["status"], x["trigger_id"]) == ("manual", "task_created", "manual")
    tid = x["linked_task_id"]
    assert task(office, tid)["title"] == "Review 2026-11-30"
    (run_id,) = dispatch(office, at(1))
    assert office_run(office, run_id)["task_id"] == tid
    settle(office, run_id, "succeeded", at(2))
    assert task(office, tid)["state"] == "DONE"
    # A failed run does not complete it: the task stays in progress and the wakeup is retried.
    y = fire(office, r["id"], at(3))
    (run_id,) = dispatch(office, at(4))
    settle(office, run_id, "failed", at(5), error="boom", exit_code=1)
    assert task(office, y["linked_task_id"])["state"] == "IN_PROGRESS"


def test_lightweight_routine_fire_queues_a_taskless_routine_wakeup(office):
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    r = new_routine(office, lead, name="Check upstream PRs", description="Look at the open pull requests.")
    x = fire(office, r["id"], at(0))
    assert (x["status"], x["linked_task_id"]) == ("task_created", None)   # dispatched, no task
    assert tasks(office) == []
    w = wakeup(office, x["wakeup_id"])
    assert (w["source"], w["agent_id"], w["status"], w["task_id"]) == ("routine", lead, "queued", None)
    assert w["payload"] == {"routine_id": r["id"], "missed_ticks": 0,   # the built-ins as of the fire
                            "variables": {"date": "2026-11-30", "datetime": "2026-11-30T08:00:00+00:00"}}
    (run_id,) = dispatch(office, at(1))
    run = office_run(office, run_id)
    assert run["task_id"] is None
    assert "## Routine: Check upstream PRs\nLook at the open pull requests." in run["assembled_prompt"]
    # Its continuation summary is keyed by routine:<id>.
    settle(office, run_id, "succeeded", at(2), result={"summary": "two PRs need review"})
    summaries = call(office, office.office.summary_of, lead)
    assert [(s["scope"], s["updated_by_run_id"]) for s in summaries] == [(f"routine:{r['id']}", run_id)]


def test_a_lightweight_routine_run_takes_only_the_specs_statuses(office):
    """Issue 24.6d (and defect 17: a lightweight fire stayed ``received`` forever). A routine
    run is received -> task_created | skipped | coalesced | failed, nothing else: a lightweight
    fire is task_created once its wakeup is queued (no task linked), never ``completed``; it
    is skipped when that wakeup was idle-skipped, failed (with the error) when it gave up."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    r = new_routine(office, lead, concurrency_policy="always_enqueue")
    ok, merged = fire(office, r["id"], at(0)), fire(office, r["id"], at(0.5))
    for x, fired in ((ok, at(0)), (merged, at(0.5))):
        assert (x["status"], x["linked_task_id"], x["completed_at"]) == ("task_created", None, outpost.rfc3339(fired))
    assert wakeup(office, merged["wakeup_id"])["coalesced_into"] == ok["wakeup_id"]
    (run_id,) = dispatch(office, at(1))   # the second fire merged into the first's wakeup
    settle(office, run_id, "succeeded", at(2), result={"summary": "done"})
    assert [x["status"] for x in routine_runs(office, r["id"])] == ["task_created", "task_created"]
    failing = fire(office, r["id"], at(3))
    w = wakeup(office, failing["wakeup_id"])
    office.transaction(lambda: office.pipeline._escalate_failure(office.db.Wakeup[w["id"]], "boom", at(4)))
    failed = {x["id"]: x for x in routine_runs(office, r["id"])}[failing["id"]]
    assert (failed["status"], failed["completed_at"]) == ("failed", outpost.rfc3339(at(4)))
    # A worker with nothing to do: its routine's wakeup is idle-skipped, and so is the fire.
    worker = new_agent(office, "Worker", cooldown_sec=0)
    idle = new_routine(office, worker, name="Poll")
    x = fire(office, idle["id"], at(5))
    assert x["status"] == "task_created"
    assert dispatch(office, at(6)) == []
    skipped = only(routine_runs(office, idle["id"]))
    assert (skipped["status"], skipped["completed_at"]) == ("skipped", outpost.rfc3339(at(6)))
    statuses = {x["status"] for rid in (r["id"], idle["id"]) for x in routine_runs(office, rid)}
    assert statuses <= {"received", "task_created", "skipped", "coalesced", "failed"}


def test_run_now_sets_the_manual_triggers_last_fired_at(office):
    """Defect 17: a manual Run now never set its trigger's last_fired_at."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    r = new_routine(office, lead, triggers=[{"kind": "manual"}])
    fire(office, r["id"], at(5))
    (trigger,) = routine(office, r["id"])["triggers"]
    assert trigger["last_fired_at"] == outpost.rfc3339(at(5))
    assert routine_runs(office, r["id"])[0]["trigger_id"] == trigger["id"]


def test_a_routine_whose_wakeup_merged_into_another_routines_run_advances_its_own_summary(office):
    """Defect 17: when routine B's wakeup merged into routine A's run, B's summary chain was
    not advanced."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    a = new_routine(office, lead, name="A")
    b = new_routine(office, lead, name="B")
    fire(office, a["id"], at(0))
    fire(office, b["id"], at(0.5))   # the same agent, taskless: merged at claim time
    (run_id,) = dispatch(office, at(1))
    settle(office, run_id, "succeeded", at(2), result={"summary": "looked at both"})
    scopes = {s["scope"]: s["updated_by_run_id"] for s in call(office, office.office.summary_of, lead)}
    assert scopes == {f"routine:{a['id']}": run_id, f"routine:{b['id']}": run_id}


def test_skip_if_active_routine_run_is_skipped(office):
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Nightly", concurrency_policy="skip_if_active",
                    task_template={"title": "Nightly {{datetime}}"})
    first = fire(office, r["id"], at(0))
    assert first["status"] == "task_created"
    second = fire(office, r["id"], at(MINUTE))
    assert (second["status"], second["linked_task_id"], second["coalesced_into_run_id"]) == ("skipped", None, None)
    assert len(tasks(office, worker)) == 1
    # "Active" means the linked task is not terminal: once it is done, the next fire proceeds.
    call(office, office.office.move_task, first["linked_task_id"], "DONE", at(2 * MINUTE))
    third = fire(office, r["id"], at(3 * MINUTE))
    assert third["status"] == "task_created" and len(tasks(office, worker)) == 2
    assert [x["status"] for x in routine_runs(office, r["id"])] == ["task_created", "skipped", "task_created"]


def test_coalesce_if_active_routine_run_is_coalesced_into_the_active_one(office):
    worker = new_agent(office, "Worker", cooldown_sec=0)
    heavy = new_routine(office, worker, name="Triage", task_template={"title": "Triage {{datetime}}"})
    assert heavy["concurrency_policy"] == "coalesce_if_active"     # the default
    first = fire(office, heavy["id"], at(0))
    second = fire(office, heavy["id"], at(MINUTE))
    assert (second["status"], second["coalesced_into_run_id"], second["linked_task_id"]) == (
        "coalesced", first["id"], None)
    assert len(tasks(office, worker)) == 1
    # Lightweight: active while its wakeup is queued or its run in flight.
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    light = new_routine(office, lead, name="Pulse")
    a = fire(office, light["id"], at(HOUR))
    b = fire(office, light["id"], at(HOUR + MINUTE))
    assert (b["status"], b["coalesced_into_run_id"], b["wakeup_id"]) == ("coalesced", a["id"], None)
    (run_id,) = [r for r in dispatch(office, at(HOUR + 2 * MINUTE)) if office_run(office, r)["agent_id"] == lead]
    c = fire(office, light["id"], at(HOUR + 3 * MINUTE))
    assert c["status"] == "coalesced", "a running run is still active"
    settle(office, run_id, "succeeded", at(HOUR + 4 * MINUTE))
    d = fire(office, light["id"], at(HOUR + 5 * MINUTE))
    assert d["status"] == "task_created" and wakeup(office, d["wakeup_id"])["status"] == "queued"
    assert len(wakeups(office, lead, source="routine")) == 2


def test_a_heavy_routine_whose_task_run_escalated_wakes_its_agent_again_at_the_next_fire(office):
    """Issue 34: the task of a failed daily review stayed IN_PROGRESS and every later fire was
    recorded coalesced into it, running nothing. A fire into a task nobody works on wakes the
    task's agent again, on that task and its branch; a fire while a retry waits is still
    coalesced."""
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Daily review", task_template={"title": "Review"})
    first = fire(office, r["id"], at(0))
    tid, now = first["linked_task_id"], at(1)
    for attempt in range(outpost.MAX_RETRY_COUNT + 1):
        (run_id,) = dispatch(office, now)
        settle(office, run_id, "failed", now, error="network timeout", exit_code=1)
        held = fire(office, r["id"], now + timedelta(seconds=1))
        if attempt < outpost.MAX_RETRY_COUNT:   # a retry waits: the task is worked on
            assert (held["status"], held["coalesced_into_run_id"]) == ("coalesced", first["id"])
        now += timedelta(hours=3)
    assert only(wakeups(office, worker, source="task_assigned"))["status"] == "failed", "escalated"
    assert task(office, tid)["state"] == "IN_PROGRESS"
    assert (held["status"], held["linked_task_id"]) == ("task_created", tid)
    woken = wakeup(office, held["wakeup_id"])
    assert (woken["source"], woken["task_id"], woken["agent_id"], woken["status"]) == ("routine", tid, worker,
                                                                                       "queued")
    (run_id,) = dispatch(office, now)
    assert office_run(office, run_id)["task_id"] == tid
    assert call(office, office.runs.get_run, run_id)["result_branch"] == outpost.office_branch(tid, "Worker")
    assert len(tasks(office, worker)) == 1


def test_a_heavy_routine_fire_into_a_task_waiting_for_you_is_counted_on_its_item(office):
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Daily review", task_template={"title": "Review"})
    tid = fire(office, r["id"], at(0))["linked_task_id"]
    (run_id,) = dispatch(office, at(1))
    settle(office, run_id, "needs_you", at(2), result={"status": "needs_you", "question": "Which branch?"})
    call(office, office.schedules.notify_run, run_id, at(2))
    for i in range(3):
        x = fire(office, r["id"], at(HOUR * (i + 1)))
        assert (x["status"], x["wakeup_id"]) == ("coalesced", None)
    item = only([a for a in call(office, office.list_attention, True) if a["kind"] == "needs_you"])
    assert (item["run_id"], item["title"]) == (run_id, "Run of agent Worker needs you")   # not "of dispatch"
    assert item["detail"] == "Which branch?\n\nThe routine fired 3 more times while this waits for you."
    assert [w["task_id"] for w in wakeups(office, worker)] == [tid], "nothing else was woken"


def test_always_enqueue_creates_a_task_on_every_fire(office):
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Scan", concurrency_policy="always_enqueue",
                    task_template={"title": "Scan"})
    runs = [fire(office, r["id"], at(i * MINUTE)) for i in range(3)]
    assert [x["status"] for x in runs] == ["task_created"] * 3
    assert len({x["linked_task_id"] for x in runs}) == 3 == len(tasks(office, worker))


def test_always_create_is_the_specs_name_for_always_enqueue(office):
    """shared/API.md 7.3: the spec's ``always_create`` is accepted and stored as ``always_enqueue``."""
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Scan", concurrency_policy="always_create", task_template={"title": "Scan"})
    assert r["concurrency_policy"] == "always_enqueue"
    runs = [fire(office, r["id"], at(i * MINUTE)) for i in range(2)]
    assert [x["status"] for x in runs] == ["task_created"] * 2
    with pytest.raises(outpost.ValidationFailed, match="always_enqueue"):
        outpost.normalize_routine({"name": "x", "assignee_agent_id": worker, "concurrency_policy": "sometimes"})


def test_concurrency_policy_is_evaluated_per_dispatch_fingerprint(office):
    worker = new_agent(office, "Release Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Release", task_template={"title": "Release {{branch}}"})
    a = fire(office, r["id"], at(0), {"branch": "release/2.0"})
    b = fire(office, r["id"], at(1), {"branch": "release/3.0"})
    assert a["dispatch_fingerprint"] != b["dispatch_fingerprint"]
    same = fire(office, r["id"], at(2), {"branch": "release/2.0"})
    assert (same["status"], same["coalesced_into_run_id"]) == ("coalesced", a["id"])
    assert b["status"] == "task_created", "release/3.0 got no task"
    assert sorted(t["title"] for t in tasks(office, worker)) == ["Release release/2.0", "Release release/3.0"]


async def test_cron_fire_without_required_variable_is_recorded_failed(autojump_clock, mock_deps, tmp_path):
    deps, office = mock_deps, mock_deps.store
    set_settings(office, repository=str(tmp_path / "repo"))
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Deploy", task_template={"title": "Deploy to {{env}}"},
                    variables=[{"name": "env", "required": True}], triggers=[SCHEDULE_5MIN])
    await run_actors(deps, at(6 * MINUTE))
    x = only(routine_runs(office, r["id"]))
    assert (x["source"], x["status"], x["due_at"], x["linked_task_id"]) == (
        "cron", "failed", "2026-11-30T08:05:00Z", None)
    assert "env" in x["error"]
    assert tasks(office) == [] and wakeups(office) == []


def test_a_cron_tick_fires_once_even_when_claimed_again(office):
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    r = new_routine(office, lead, name="Pulse", concurrency_policy="always_enqueue", triggers=[SCHEDULE_5MIN])
    trigger_id = r["triggers"][0]["id"]
    assert call(office, office.routines.claim_due_routines, at(5 * MINUTE + 30)) == 1
    assert call(office, office.routines.claim_due_routines, at(5 * MINUTE + 30)) == 0
    # Even if the trigger's next fire were set back (two claimers of one tick), the ledger holds.
    office.transaction(lambda: office.db.RoutineTrigger[trigger_id].set(next_run_at=outpost.naive(at(5 * MINUTE))))
    call(office, office.routines.claim_due_routines, at(5 * MINUTE + 40))
    x = only(routine_runs(office, r["id"]))
    w = wakeup(office, x["wakeup_id"])
    assert w["idempotency_key"] == f"routine:{r['id']}:{trigger_id}:{unix(at(5 * MINUTE)) // 60}"
    assert len(wakeups(office, lead)) == 1


###############################################################################
# Webhook triggers (docs/office.md): signatures, refusals, GitHub deliveries, secrets.
###############################################################################

async def webhook_routine(api: RoutinesApi, mode: str = "hmac_sha256", **fields) -> tuple[dict, dict]:
    """A routine with one webhook trigger: (routine, trigger with its secret)."""
    worker = await api.agent(f"Worker {uuid.uuid4().hex[:6]}")
    fields.setdefault("task_template", {"title": "Release {{branch}}"})
    created = await api.routine(**{"name": "Release", "assignee_agent_id": worker["id"],
                                   "triggers": [{"kind": "webhook", "signing_mode": mode}], **fields})
    return created, only(created["triggers"])


async def test_webhook_hmac_branch_variable_resolved(api):
    r, trigger = await webhook_routine(api, task_template={"title": "Release {{branch}}",
                                                           "description": "Cut {{branch}} on {{date}}."})
    assert trigger["fire_path"] == f"/api/routine-triggers/{trigger['public_id']}/fire"
    body = json.dumps({"branch": "release/2.0"}).encode()
    reply = await api.deliver(trigger["public_id"], body, outpost_signature(trigger["secret"], body, unix(T0)))
    assert reply.status == 202, reply.body
    assert reply.body["status"] == "task_created"
    x = only((await api.detail(r["id"]))["runs"])
    assert (x["id"], x["source"], x["trigger_id"], x["status"]) == (
        reply.body["routine_run_id"], "webhook", trigger["id"], "task_created")
    assert x["trigger_payload"] == {"branch": "release/2.0"}
    t = (await api.get(f"/api/office/tasks/{x['linked_task_id']}")).body
    assert (t["title"], t["description"], t["assignee_agent_id"]) == (
        "Release release/2.0", "Cut release/2.0 on 2026-11-30.", r["assignee_agent_id"])
    (w,) = (await api.get(f"/api/office/wakeups?agent_id={r['assignee_agent_id']}")).body["wakeups"]
    assert (w["source"], w["status"], w["payload"]) == ("task_assigned", "queued", {"task_id": t["id"]})
    assert (await api.detail(r["id"]))["triggers"][0]["refused_deliveries"] == []


async def test_webhook_bad_signature_stale_timestamp_and_replay_are_refused_401_and_listed(api):
    r, trigger = await webhook_routine(api, concurrency_policy="always_enqueue")
    secret, public_id = trigger["secret"], trigger["public_id"]
    body = b'{"branch": "main"}'
    now = unix(T0)
    good = outpost_signature(secret, body, now)
    assert (await api.deliver(public_id, body, good)).status == 202
    refusals = [
        (body, outpost_signature("not-the-secret", body, now), "bad signature"),
        (b'{"branch": "evil"}', good, "bad signature"),                              # body swapped under it
        (body, outpost_signature(secret, body, now - 301), "stale timestamp"),
        (body, outpost_signature(secret, body, now + 301), "stale timestamp"),
        (body, good, "replayed signature"),                                          # within the 300 s
        (body, {}, "missing X-Outpost-Signature (t=<unix seconds>,v1=<hex>)"),
    ]
    for sent, headers, _ in refusals:
        reply = await api.deliver(public_id, sent, headers)
        assert reply.status == 401, reply.body
        assert reply.mimetype == PROBLEM and reply.body["code"] == "unauthorized"
    # Nothing was created by any of them.
    detail = await api.detail(r["id"])
    assert len(detail["runs"]) == 1 and len((await api.get("/api/office/tasks")).body["tasks"]) == 1
    listed = detail["triggers"][0]["refused_deliveries"][::-1]                       # oldest first
    assert [f["reason"] for f in listed] == [reason for _, _, reason in refusals]
    assert [f["size"] for f in listed] == [len(sent) for sent, _, _ in refusals]
    for f in listed:
        assert set(f) == {"at", "reason", "source_address", "size"} and f["source_address"]
        assert instant(f["at"]) == T0
    everything = (await api.get(f"/api/office/routines/{r['id']}")).text + (await api.get("/api/office/routines")).text
    assert secret not in everything
    # At the edge of the window a fresh signature is accepted; 301 s later the replay is merely stale.
    assert (await api.deliver(public_id, body, outpost_signature(secret, body, now - 300))).status == 202
    api.clock.at = T0 + timedelta(seconds=301)
    assert (await api.deliver(public_id, body, good)).status == 401
    assert (await api.detail(r["id"]))["triggers"][0]["refused_deliveries"][0]["reason"] == "stale timestamp"


async def test_a_signature_stamped_ahead_is_a_replay_for_as_long_as_its_stamp_is_accepted(api):
    """A sender's clock 250 s ahead is within the skew tolerance; its signature is then refused
    as a replay until its own stamp goes stale (stamp + 300 s), not only 300 s after it arrived."""
    r, trigger = await webhook_routine(api, concurrency_policy="always_enqueue")
    body = b'{"branch": "main"}'
    ahead = outpost_signature(trigger["secret"], body, unix(T0) + 250)
    assert (await api.deliver(trigger["public_id"], body, ahead)).status == 202
    for later_s in (310, 550):   # 550: the stamp's last accepted second
        api.clock.at = T0 + timedelta(seconds=later_s)
        replay = await api.deliver(trigger["public_id"], body, ahead)
        assert replay.status == 401 and "replay" in replay.body["detail"], (later_s, replay.body)
    api.clock.at = T0 + timedelta(seconds=551)
    assert (await api.deliver(trigger["public_id"], body, ahead)).status == 401
    detail = await api.detail(r["id"])
    assert len(detail["runs"]) == 1
    assert [f["reason"] for f in detail["triggers"][0]["refused_deliveries"]] == [
        "stale timestamp", "replayed signature", "replayed signature"]


async def test_github_push_delivery_fires_once_and_redelivery_does_not(api):
    r, trigger = await webhook_routine(api, "github", concurrency_policy="always_enqueue",
                                       task_template={"title": "Deploy {{repository.full_name}} at {{ref}}"})
    assert [v["name"] for v in r["variables"]] == ["repository.full_name", "ref"]
    secret, public_id = trigger["secret"], trigger["public_id"]
    push = {"ref": "refs/heads/main", "repository": {"full_name": "acme/app", "private": False},
            "pusher": {"name": "ada"}, "commits": [{"id": "abc"}]}
    body = json.dumps(push).encode()
    delivery = str(uuid.uuid4())
    first = await api.deliver(public_id, body, github_signature(secret, body, delivery))
    assert first.status == 202 and first.body["status"] == "task_created"
    again = await api.deliver(public_id, body, github_signature(secret, body, delivery))   # GitHub's "Redeliver"
    assert again.status == 200
    assert again.body == {"routine_run_id": first.body["routine_run_id"], "status": "duplicate"}
    x = only((await api.detail(r["id"]))["runs"])
    assert x["trigger_payload"] == {"repository.full_name": "acme/app", "ref": "refs/heads/main"}
    (t,) = (await api.get("/api/office/tasks")).body["tasks"]
    assert t["title"] == "Deploy acme/app at refs/heads/main"
    # A wrong secret or no signature: 401, recorded, nothing fired.
    wrong = await api.deliver(public_id, body, github_signature("guess", body, str(uuid.uuid4())))
    unsigned = await api.deliver(public_id, body, {"X-GitHub-Delivery": str(uuid.uuid4())})
    assert wrong.status == unsigned.status == 401
    assert [f["reason"] for f in (await api.detail(r["id"]))["triggers"][0]["refused_deliveries"]] == [
        "missing X-Hub-Signature-256", "bad signature"]
    # A new delivery (a new push) fires; the old delivery id is forgotten after 24 h.
    later = json.dumps({**push, "commits": [{"id": "def"}]}).encode()
    assert (await api.deliver(public_id, later, github_signature(secret, later, str(uuid.uuid4())))).status == 202
    api.clock.at = T0 + timedelta(hours=24, seconds=1)
    assert (await api.deliver(public_id, body, github_signature(secret, body, delivery))).status == 202
    assert len((await api.detail(r["id"]))["runs"]) == 3


async def test_a_github_body_replayed_under_another_or_no_delivery_id_is_refused_as_a_replay(api):
    r, trigger = await webhook_routine(api, "github", concurrency_policy="always_enqueue",
                                       task_template={"title": "Deploy {{ref}}"})
    secret, public_id = trigger["secret"], trigger["public_id"]
    body = json.dumps({"ref": "refs/heads/main", "after": "abc"}).encode()
    assert (await api.deliver(public_id, body, github_signature(secret, body, str(uuid.uuid4())))).status == 202
    other_id = github_signature(secret, body, str(uuid.uuid4()))
    no_id = {k: v for k, v in other_id.items() if k != "X-GitHub-Delivery"}
    for headers in (other_id, no_id):
        replay = await api.deliver(public_id, body, headers)
        assert replay.status == 401 and "replay" in replay.body["detail"], replay.body
    # A first delivery without an id is accepted once, not twice.
    tag = json.dumps({"ref": "refs/tags/v1", "after": "def"}).encode()
    unnamed = {k: v for k, v in github_signature(secret, tag, "").items() if k != "X-GitHub-Delivery"}
    assert (await api.deliver(public_id, tag, unnamed)).status == 202
    assert (await api.deliver(public_id, tag, unnamed)).status == 401
    detail = await api.detail(r["id"])
    assert len(detail["runs"]) == 2 and len((await api.get("/api/office/tasks")).body["tasks"]) == 2
    assert [f["reason"] for f in detail["triggers"][0]["refused_deliveries"]] == ["replayed signature"] * 3
    # The replay window is GitHub's 24 h: after it the same body fires again.
    api.clock.at = T0 + timedelta(hours=24, seconds=1)
    assert (await api.deliver(public_id, body, other_id)).status == 202


async def test_webhook_secret_shown_once_at_creation_never_in_get(api):
    worker = await api.agent("Worker")
    created = await api.routine(name="Hooks", assignee_agent_id=worker["id"], triggers=[
        {"kind": "webhook", "signing_mode": m} for m in ("hmac_sha256", "github", "bearer", "none")])
    by_mode = {t["signing_mode"]: t for t in created["triggers"]}
    shown = [by_mode[m]["secret"] for m in ("hmac_sha256", "github", "bearer")]
    assert all(len(s) >= 32 for s in shown) and len(set(shown)) == 3
    assert "secret" not in by_mode["none"]
    added = await api.post(f"/api/office/routines/{created['id']}/triggers", {"kind": "webhook"})
    assert added.status == 201 and added.body["signing_mode"] == "hmac_sha256" and added.body["secret"]
    shown.append(added.body["secret"])
    detail = await api.get(f"/api/office/routines/{created['id']}")
    listing = await api.get("/api/office/routines")
    status, page = await api.page(f"/office/routines/{created['id']}")
    assert status == 200
    for text in (detail.text, listing.text, page):
        assert not any(s in text for s in shown)
    assert all("secret" not in t for t in detail.body["triggers"])
    assert "SECRET=...   # shown once" in page


async def test_rotated_secret_old_and_new_accepted_during_grace_period(api):
    r, trigger = await webhook_routine(api, concurrency_policy="always_enqueue")
    old = trigger["secret"]
    rotated = await api.post(f"/api/office/routines/{r['id']}/triggers/{trigger['id']}/rotate")
    assert rotated.status == 200, rotated.body
    new = rotated.body["secret"]
    assert new != old and rotated.body["previous_secret_valid_until"] == "2026-12-01T08:00:00Z"
    detail = await api.get(f"/api/office/routines/{r['id']}")
    assert new not in detail.text and old not in detail.text
    body = b'{"branch": "main"}'
    assert (await api.deliver(trigger["public_id"], body, outpost_signature(old, body, unix(T0)))).status == 202
    assert (await api.deliver(trigger["public_id"], body, outpost_signature(new, body, unix(T0)))).status == 202
    api.clock.at = T0 + timedelta(hours=24, seconds=1)                 # the grace period is over
    later = unix(api.clock.at)
    refused = await api.deliver(trigger["public_id"], body, outpost_signature(old, body, later))
    assert refused.status == 401
    assert (await api.deliver(trigger["public_id"], body, outpost_signature(new, body, later))).status == 202
    assert len((await api.detail(r["id"]))["runs"]) == 3


async def test_bearer_and_unsigned_webhooks(api):
    r, trigger = await webhook_routine(api, "bearer", concurrency_policy="always_enqueue")
    body = b'{"branch": "main"}'
    assert (await api.deliver(trigger["public_id"], body, {"Authorization": "Bearer nope"})).status == 401
    assert (await api.deliver(trigger["public_id"], body, {"Authorization": f"Bearer {TOKEN}"})).status == 401
    ok = await api.deliver(trigger["public_id"], body, {"Authorization": f"Bearer {trigger['secret']}"})
    assert ok.status == 202
    r2, open_trigger = await webhook_routine(api, "none")
    assert (await api.deliver(open_trigger["public_id"], body, {})).status == 202
    assert (await api.deliver("no-such-trigger", body, {})).status == 404


async def test_webhook_without_required_variable_is_422_and_creates_nothing(api):
    r, trigger = await webhook_routine(api, variables=[{"name": "branch", "required": True}])
    body = b'{"tag": "v2"}'
    reply = await api.deliver(trigger["public_id"], body, outpost_signature(trigger["secret"], body, unix(T0)))
    assert reply.status == 422 and reply.body["errors"] == [{"field": "variables.branch", "message": "is required"}]
    detail = await api.detail(r["id"])
    assert detail["runs"] == [] and (await api.get("/api/office/tasks")).body["tasks"] == []
    assert "branch" in only(detail["triggers"][0]["refused_deliveries"])["reason"]
    body = b'["main"]'
    listed = await api.deliver(trigger["public_id"], body, outpost_signature(trigger["secret"], body, unix(T0)))
    assert listed.status == 422 and (await api.detail(r["id"]))["runs"] == []
    body = b'{"branch": "main"}'
    fixed = await api.deliver(trigger["public_id"], body, outpost_signature(trigger["secret"], body, unix(T0)))
    assert fixed.status == 202
    assert "JSON object" in (await api.detail(r["id"]))["triggers"][0]["refused_deliveries"][0]["reason"]


async def test_run_now_with_required_reason_variable_refused_without_it(api):
    worker = await api.agent("Worker")
    r = await api.routine(name="Hotfix", assignee_agent_id=worker["id"], task_template={"title": "Hotfix: {{reason}}"},
                          variables=[{"name": "reason", "type": "text", "required": True}])
    refused = await api.post(f"/api/office/routines/{r['id']}/fire", {})
    assert refused.status == 422 and refused.mimetype == PROBLEM
    assert refused.body["errors"] == [{"field": "variables.reason", "message": "is required"}]
    assert (await api.detail(r["id"]))["runs"] == [] and (await api.get("/api/office/tasks")).body["tasks"] == []
    # The Run now form asks for it before firing: the browser will not submit it empty.
    status, page = await api.page(f"/office/routines/{r['id']}")
    assert status == 200
    field = re.search(r'<input[^>]*name="var_reason"[^>]*>', page)
    assert field and re.search(r"\brequired\b", field[0]), page
    # ... and a form sent without it anyway is refused the same way, naming the field.
    csrf = sign_in_client(api.client, api.store, T0)
    response = await api.client.post(f"/office/routines/{r['id']}/fire", form={"csrf": csrf, "var_reason": ""})
    assert response.status_code == 422
    assert "is required" in await response.get_data(as_text=True)
    assert (await api.detail(r["id"]))["runs"] == []
    fired = await api.post(f"/api/office/routines/{r['id']}/fire", {"variables": {"reason": "prod is down"}})
    assert fired.status == 202 and fired.body["status"] == "task_created"
    assert fired.body["source"] == "manual" and fired.body["trigger_payload"] == {"reason": "prod is down"}
    assert (await api.get(f"/api/office/tasks/{fired.body['linked_task_id']}")).body["title"] == "Hotfix: prod is down"


async def test_paused_or_archived_routine_never_fires_from_any_trigger(api):
    worker = await api.agent("Worker")
    r = await api.routine(name="Guarded", assignee_agent_id=worker["id"], concurrency_policy="always_enqueue",
                          task_template={"title": "Guarded"},
                          triggers=[SCHEDULE_5MIN, {"kind": "webhook", "signing_mode": "none"}])
    public_id = r["triggers"][1]["public_id"]
    store = api.store

    async def nothing_fires(now: datetime, state: str) -> None:
        before = len((await api.detail(r["id"]))["runs"])
        manual = await api.post(f"/api/office/routines/{r['id']}/fire", {})
        assert manual.status == 409 and state in manual.body["detail"]
        hook = await api.deliver(public_id, b"{}", {})
        assert hook.status == 409
        assert call(store, store.routines.claim_due_routines, now) == 0
        detail = await api.detail(r["id"])
        assert len(detail["runs"]) == before
        assert detail["triggers"][1]["refused_deliveries"][0]["reason"] == f"routine {state}"

    assert (await api.patch(f"/api/office/routines/{r['id']}", {"status": "paused"})).status == 200
    await nothing_fires(at(11 * MINUTE), "paused")
    # Its schedule moved on: resuming does not replay the ticks it slept through.
    assert (await api.detail(r["id"]))["triggers"][0]["next_run_at"] == "2026-11-30T08:15:00Z"
    assert (await api.patch(f"/api/office/routines/{r['id']}", {"status": "active"})).status == 200
    assert call(store, store.routines.claim_due_routines, at(15 * MINUTE)) == 1
    assert [x["due_at"] for x in (await api.detail(r["id"]))["runs"]] == ["2026-11-30T08:15:00Z"]
    assert (await api.patch(f"/api/office/routines/{r['id']}", {"status": "archived"})).status == 200
    await nothing_fires(at(HOUR), "archived")
    unarchive = await api.patch(f"/api/office/routines/{r['id']}", {"status": "active"})
    assert unarchive.status == 422 and unarchive.body["errors"][0]["field"] == "status"
    assert len((await api.get("/api/office/tasks")).body["tasks"]) == 1


def test_curl_fires_hmac_webhook_on_a_real_server(server_factory):
    """The README's worked example, against ``outpost serve``: curl, a signature made with
    openssl (or Python's hmac when openssl is missing), then the same delivery again."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    server = server_factory()
    with server.client() as client:
        worker = client.post("/api/office/agents", json={"name": "Release Worker", "executor": "demo"}).json()
        created = client.post("/api/office/routines", json={
            "name": "Release", "assignee_agent_id": worker["id"], "task_template": {"title": "Release {{branch}}"},
            "triggers": [{"kind": "webhook", "signing_mode": "hmac_sha256"}]}).json()
    trigger = only(created["triggers"])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "URL": server.url + trigger["fire_path"],
           "SECRET": trigger["secret"], "BODY": '{"branch": "release/2.0"}'}
    if shutil.which("openssl"):
        sign = 'T=$(date +%s)\nSIG=$(printf %s "$T.$BODY" | openssl dgst -sha256 -hmac "$SECRET" | sed \'s/^.* //\')\n'
    else:
        t = int(datetime.now(UTC).timestamp())
        digest = hmac.new(env["SECRET"].encode(), f"{t}.{env['BODY']}".encode(), hashlib.sha256).hexdigest()
        sign = f"T={t}\nSIG={digest}\n"
    curl = ('curl -sS -w "\\n%{http_code}" -X POST "$URL" -H "X-Outpost-Signature: t=$T,v1=$SIG" '
            "-H 'Content-Type: application/json' -d \"$BODY\"\n")
    out = subprocess.run(["bash", "-c", sign + curl + "echo\n" + curl], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip().split("\n")
    first, first_code, replay, replay_code = out
    assert first_code == "202", out
    assert json.loads(first)["status"] == "task_created"
    assert replay_code == "401" and "replay" in json.loads(replay)["detail"]
    with server.client() as client:
        detail = client.get(f"/api/office/routines/{created['id']}").json()
        x = only(detail["runs"])
        assert (x["id"], x["source"], x["trigger_payload"]) == (
            json.loads(first)["routine_run_id"], "webhook", {"branch": "release/2.0"})
        assert client.get(f"/api/office/tasks/{x['linked_task_id']}").json()["title"] == "Release release/2.0"
        refusal = only(detail["triggers"][0]["refused_deliveries"])
        assert (refusal["reason"], refusal["source_address"], refusal["size"]) == (
            "replayed signature", "127.0.0.1", len(env["BODY"]))
    assert server.stop() == 0


def test_only_the_newest_refused_deliveries_are_kept_and_accepted_ones_stay(server_factory):
    """A flood of unauthenticated posts costs a bounded number of rows: each trigger keeps its
    newest REFUSED_DELIVERIES_KEPT refusals. Accepted deliveries (routine runs) are not touched."""
    kept = outpost.REFUSED_DELIVERIES_KEPT
    server = server_factory()
    with server.client() as client:
        worker = client.post("/api/office/agents", json={"name": "Release Worker", "executor": "demo"}).json()
        created = client.post("/api/office/routines", json={
            "name": "Release", "assignee_agent_id": worker["id"], "task_template": {"title": "Release"},
            "concurrency_policy": "always_enqueue", "triggers": [{"kind": "webhook", "signing_mode": "bearer"}]}).json()
    trigger = only(created["triggers"])
    fire_url = server.url + trigger["fire_path"]
    with httpx.Client(timeout=30) as hooks:
        for _ in range(3):
            accepted = hooks.post(fire_url, json={}, headers={"Authorization": f"Bearer {trigger['secret']}"})
            assert accepted.status_code == 202, accepted.text
        for i in range(kept + 50):   # bodies of distinct sizes: the refusals are told apart by size
            body = json.dumps({"n": "x" * i}).encode()
            refused = hooks.post(fire_url, content=body, headers={"Authorization": "Bearer guess",
                                                                  "Content-Type": "application/json"})
            assert refused.status_code == 401
    db = sqlite3.connect(f"file:{server.data_dir / 'outpost.sqlite3'}?mode=ro", uri=True, timeout=5)
    sizes = [size for (size,) in db.execute(
        'SELECT size FROM "WebhookRefusal" WHERE trigger_id = ? ORDER BY id', (trigger["id"],))]
    db.close()
    assert sizes == [len(json.dumps({"n": "x" * i})) for i in range(50, kept + 50)]
    with server.client() as client:
        detail = client.get(f"/api/office/routines/{created['id']}").json()
    assert len(detail["runs"]) == 3
    assert detail["triggers"][0]["refused_deliveries"][0]["size"] == len(json.dumps({"n": "x" * (kept + 49)}))


def test_a_signature_timestamp_of_non_ascii_digits_is_401_on_a_real_server(server_factory):
    """``t=²`` (a digit to str.isdigit, not to int) and its kin: a malformed signature, 401 and
    recorded, never a 500."""
    server = server_factory()
    with server.client() as client:
        worker = client.post("/api/office/agents", json={"name": "Release Worker", "executor": "demo"}).json()
        created = client.post("/api/office/routines", json={
            "name": "Release", "assignee_agent_id": worker["id"], "task_template": {"title": "Release"},
            "triggers": [{"kind": "webhook", "signing_mode": "hmac_sha256"}]}).json()
    fire_url = server.url + only(created["triggers"])["fire_path"]
    stamps = ["²".encode("latin-1"), "¹²³".encode("latin-1"), f"{int(time.time())}²".encode("latin-1")]
    with httpx.Client(timeout=30) as hooks:
        for stamp in stamps:
            reply = hooks.post(fire_url, content=b"{}", headers={
                "Content-Type": "application/json", "X-Outpost-Signature": b"t=" + stamp + b",v1=" + b"0" * 64})
            assert reply.status_code == 401, (stamp, reply.status_code, reply.text)
            assert reply.headers["content-type"] == PROBLEM and reply.json()["code"] == "unauthorized"
    with server.client() as client:
        detail = client.get(f"/api/office/routines/{created['id']}").json()
    assert detail["runs"] == []
    assert [f["reason"] for f in detail["triggers"][0]["refused_deliveries"]] == [
        "missing X-Outpost-Signature (t=<unix seconds>,v1=<hex>)"] * len(stamps)
    assert "Traceback" not in server.logs()


###############################################################################
# Catch-up policy: "the scheduler was down for 3 hours".
###############################################################################

def test_catch_up_plan_fires_the_newest_cap_or_only_the_current_tick():
    slots = [at(i * 5 * MINUTE) for i in range(1, 37)]
    assert outpost.catch_up_plan("skip_missed", 25, slots, 36) == ([slots[-1]], 0)
    assert outpost.catch_up_plan("enqueue_missed_with_cap", 25, slots, 36) == (slots[-25:], 11)
    assert outpost.catch_up_plan("enqueue_missed_with_cap", 3, slots, 36) == (slots[-3:], 33)
    assert outpost.catch_up_plan("enqueue_missed_with_cap", 25, slots[:1], 1) == (slots[:1], 0)


async def down_for_3_hours(deps: outpost.Deps) -> None:
    """The scheduler stopped at T0 (08:00) and starts again at 11:02: the cron actor wakes
    with that wall clock, then runs a minute."""
    restarted = dataclasses.replace(deps, clock=outpost.TrioClock(at(3 * HOUR + 2 * MINUTE)))
    await run_actors(restarted, at(3 * HOUR + 3 * MINUTE))


async def test_scheduler_down_3_hours_skip_missed_fires_current_tick_only(autojump_clock, mock_deps, tmp_path):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(tmp_path / "repo"))
    worker = new_agent(store, "Worker", cooldown_sec=0)
    r = new_routine(store, worker, name="Sync", catch_up_policy="skip_missed", concurrency_policy="always_enqueue",
                    task_template={"title": "Sync {{datetime}}"}, triggers=[SCHEDULE_5MIN])
    await down_for_3_hours(deps)
    x = only(routine_runs(store, r["id"]))
    assert (x["due_at"], x["missed_ticks"], x["status"]) == ("2026-11-30T11:00:00Z", 0, "task_created")
    assert only(tasks(store, worker))["title"] == "Sync 2026-11-30T11:00:00+00:00"
    assert only(routine(store, r["id"])["triggers"])["next_run_at"] == "2026-11-30T11:05:00Z"
    # Then it keeps its cadence.
    await run_actors(deps, at(3 * HOUR + 6 * MINUTE))
    assert [x["due_at"] for x in routine_runs(store, r["id"])] == ["2026-11-30T11:00:00Z", "2026-11-30T11:05:00Z"]


async def test_scheduler_down_3_hours_enqueue_missed_with_cap_fires_25_and_summarizes_missed(
        autojump_clock, mock_deps, tmp_path):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(tmp_path / "repo"))
    worker = new_agent(store, "Worker", cooldown_sec=0)
    heavy = new_routine(store, worker, name="Sync", concurrency_policy="always_enqueue",
                        task_template={"title": "Sync {{datetime}}", "description": "Sync the mirrors."},
                        triggers=[SCHEDULE_5MIN])
    assert (heavy["catch_up_policy"], heavy["catch_up_max"]) == ("enqueue_missed_with_cap", 25)
    lead = new_agent(store, "Lead", role="coordinator", cooldown_sec=0)
    await outpost.install_heartbeat(deps, lead)
    (heartbeat,) = [x for x in call(store, store.routines.list_routines, None) if x["name"] == "Coordinator heartbeat"]
    await down_for_3_hours(deps)
    # 36 ticks were due (08:05 ... 11:00): the newest 25 fire, the 11 older ones are summarized.
    runs = routine_runs(store, heavy["id"])
    assert [x["due_at"] for x in runs] == [outpost.rfc3339(at(HOUR + i * 5 * MINUTE)) for i in range(25)]
    assert [x["missed_ticks"] for x in runs] == [11] + [0] * 24
    assert {x["status"] for x in runs} == {"task_created"} and len(tasks(store, worker)) == 25
    first = task(store, runs[0]["linked_task_id"])
    assert first["title"] == "Sync 2026-11-30T09:00:00+00:00"
    assert "missed 11 ticks since 2026-11-30 08:05 UTC" in first["description"]
    assert "missed" not in task(store, runs[1]["linked_task_id"])["description"]
    # The heartbeat (lightweight, coalesce_if_active) records its 25 ticks, one wakeup; the
    # coordinator's next prompt says what it missed.
    beats = routine_runs(store, heartbeat["id"])
    assert Counter(x["status"] for x in beats) == {"task_created": 1, "coalesced": 24}
    w = only(wakeups(store, lead))
    assert w["payload"]["missed_ticks"] == 11
    (run_id,) = [r for r in dispatch(store, deps.clock.now()) if office_run(store, r)["agent_id"] == lead]
    assert "missed 11 ticks since 2026-11-30 08:05 UTC" in office_run(store, run_id)["assembled_prompt"]


def test_a_catch_up_past_the_counting_cap_says_more_than_n_ticks(office):
    """Issue 24.6c: after 2855 missed ticks of a per-minute routine the prompt said "missed 1975
    ticks": the count stops at a cap, silently. Past the cap it says "more than"."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    r = new_routine(office, lead, name="Pulse", triggers=[
        {"kind": "schedule", "cron_expression": "* * * * *", "timezone": "UTC"}])
    call(office, office.routines.claim_due_routines, at(2855 * MINUTE))   # 08:01 ... two days later: 2855 ticks
    first = routine_runs(office, r["id"])[0]
    counted = first["missed_ticks"]
    assert 0 < counted < 2855 - 25
    w = wakeup(office, first["wakeup_id"])
    note = f"missed more than {counted:,} ticks since 2026-11-30 08:01 UTC"
    assert note in w["reason"]
    (run_id,) = dispatch(office, at(2855 * MINUTE))
    assert note in office_run(office, run_id)["assembled_prompt"]


###############################################################################
# The pre-installed coordinator routine.
###############################################################################

HEARTBEAT = {
    "name": "Coordinator heartbeat",
    "description": "Wakes the coordinator every 5 minutes to check workspace activity, react to errors and budget "
                   "signals, and decide what to do next.",
    "status": "active", "concurrency_policy": "coalesce_if_active", "catch_up_policy": "enqueue_missed_with_cap",
    "catch_up_max": 25, "task_template": {}, "variables": []}


async def test_coordinator_heartbeat_installed_at_creation(api):
    assert (await api.patch("/api/office/settings", {"timezone": "Europe/Berlin"})).status == 200
    await api.agent("Worker")                                   # only coordinators get one
    assert (await api.get("/api/office/routines")).body["routines"] == []
    lead = await api.agent("Lead", role="coordinator")
    (hb,) = (await api.get("/api/office/routines")).body["routines"]
    assert {k: hb[k] for k in HEARTBEAT} == HEARTBEAT
    assert hb["assignee_agent_id"] == lead["id"]
    trigger = only(hb["triggers"])
    assert {k: trigger[k] for k in ("kind", "cron_expression", "timezone", "enabled", "next_run_at")} == {
        "kind": "schedule", "cron_expression": "*/5 * * * *", "timezone": "Europe/Berlin", "enabled": True,
        "next_run_at": "2026-11-30T08:05:00Z"}
    # A regular routine: same fields as one a user makes (no system flag, no lock).
    mine = await api.routine(name="Mine", assignee_agent_id=lead["id"])
    assert set(hb) == set(mine) - {"triggers"} | {"triggers"}
    # A workspace without its own timezone falls back to UTC.
    other = await api.post("/api/office/workspaces", {"name": "Other"})
    await api.agent("Other lead", role="coordinator", workspace_id=other.body["id"])
    (hb2,) = (await api.get(f"/api/office/routines?workspace_id={other.body['id']}")).body["routines"]
    assert only(hb2["triggers"])["timezone"] == "UTC"
    _, page = await api.page("/office/routines")
    assert "Coordinator heartbeat" in page and "every 5 minutes" in page
    # The user can edit, pause and delete it.
    edited = await api.patch(f"/api/office/routines/{hb['id']}", {"name": "Lead pulse", "status": "paused"})
    assert edited.status == 200 and (edited.body["name"], edited.body["status"]) == ("Lead pulse", "paused")
    assert (await api.delete(f"/api/office/routines/{hb['id']}")).status == 204
    assert [x["id"] for x in (await api.get("/api/office/routines")).body["routines"]] == [mine["id"]]


def real_time(clock: trio.testing.MockClock, on: bool) -> None:
    """While an agent process runs, mock time follows real time (no jumps past its timeout)."""
    clock.autojump_threshold = math.inf if on else 0
    clock.rate = 1.0 if on else 0.0


async def test_coordinator_heartbeat_tick_wakes_coordinator_with_continuation_summary(
        autojump_clock, mock_deps, git_repo):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(git_repo))
    lead = new_agent(store, "Lead", role="coordinator", cooldown_sec=0)
    await outpost.install_heartbeat(deps, lead)
    (hb,) = call(store, store.routines.list_routines, None)
    trigger_id = only(hb["triggers"])["id"]

    async def one_session(n: int) -> dict:
        """Jump to the next tick; let the agent's session run in real time; its wakeup."""
        await until(lambda: len(wakeups(store, lead, status="claimed")) == 1, poll_s=1.0)
        real_time(autojump_clock, True)
        await until(lambda: len(wakeups(store, lead, status="finished")) == n)
        real_time(autojump_clock, False)
        return wakeups(store, lead, status="finished")[-1]

    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            nursery.start_soon(outpost.claim_actor, deps)
            await trio.sleep(5 * MINUTE - 1)
            assert wakeups(store, lead) == []
            first = await one_session(1)
            second = await one_session(2)
            nursery.cancel_scope.cancel()
    # The 08:05 boundary queued a routine-source wakeup with the cron dedup key.
    assert (first["source"], first["requested_at"], first["payload"]["routine_id"]) == (
        "routine", "2026-11-30T08:05:00Z", hb["id"])
    assert first["idempotency_key"] == f"routine:{hb['id']}:{trigger_id}:{unix(at(5 * MINUTE)) // 60}"
    run1 = office_run(store, first["run_id"])
    assert (run1["status"], run1["task_id"], run1["summary_injected"]) == ("succeeded", None, "")
    assert "## Routine: Coordinator heartbeat" in run1["assembled_prompt"]
    # On completion the summary was upserted under routine:<id>; the 08:10 fire read it.
    assert second["requested_at"] == "2026-11-30T08:10:00Z"
    run2 = office_run(store, second["run_id"])
    assert run2["status"] == "succeeded"
    summary = only([s for s in call(store, store.office.summary_of, lead) if s["scope"] == f"routine:{hb['id']}"])
    assert summary["updated_by_run_id"] == run2["id"]
    assert run2["summary_injected"] and "## Active focus" in run2["summary_injected"]
    assert "## Continuation summary\n" + run2["summary_injected"] in run2["assembled_prompt"]
    assert [x["status"] for x in routine_runs(store, hb["id"])] == ["task_created", "task_created"]


async def test_deleted_heartbeat_never_wakes_coordinator(autojump_clock, mock_deps, tmp_path):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(tmp_path / "repo"))
    lead = new_agent(store, "Lead", role="coordinator", cooldown_sec=0)
    await outpost.install_heartbeat(deps, lead)
    (hb,) = call(store, store.routines.list_routines, None)
    assert call(store, store.routines.scheduled_wakeups, lead) == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.cron_actor, deps)
        await trio.sleep(3 * MINUTE)
        call(store, store.routines.delete_routine, hb["id"], deps.clock.now())     # the user deletes it at 08:03
        deps.cron_wake.poke()
        await trio.sleep(HOUR)                                          # twelve 5-minute boundaries
        nursery.cancel_scope.cancel()
    assert wakeups(store, lead) == []
    assert call(store, store.routines.list_routines, None) == [] and call(store,
                                                                          store.routines.next_routine_due_at) is None
    assert call(store, store.routines.scheduled_wakeups, lead) == 0
    # Reactive sources still wake it.
    call(store, store.office.wake_agent, lead, outpost.WakeupSource.USER, {"user_id": "dashboard"}, deps.clock.now())
    assert [w["source"] for w in wakeups(store, lead)] == ["user"]


def test_deleted_heartbeat_pending_wakeup_does_not_wake_coordinator(office):
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    hb = call(office, office.routines.install_heartbeat, lead, T0)
    new_task(office, "Plan the quarter", T0, assignee_agent_id=lead)
    (busy,) = dispatch(office, T0)                          # the coordinator is in a session...
    call(office, office.routines.claim_due_routines, at(5 * MINUTE))    # ...when the 08:05 tick comes: it waits
    assert [w["source"] for w in wakeups(office, lead, status="queued")] == ["routine"]
    call(office, office.routines.delete_routine, hb["id"], at(6 * MINUTE))
    settle(office, busy, "succeeded", at(7 * MINUTE))
    assert dispatch(office, at(8 * MINUTE)) == [], "the deleted heartbeat still woke the coordinator"
    assert wakeups(office, lead, source="routine", status="queued") == []


async def test_coordinator_page_shows_no_scheduled_wakeups_banner_after_heartbeat_deleted(api):
    lead = await api.agent("Lead", role="coordinator")
    _, page = await api.page(f"/office/agents/{lead['id']}")
    assert "This coordinator has no scheduled wake-ups" not in page
    (hb,) = (await api.get("/api/office/routines")).body["routines"]
    assert (await api.delete(f"/api/office/routines/{hb['id']}")).status == 204
    _, page = await api.page(f"/office/agents/{lead['id']}")
    assert "This coordinator has no scheduled wake-ups" in page


async def test_coordinator_is_created_with_the_banner_when_its_heartbeat_cannot_be_installed(api, monkeypatch):
    def broken(self, agent_id, now):
        raise RuntimeError("disk trouble")
    monkeypatch.setattr(outpost.RoutineStore, "install_heartbeat", broken)
    lead = await api.agent("Lead", role="coordinator")
    assert (await api.get(f"/api/office/agents/{lead['id']}")).status == 200
    assert (await api.get("/api/office/routines")).body["routines"] == []
    _, page = await api.page(f"/office/agents/{lead['id']}")
    assert "This coordinator has no scheduled wake-ups" in page


async def test_a_deleted_webhook_trigger_answers_404_and_fires_nothing(api):
    worker = await api.agent("Worker")
    r = await api.routine(name="Hook", assignee_agent_id=worker["id"],
                          triggers=[{"kind": "webhook", "signing_mode": "none"}])
    (trigger,) = r["triggers"]
    assert (await api.delete(f"/api/office/routines/{r['id']}/triggers/{trigger['id']}")).status == 204
    reply = await api.deliver(trigger["public_id"], b"{}", {})
    assert reply.status == 404
    detail = await api.detail(r["id"])
    assert detail["triggers"] == [] and detail["runs"] == []


async def test_the_wakeups_page_labels_cancelled_idle_skipped_and_recovered_wakeups(api):
    profiles = {"demo": outpost.demo_profile()}
    a, b = await api.agent("A", cooldown_sec=0), await api.agent("B", cooldown_sec=0)
    moved = (await api.post("/api/office/tasks", {"title": "moved", "assignee_agent_id": a["id"]})).body
    assert (await api.patch(f"/api/office/tasks/{moved['id']}", {"assignee_agent_id": b["id"]})).status == 200
    (run_id,), _ = call(api.store, api.store.pipeline.dispatch_wakeups, api.clock.now(), profiles)   # A's: stale
    assert (await api.post(f"/v1/outpost/runs/{run_id}/control", {"action": "cancel"}, key="c1")).status == 200
    assert call(api.store, api.store.routines.recovery_sweep, api.clock.now()) == 1   # B's run was cancelled
    call(api.store, api.store.pipeline.dispatch_wakeups, api.clock.now(), profiles)
    idle = await api.routine(name="Poll", assignee_agent_id=a["id"])   # A has no task: idle-skipped
    assert (await api.post(f"/api/office/routines/{idle['id']}/fire", {"variables": {}})).status == 202
    call(api.store, api.store.pipeline.dispatch_wakeups, api.clock.now(), profiles)
    _, page = await api.page("/office/wakeups")
    for label in ("Cancelled - assignee changed", "Finished, no run", "Recovered"):
        assert label in page, label


async def test_two_routines_same_coordinator_within_window_coalesce(autojump_clock, mock_deps, tmp_path):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(tmp_path / "repo"))
    lead = new_agent(store, "Lead", role="coordinator", cooldown_sec=0)
    await outpost.install_heartbeat(deps, lead)
    budget = new_routine(store, lead, name="Budget check", triggers=[SCHEDULE_5MIN])
    await run_actors(deps, at(5 * MINUTE + 30))
    routines = call(store, store.routines.list_routines, None)
    assert [only(routine_runs(store, r["id"]))["status"] for r in routines] == ["task_created", "task_created"]
    w = wakeups(store, lead)
    (kept,) = [x for x in w if x["status"] == "queued"]
    (merged,) = [x for x in w if x["status"] == "coalesced"]
    assert (kept["coalesced_count"], merged["coalesced_into"]) == (2, kept["id"])
    (run_id,) = dispatch(store, deps.clock.now())
    snapshot = office_run(store, run_id)["context_snapshot"]
    assert sorted(x["payload"]["routine_id"] for x in snapshot["wakeups"]) == sorted(r["id"] for r in routines)
    assert wakeup(store, merged["id"])["run_id"] == run_id
    assert budget["id"] in {r["id"] for r in routines}


###############################################################################
# Idle wakeup skip.
###############################################################################

def test_lightweight_routine_idle_skip_for_worker(office):
    worker = new_agent(office, "Worker", cooldown_sec=0)
    assert call(office, office.office.get_agent, worker)["skip_idle_wakeups"] is True
    r = new_routine(office, worker, name="Poll upstream", triggers=[SCHEDULE_5MIN])
    assert call(office, office.routines.claim_due_routines, at(5 * MINUTE)) == 1
    x = only(routine_runs(office, r["id"]))
    assert dispatch(office, at(5 * MINUTE)) == []                   # no session launched
    w = wakeup(office, x["wakeup_id"])
    assert (w["status"], w["run_id"]) == ("finished", None) and "idle" in w["note"]
    entry = only(activity(office, "wakeup_idle_skipped"))
    assert (entry["agent_id"], entry["wakeup_id"]) == (worker, w["id"])
    assert entry["data"] == {"reason": "no_actionable_tasks"}
    # A task_assigned wakeup for the same agent skips the check and proceeds.
    tid = new_task(office, "Fix the flaky test", at(6 * MINUTE), assignee_agent_id=worker)
    (run_id,) = dispatch(office, at(6 * MINUTE))
    assert office_run(office, run_id)["task_id"] == tid
    settle(office, run_id, "succeeded", at(7 * MINUTE))
    # With that TODO task still open, the next tick is not idle: it runs.
    call(office, office.routines.claim_due_routines, at(10 * MINUTE))
    (run_id,) = dispatch(office, at(10 * MINUTE))
    assert office_run(office, run_id)["task_id"] is None
    assert len(activity(office, "wakeup_idle_skipped")) == 1


def test_coordinator_routine_wakeup_proceeds_without_assigned_tasks(office):
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    assert call(office, office.office.get_agent, lead)["skip_idle_wakeups"] is False
    call(office, office.routines.install_heartbeat, lead, T0)
    call(office, office.routines.claim_due_routines, at(5 * MINUTE))
    (run_id,) = dispatch(office, at(5 * MINUTE))
    assert office_run(office, run_id)["task_id"] is None
    assert activity(office, "wakeup_idle_skipped") == []


###############################################################################
# Recovery sweep (unstarted Office tasks).
###############################################################################

def unwoken_task(store: outpost.Store, title: str, now: datetime, agent_id: str) -> str:
    """A TODO task assigned with no wakeup for it (assigned behind the API, or its wakeup lost
    to an older version): what the recovery sweep is for."""
    tid = new_task(store, title, now)

    def assign_behind_the_api():
        store.db.Task[tid].assignee_agent_id = agent_id
    store.transaction(assign_behind_the_api)
    return tid


def test_recovery_sweep_dispatches_unstarted_office_task_and_skips_the_rest(office):
    ada = new_agent(office, "Ada", status="paused", cooldown_sec=0)
    bob = new_agent(office, "Bob", status="paused", cooldown_sec=0)
    old = unwoken_task(office, "created 29 h before the sweep", at(HOUR), ada)
    unstarted = unwoken_task(office, "assigned, never started", at(7 * HOUR), ada)
    new_task(office, "a kanban card", at(7 * HOUR), assignee_agent_id=ada, workflow="kanban")
    new_task(office, "nobody's", at(7 * HOUR))
    bobs = unwoken_task(office, "its agent is paused", at(7 * HOUR), bob)
    assert dispatch(office, at(7 * HOUR)) == [] and wakeups(office) == []
    edit_agent(office, ada, at(8 * HOUR), status="idle")
    started = new_task(office, "ran once, long ago", at(8 * HOUR), assignee_agent_id=ada)
    (run_id,) = dispatch(office, at(8 * HOUR))
    settle(office, run_id, "succeeded", at(9 * HOUR))
    assert task(office, started)["state"] == "TODO"
    waiting = new_task(office, "its wakeup is still queued", at(9 * HOUR), assignee_agent_id=ada)
    sweep = at(30 * HOUR)                                   # lookback 24 h: tasks created since T0 + 6 h
    assert call(office, office.routines.recovery_sweep, sweep) == 1
    recovered = only([w for w in wakeups(office, ada) if w["reason"] == "recovery"])
    assert (recovered["source"], recovered["task_id"], recovered["status"]) == ("task_assigned", unstarted, "queued")
    assert [w["task_id"] for w in wakeups(office, ada, status="queued")] == [waiting, unstarted]
    entry = only(activity(office, "recovery_dispatch"))
    assert (entry["agent_id"], entry["task_id"]) == (ada, unstarted)
    assert only(activity(office, "recovery_sweep_complete"))["data"] == {"dispatched_count": 1}
    # The paused agent's task once it is back; nothing twice (its recovery wakeup is queued).
    edit_agent(office, bob, sweep, status="idle")
    assert call(office, office.routines.recovery_sweep, sweep + timedelta(minutes=5)) == 1
    assert only([w for w in wakeups(office, bob) if w["reason"] == "recovery"])["task_id"] == bobs
    # A longer lookback reaches the older task.
    set_settings(office, recovery_lookback_hours=48)
    assert call(office, office.routines.recovery_sweep, sweep + timedelta(minutes=10)) == 1
    assert [x["task_id"] for x in activity(office, "recovery_dispatch")] == [unstarted, bobs, old]
    assert [x["data"]["dispatched_count"] for x in activity(office, "recovery_sweep_complete")] == [1, 1, 1]


def test_kanban_only_workspace_recovery_queues_no_task_assigned_run(store):
    board = call(store, store.office.create_workspace, "Board", at(0))["id"]
    ada = new_agent(store, "Ada", workspace_id=board, cooldown_sec=0)
    card = new_task(store, "a card with a runner", at(0), workspace_id=board, assignee_agent_id=ada, workflow="kanban")
    assert wakeups(store, workspace_id=board) == []
    assert call(store, store.routines.recovery_sweep, at(MINUTE)) == 0
    assert wakeups(store, workspace_id=board) == [] and task(store, card)["state"] == "TODO"
    assert [x["data"] for x in activity(store, "recovery_sweep_complete", board)] == [{"dispatched_count": 0}]


def test_recovery_sweep_failed_and_cancelled_runs_do_not_block(office):
    ada = new_agent(office, "Ada", cooldown_sec=0)
    cancelled = new_task(office, "its run was cancelled", at(0), assignee_agent_id=ada)
    (run_id,) = dispatch(office, at(0))
    settle(office, run_id, "cancelled", at(MINUTE))
    failed = new_task(office, "its runs failed", at(2 * MINUTE), assignee_agent_id=ada)
    wid = only([w for w in wakeups(office, ada) if w["task_id"] == failed])["id"]
    now = at(2 * MINUTE)
    for _ in range(10):                                     # 2 m, 10 m, 30 m, 2 h, then escalated
        (run_id,) = dispatch(office, now)
        settle(office, run_id, "failed", now, error="network timeout", exit_code=1)
        w = wakeup(office, wid)
        if w["status"] == "failed":
            break
        now = instant(w["scheduled_retry_at"]) + timedelta(milliseconds=1)
    assert wakeup(office, wid)["status"] == "failed"
    assert {task(office, t)["state"] for t in (cancelled, failed)} == {"TODO"}
    assert call(office, office.routines.recovery_sweep, now + timedelta(minutes=1)) == 2
    assert sorted(x["task_id"] for x in activity(office, "recovery_dispatch")) == sorted([cancelled, failed])


def test_recovery_sweep_skipped_entirely_when_no_workspace_has_agents(store):
    new_task(store, "a todo", at(0))
    assert call(store, store.routines.recovery_sweep, at(MINUTE)) == 0
    assert activity(store, "recovery_sweep_complete") == []
    # Once a workspace has an agent, only that workspace is swept.
    busy = call(store, store.office.create_workspace, "Busy", at(0))["id"]
    new_agent(store, "Ada", workspace_id=busy, cooldown_sec=0)
    assert call(store, store.routines.recovery_sweep, at(2 * MINUTE)) == 0
    assert activity(store, "recovery_sweep_complete") == []
    assert [x["data"] for x in activity(store, "recovery_sweep_complete", busy)] == [{"dispatched_count": 0}]


async def test_recovery_lookback_hours_clamped_1_to_720(api):
    assert (await api.get("/api/office/settings")).body["recovery_lookback_hours"] == 24
    for sent, kept in ((0, 1), (-5, 1), (721, 720), (10**12, 720), (48, 48), (1, 1), (720, 720)):
        reply = await api.patch("/api/office/settings", {"recovery_lookback_hours": sent})
        assert reply.status == 200, reply.body
        assert reply.body["recovery_lookback_hours"] == kept
    for bad in ("a day", True, None):
        reply = await api.patch("/api/office/settings", {"recovery_lookback_hours": bad})
        assert reply.status == 422 and reply.body["errors"][0]["field"] == "recovery_lookback_hours"
    assert (await api.get("/api/office/settings")).body["recovery_lookback_hours"] == 720


async def test_recovery_actor_sweeps_at_start_and_every_5_minutes(autojump_clock, mock_deps, tmp_path):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(tmp_path / "repo"))
    ada = new_agent(store, "Ada", status="paused", cooldown_sec=0)
    bob = new_agent(store, "Bob", status="paused", cooldown_sec=0)
    first = unwoken_task(store, "first", T0, ada)
    second = unwoken_task(store, "second", T0, bob)
    assert dispatch(store, T0) == []
    edit_agent(store, ada, T0, status="idle")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.recovery_actor, deps)
        await trio.sleep(1)
        assert [x["task_id"] for x in activity(store, "recovery_dispatch")] == [first]
        await trio.sleep(2 * MINUTE)
        edit_agent(store, bob, deps.clock.now(), status="idle")
        await trio.sleep(3 * MINUTE)                        # 08:05:01: the second sweep has run
        nursery.cancel_scope.cancel()
    assert [x["task_id"] for x in activity(store, "recovery_dispatch")] == [first, second]
    sweeps = activity(store, "recovery_sweep_complete")
    assert [(x["created_at"], x["data"]["dispatched_count"]) for x in sweeps] == [
        ("2026-11-30T08:00:00Z", 1), ("2026-11-30T08:05:00Z", 1)]


###############################################################################
# One cron actor and one timing engine for /v1/outpost schedules and Office routines.
###############################################################################

async def test_one_cron_actor_serves_schedules_and_routines(autojump_clock, mock_deps, git_repo):
    deps, store = mock_deps, mock_deps.store
    set_settings(store, repository=str(git_repo))
    sched = call(store, store.schedules.create_schedule, normalized(git_repo), T0)
    worker = new_agent(store, "Worker", cooldown_sec=0)
    r = new_routine(store, worker, name="Scan", concurrency_policy="always_enqueue",
                    task_template={"title": "Scan {{datetime}}"}, triggers=[SCHEDULE_5MIN])
    assert r["triggers"][0]["next_run_at"] == sched["next_fire_at"] == "2026-11-30T08:05:00Z"
    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            # (each schedule run's commit is resolved with git, in real time: poll, do not jump)
            await until(lambda: len(call(store, store.schedules.occurrences, sched["id"])) == 2
                        and len(routine_runs(store, r["id"])) == 2, poll_s=1.0)
            nursery.cancel_scope.cancel()
    ticks = ["2026-11-30T08:05:00Z", "2026-11-30T08:10:00Z"]
    assert sorted(o["due_at"] for o in call(store, store.schedules.occurrences, sched["id"])) == ticks
    assert all(o["run_id"] for o in call(store, store.schedules.occurrences, sched["id"]))
    runs = routine_runs(store, r["id"])
    assert [x["due_at"] for x in runs] == ticks
    for x in runs:                                          # at its instant, not on a polling tick
        assert abs(instant(x["started_at"]) - instant(x["due_at"])) < timedelta(seconds=1)
    assert (call(store, store.schedules.get_schedule, sched["id"])["next_fire_at"]
            == only(routine(store, r["id"])["triggers"])["next_run_at"] == "2026-11-30T08:15:00Z")


def test_routine_triggers_and_schedules_share_the_timing_engine_across_dst(office, git_repo):
    """Berlin springs forward on 28 March 2027: 02:30 does not exist that night."""
    made = datetime(2027, 3, 27, 12, 0, tzinfo=UTC)
    timing = {"kind": "cron", "expression": "30 2 * * *", "timezone": "Europe/Berlin"}
    sched = call(office, office.schedules.create_schedule, normalized(git_repo, now=made, timing=timing), made)
    worker = new_agent(office, "Worker", cooldown_sec=0)
    r = new_routine(office, worker, name="Night", concurrency_policy="always_enqueue", now=made,
                    task_template={"title": "Night"},
                    triggers=[{"kind": "schedule", "cron_expression": "30 2 * * *", "timezone": "Europe/Berlin"}])
    assert r["triggers"][0]["next_run_at"] == sched["next_fire_at"]
    later = made + timedelta(days=3)
    call(office, office.schedules.claim_due, later)
    call(office, office.routines.claim_due_routines, later)
    occurrences = sorted(o["due_at"] for o in call(office, office.schedules.occurrences, sched["id"]))
    # 02:30 CET does not exist on the 28th: it fires at the first instant after the gap, 03:00 CEST.
    assert occurrences == ["2027-03-28T01:00:00Z", "2027-03-29T00:30:00Z", "2027-03-30T00:30:00Z"]
    assert [x["due_at"] for x in routine_runs(office, r["id"])] == occurrences

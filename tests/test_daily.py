"""Daily use (docs/http-api.md, "Daily use"): the runs list's filters and search, the upcoming
fires, attention that folds and can be muted, bulk actions, notification entries from the
dashboard. In process, through Quart's test client, at a FixedClock; the pages through a
signed-in test client."""

from __future__ import annotations

import re
import urllib.parse
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import T0, Api, assert_problem, call, make_deps, sign_in_client

import outpost


@pytest.fixture
async def api(tmp_path: Path, git_repo: Path):
    deps = make_deps(tmp_path)
    yield Api(deps, git_repo)
    deps.store.close()


async def post_form(client, path: str, pairs: list[tuple[str, str]]):
    """A form post with repeated fields (ticked boxes), as a browser sends it."""
    return await client.post(path, data=urllib.parse.urlencode(pairs),
                             headers={"Content-Type": "application/x-www-form-urlencoded"})


def ids(reply) -> list[str]:
    assert reply.status == 200, reply.body
    return [r["id"] for r in reply.body["runs"]]


async def fired_and_settled(api: Api, sched: dict, status=outpost.RunStatus.SUCCEEDED, **kw) -> str:
    api.clock.at += timedelta(minutes=1)   # one manual fire per instant
    run_id = (await api.fire(sched["id"]))["run_id"]
    await api.settle(run_id, status, **kw)
    return run_id


# --- the runs list: filters and search ------------------------------------------------------------------

async def test_runs_filter_by_agent_trigger_dates_and_text_combined_and_paged(api):
    nightly = await api.schedule(name="Nightly Docs")
    other = await api.schedule(name="weekly deps")
    first = await fired_and_settled(api, nightly, outpost.RunStatus.FAILED, error="git push: Connection TIMEOUT")
    second = await fired_and_settled(api, other, result={"summary": "done"})
    api.clock.at += timedelta(days=2)
    third = await fired_and_settled(api, nightly)
    dispatched = (await api.post("/v1/outpost/dispatches", {"brief": "@print x", "repository": str(api.repo)})).body

    assert ids(await api.get("/v1/outpost/runs?trigger=manual")) == [third, second, first]
    assert ids(await api.get("/v1/outpost/runs?trigger=dispatch")) == [dispatched["run_id"]]
    assert ids(await api.get("/v1/outpost/runs?agent=demo&trigger=manual&status=succeeded")) == [third, second]
    # text: the error, any case; the schedule's name; the result branch
    assert ids(await api.get("/v1/outpost/runs?q=timeout")) == [first]
    assert ids(await api.get("/v1/outpost/runs?q=nightly%20docs")) == [third, first]
    branch = (await api.get(f"/v1/outpost/runs/{second}")).body["result_branch"]
    assert ids(await api.get(f"/v1/outpost/runs?q={branch.upper()}")) == [second]
    # LIKE's wildcards are text here
    assert ids(await api.get("/v1/outpost/runs?q=%25")) == [] and ids(await api.get("/v1/outpost/runs?q=t_m")) == []
    # queued_at: since inclusive, until exclusive; a date reads as a whole day (UTC by default)
    cut = outpost.rfc3339(T0 + timedelta(days=1))
    assert ids(await api.get(f"/v1/outpost/runs?since={cut}")) == [dispatched["run_id"], third]
    assert ids(await api.get(f"/v1/outpost/runs?until={cut}&trigger=manual")) == [second, first]
    assert ids(await api.get(f"/v1/outpost/runs?until={T0.date().isoformat()}")) == [second, first]
    # combined with paging: the page and its next honour every filter
    page = (await api.get("/v1/outpost/runs?trigger=manual&limit=2")).body
    assert [r["id"] for r in page["runs"]] == [third, second] and page["next"] == second
    rest = await api.get(f"/v1/outpost/runs?trigger=manual&limit=2&before={page['next']}")
    assert ids(rest) == [first] and rest.body["next"] is None


@pytest.mark.parametrize("query, field", [
    ("agent=nobody", "agent"), ("trigger=cronjob", "trigger"), ("status=done", "status"),
    ("since=yesterday", "since"), ("until=2026-13-40", "until"), ("since=2026-12-01T08:00:00", "since"),
    ("since=9999-12-31T23:59:59-23:59", "since")])
async def test_a_bad_filter_is_422_naming_it(api, query, field):
    assert_problem(await api.get(f"/v1/outpost/runs?{query}"), 422, "validation_failed", field)


async def test_the_runs_page_keeps_its_filters_in_the_url(api):
    sched = await api.schedule(name="Nightly Docs")
    failed = await fired_and_settled(api, sched, outpost.RunStatus.FAILED, error="timeout talking to origin")
    ok = await fired_and_settled(api, sched)
    sign_in_client(api.client, api.store, T0)
    page = await (await api.client.get("/runs?status=failed&q=timeout&tz=Europe/Berlin")).get_data(as_text=True)
    assert f'href="/runs/{failed}"' in page and f'href="/runs/{ok}"' not in page
    assert 'value="timeout"' in page and re.search(r'<option value="failed"\s+selected', page)
    assert "status=failed" in page and "q=timeout" in page   # the pager and the bulk form's way back
    empty = await (await api.client.get("/runs?q=nothing-like-this")).get_data(as_text=True)
    assert "No runs match" in empty and 'href="/runs">Clear' in empty


# --- upcoming ---------------------------------------------------------------------------------------------

async def test_upcoming_lists_every_fire_in_time_order_with_paused_and_late_marked(api):
    hourly = await api.schedule(name="hourly", timing={"kind": "cron", "expression": "0 * * * *",
                                                       "timezone": "Europe/Berlin"})
    daily = await api.schedule(name="daily", timing={"kind": "cron", "expression": "30 6 * * *", "timezone": "UTC"})
    paused = await api.schedule(name="paused", timing={"kind": "cron", "expression": "15 12 * * *", "timezone": "UTC"})
    assert (await api.control(paused["id"], "pause", paused["revision"])).status == 200
    archived = await api.schedule(name="gone")
    assert (await api.control(archived["id"], "archive", archived["revision"])).status == 200

    fires = (await api.get("/v1/outpost/upcoming?days=1")).body["fires"]
    assert [f["at"] for f in fires] == sorted(f["at"] for f in fires)
    by_name = {name: [f for f in fires if f["name"] == name] for name in ("hourly", "daily", "paused", "gone")}
    assert len(by_name["hourly"]) == 24 and len(by_name["daily"]) == 1 and by_name["gone"] == []
    assert {f["state"] for f in by_name["hourly"]} == {"scheduled"}
    assert [f["state"] for f in by_name["paused"]] == ["paused"]
    assert by_name["hourly"][0] == {"at": hourly["next_fire_at"], "kind": "schedule", "id": hourly["id"],
                                    "name": "hourly", "timezone": "Europe/Berlin", "state": "scheduled"}
    assert by_name["daily"][0]["at"] == daily["next_fire_at"]

    # nobody claimed the hourly's slot (no cron actor here): 61 s after it, it is late
    api.clock.at = outpost.parse_instant(hourly["next_fire_at"]) + timedelta(seconds=61)
    later = (await api.get("/v1/outpost/upcoming?days=1")).body["fires"]
    assert later[0]["id"] == hourly["id"] and later[0]["state"] == "late" and later[0]["at"] == hourly["next_fire_at"]
    assert [f["state"] for f in later if f["id"] == hourly["id"]][1:] == ["scheduled"] * 24
    for days in ("0", "32", "x"):
        assert_problem(await api.get(f"/v1/outpost/upcoming?days={days}"), 422, "validation_failed", "days")


async def test_upcoming_has_routine_schedule_triggers_and_its_page_groups_by_day(api):
    agent = (await api.post("/api/office/agents", {"name": "ada", "executor": "demo"}, key=None)).body
    routine = await api.post("/api/office/routines", {
        "name": "standup", "assignee_agent_id": agent["id"], "task_template": {"title": "standup"},
        "triggers": [{"kind": "schedule", "cron_expression": "0 9 * * *", "timezone": "America/New_York"}]}, key=None)
    assert routine.status == 201, routine.body
    fires = (await api.get("/v1/outpost/upcoming?days=3")).body["fires"]
    assert [(f["kind"], f["name"], f["state"]) for f in fires] == [("routine", "standup", "scheduled")] * 3
    assert fires[0]["id"] == routine.body["id"] and fires[0]["timezone"] == "America/New_York"

    sign_in_client(api.client, api.store, T0)
    page = await (await api.client.get("/upcoming?days=3&tz=America/New_York")).get_data(as_text=True)
    days = re.findall(r"<h2>(\w+day \d\d \w+ \d{4})</h2>", page)
    assert len(days) == 3 and page.count(f'href="/office/routines/{routine.body["id"]}"') == 3
    assert ">09:00<" in page   # in the viewer's zone
    tokyo = await (await api.client.get("/upcoming?days=3&tz=Asia/Tokyo")).get_data(as_text=True)
    assert ">23:00<" in tokyo

    # a schedule every 5 minutes is one row a day, not 288: the daily routine stays in sight
    await api.schedule(name="often", timing={"kind": "cron", "expression": "*/5 * * * *", "timezone": "UTC"})
    page = await (await api.client.get("/upcoming?days=1&tz=UTC")).get_data(as_text=True)
    counts = [int(n) for n in re.findall(r'data-fires="(\d+)"', page)]
    assert sum(counts) == 288 and len(counts) == 2   # today's from now, tomorrow's up to the same hour
    assert page.count('href="/schedules/') == 2 and "standup" in page


# --- attention: folds, mute, selection --------------------------------------------------------------------

async def open_items(api: Api) -> list[dict]:
    return (await api.get("/v1/outpost/attention")).body["attention"]


async def test_changes_returned_fold_into_one_open_item_per_schedule_newest_first(api):
    every5 = await api.schedule(name="every 5")
    other = await api.schedule(name="other")
    runs = [await fired_and_settled(api, every5, commits=1) for _ in range(3)]
    elsewhere = await fired_and_settled(api, other, commits=2)
    items = await open_items(api)
    assert len(items) == 2
    folded = next(i for i in items if i["schedule_id"] == every5["id"])
    assert folded["kind"] == "changes_returned" and folded["count"] == 3
    assert folded["run_ids"] == runs[::-1] and folded["run_id"] == runs[-1]
    assert folded["latest_at"] > folded["created_at"]
    assert next(i for i in items if i["schedule_id"] == other["id"])["run_ids"] == [elsewhere]
    # a failure is another kind: its own item
    failed = await fired_and_settled(api, every5, outpost.RunStatus.FAILED, error="boom")
    assert {(i["kind"], i["count"]) for i in await open_items(api) if i["schedule_id"] == every5["id"]} == {
        ("changes_returned", 3), ("failed", 1)}
    # once acknowledged, the next one is a new item
    assert (await api.post(f"/v1/outpost/attention/{folded['id']}/ack")).status == 200
    again = await fired_and_settled(api, every5, commits=1)
    fresh = [i for i in await open_items(api) if i["kind"] == "changes_returned" and i["schedule_id"] == every5["id"]]
    assert len(fresh) == 1 and fresh[0]["id"] != folded["id"] and fresh[0]["run_ids"] == [again]
    assert failed not in fresh[0]["run_ids"]

    sign_in_client(api.client, api.store, T0)
    await fired_and_settled(api, every5, commits=1)
    await fired_and_settled(api, every5, commits=1)
    page = await (await api.client.get("/attention")).get_data(as_text=True)
    assert "and 2 more runs returned changes" in page and f'href="/runs/{again}"' in page
    assert f'href="/schedules/{every5["id"]}/edit?mute=changes_returned"' in page


async def test_a_muted_kind_makes_no_item_but_still_shows_on_the_run(api):
    sched = await api.schedule(name="muted", mute=["changes_returned", "missed_fire"])
    assert sched["mute"] == ["changes_returned", "missed_fire"]
    run_id = await fired_and_settled(api, sched, commits=2)
    assert await open_items(api) == []
    assert (await api.get(f"/v1/outpost/runs/{run_id}")).body["changes"]["commits"] == 2
    await fired_and_settled(api, sched, outpost.RunStatus.FAILED, error="boom")   # not muted
    assert [i["kind"] for i in await open_items(api)] == ["failed"]
    # unmuting is an edit like any other, confirmed
    edited = await api.edit(sched["id"], {"mute": []}, sched["revision"])
    assert edited.status == 200 and "mute" not in edited.body
    await fired_and_settled(api, sched, commits=1)
    assert sorted(i["kind"] for i in await open_items(api)) == ["changes_returned", "failed"]


@pytest.mark.parametrize("mute", [["needs_you"], ["nope"], "changes_returned", [1]])
async def test_mute_takes_only_kinds_a_schedule_can_mute(api, mute):
    assert_problem(await api.compose(api.raw(mute=mute)), 422, "validation_failed", "mute")


async def test_the_edit_form_offers_muting_the_kind_an_item_named(api):
    sched = await api.schedule(name="edit me")
    sign_in_client(api.client, api.store, T0)
    page = await (await api.client.get(f"/schedules/{sched['id']}/edit?mute=changes_returned")).get_data(as_text=True)
    assert re.search(r'name="mute_changes_returned" value="yes"\s+checked', page)
    assert not re.search(r'name="mute_failed" value="yes"\s+checked', page)
    form = outpost.form_from_definition({**outpost.normalize_definition(api.raw(), T0, agents=["demo"]),
                                         "mute": ["failed"]})
    assert outpost.definition_from_form(form)["mute"] == ["failed"]


async def test_a_selection_of_items_is_acknowledged_at_once(api):
    scheds = [await api.schedule(name=f"s{i}") for i in range(3)]
    for s in scheds:
        await fired_and_settled(api, s, commits=1)
    a, b, c = sorted(await open_items(api), key=lambda i: i["id"])
    reply = await api.post("/v1/outpost/attention/ack", {"ids": [a["id"], b["id"], "att_nope", a["id"]]})
    assert reply.status == 200, reply.body
    assert [i["id"] for i in reply.body["acknowledged"]] == [a["id"], b["id"]]
    assert all(i["acknowledged_at"] for i in reply.body["acknowledged"]) and reply.body["unknown"] == ["att_nope"]
    assert [i["id"] for i in await open_items(api)] == [c["id"]]
    for body in ({}, {"ids": []}, {"ids": "x"}, {"ids": [1]}, {"ids": ["x"] * 201}, {"ids": ["a"], "all": True}):
        reply = await api.post("/v1/outpost/attention/ack", body)
        assert reply.status == 422, (body, reply.body)


# --- bulk cancel and re-run -------------------------------------------------------------------------------

async def test_bulk_cancel_and_rerun_answer_each_ones_outcome(api):
    sched = await api.schedule(name="bulk")
    done = await fired_and_settled(api, sched)
    api.clock.at += timedelta(minutes=1)
    queued = (await api.fire(sched["id"]))["run_id"]
    reply = await api.post("/v1/outpost/runs/cancel", {"ids": [queued, done, "run_nope"]})
    assert reply.status == 200, reply.body
    by_id = {r["id"]: r for r in reply.body["results"]}
    assert by_id[queued] == {"id": queued, "status": "cancelled", "detail": None, "run_id": None}
    assert by_id[done]["status"] == "succeeded" and "already settled" in by_id[done]["detail"]
    assert by_id["run_nope"]["status"] is None and "no run" in by_id["run_nope"]["detail"]
    assert [r["id"] for r in reply.body["results"]] == [queued, done, "run_nope"]

    key = "bulk-rerun-1"
    again = await api.post("/v1/outpost/runs/rerun", {"ids": [done, queued]}, key=key)
    assert again.status == 200, again.body
    first, second = again.body["results"]
    assert first["id"] == done and first["run_id"] and first["detail"] is None
    rerun = (await api.get(f"/v1/outpost/runs/{first['run_id']}")).body
    assert rerun["trigger"] == "rerun" and rerun["rerun_of"] == done
    assert second["id"] == queued and second["status"] == "cancelled" and second["run_id"]   # same commit again
    replay = await api.post("/v1/outpost/runs/rerun", {"ids": [done, queued]}, key=key)
    assert replay.body == again.body   # the same answer, no second re-run
    assert len(ids(await api.get("/v1/outpost/runs?trigger=rerun"))) == 2
    running = (await api.get(f"/v1/outpost/runs/{first['run_id']}")).body["id"]
    (refused,) = (await api.post("/v1/outpost/runs/rerun", {"ids": [running]})).body["results"]
    assert refused["run_id"] is None and "re-run it once it has settled" in refused["detail"]


async def test_the_runs_page_cancels_a_ticked_selection(api):
    sched = await api.schedule(name="tick")
    api.clock.at += timedelta(minutes=1)
    one = (await api.fire(sched["id"]))["run_id"]
    two = (await api.post("/v1/outpost/dispatches", {"brief": "@print x", "repository": str(api.repo)})).body["run_id"]
    csrf = sign_in_client(api.client, api.store, T0)
    page = await (await api.client.get("/runs")).get_data(as_text=True)
    assert f'name="ids" value="{one}" form="runs-bulk"' in page
    answer = await post_form(api.client, "/runs/bulk", [("csrf", csrf), ("action", "cancel"), ("ids", one),
                                                        ("ids", two), ("back", "/runs?status=queued")])
    assert answer.status_code == 303 and answer.headers["Location"] == "/runs?status=queued"
    shown = await (await api.client.get("/runs?status=queued")).get_data(as_text=True)
    assert "Cancelled a selection of 2" in shown
    assert {r["status"] for r in (await api.get("/v1/outpost/runs")).body["runs"]} == {"cancelled"}
    outside = await api.client.post("/runs/bulk", form={"csrf": csrf, "action": "cancel", "ids": [one],
                                                        "back": "https://evil.example/"})
    assert outside.headers["Location"] == "/runs"   # never a redirect off the dashboard


# --- notification entries from the dashboard --------------------------------------------------------------

async def test_notification_entries_are_added_edited_tested_and_removed_without_a_restart(api):
    assert (await api.get("/v1/outpost/notify/entries")).body == {"entries": []}
    assert_problem(await api.post("/v1/outpost/notify/test", {}), 409, "conflict")
    defaults = await api.post("/v1/outpost/notify/entries", {"url": "json://127.0.0.1:9/defaults"})
    assert defaults.status == 201 and defaults.body["kinds"] == list(outpost.NOTIFY_DEFAULT_KINDS)
    assert (await api.delete(f"/v1/outpost/notify/entries/{defaults.body['id']}", key="rm-0")).status == 204
    added = await api.post("/v1/outpost/notify/entries", {"url": "json://127.0.0.1:9/hook?token=s3cret",
                                                          "kinds": ["succeeded"]})
    assert added.status == 201, added.body
    entry = added.body
    assert entry["source"] == "dashboard" and entry["id"].startswith("ntf_") and "s3cret" not in str(entry)

    # an item raised now reaches it: no restart
    sched = await api.schedule(name="n", notify="always")
    await fired_and_settled(api, sched)
    assert [n["kind"] for n in call(api.store, api.store.notify.notifications)] == ["succeeded"]

    patched = await api.patch(f"/v1/outpost/notify/entries/{entry['id']}",
                              {"kinds": ["failed"], "digest": "08:00 Europe/Berlin"})
    assert patched.status == 200, patched.body
    assert patched.body["kinds"] == ["failed"] and patched.body["digest"] == "08:00 Europe/Berlin"
    await fired_and_settled(api, sched, outpost.RunStatus.FAILED, error="boom")
    await fired_and_settled(api, sched)
    kinds = [n["kind"] for n in call(api.store, api.store.notify.notifications)]
    assert sorted(kinds) == ["failed", "succeeded"]   # the first success, then only the failure

    tested = await api.post(f"/v1/outpost/notify/entries/{entry['id']}/test")
    assert tested.status == 202 and tested.body["queued"][0]["entry_id"] == entry["id"]
    assert (await api.delete(f"/v1/outpost/notify/entries/{entry['id']}", key="rm-1")).status == 204
    assert (await api.get("/v1/outpost/notify/entries")).body == {"entries": []}
    assert_problem(await api.delete(f"/v1/outpost/notify/entries/{entry['id']}", key="rm-2"), 404, "not_found")


async def test_a_bad_entry_names_every_field_at_once_and_a_duplicate_is_409(api):
    reply = await api.post("/v1/outpost/notify/entries", {"url": "nope://x", "kinds": ["nope"], "digest": "8 am"})
    assert_problem(reply, 422, "validation_failed")
    assert {e["field"] for e in reply.body["errors"]} == {"url", "kinds", "digest"}
    assert_problem(await api.post("/v1/outpost/notify/entries", {"kinds": ["failed"]}), 422, "validation_failed", "url")
    assert_problem(await api.post("/v1/outpost/notify/entries", {"url": "json://h/x", "to": "me"}), 422,
                   "validation_failed", "to")
    assert_problem(await api.post("/v1/outpost/notify/entries", ["json://h/x"]), 422, "validation_failed", "body")
    assert (await api.post("/v1/outpost/notify/entries", {"url": "json://h/x"})).status == 201
    assert_problem(await api.post("/v1/outpost/notify/entries", {"url": "json://h/x"}), 409, "conflict")


async def test_outpost_toml_entries_are_listed_read_only(tmp_path, git_repo):
    import dataclasses
    deps = make_deps(tmp_path)
    toml = outpost.NotifyEntry(0, "json://127.0.0.1:9/t?token=abc", "json://127.0.0.1:9/t", id="toml-0")
    deps = dataclasses.replace(deps, config=dataclasses.replace(deps.config, notify=(toml,)))
    deps.store.notify.configure((toml,))
    api = Api(deps, git_repo)
    try:
        (listed,) = (await api.get("/v1/outpost/notify/entries")).body["entries"]
        assert listed["source"] == "toml" and listed["id"] == "toml-0" and "abc" not in str(listed)
        assert_problem(await api.patch("/v1/outpost/notify/entries/toml-0", {"kinds": ["failed"]}), 409, "conflict")
        assert_problem(await api.delete("/v1/outpost/notify/entries/toml-0", key="rm-1"), 409, "conflict")
        assert_problem(await api.post("/v1/outpost/notify/entries", {"url": toml.url}), 409, "conflict")
        assert (await api.post("/v1/outpost/notify/entries/toml-0/test")).status == 202
        assert (await api.post("/v1/outpost/notify/test", {"entry": 0})).status == 202
    finally:
        deps.store.close()


async def test_the_settings_form_shows_every_error_at_its_field_and_adds_an_entry(api):
    csrf = sign_in_client(api.client, api.store, T0)
    refused = await api.client.post("/settings/notify/entries", form={
        "csrf": csrf, "url": "nope://x", "digest_time": "25:00", "digest_zone": "Mars/Olympus"})
    page = await refused.get_data(as_text=True)
    assert refused.status_code == 422
    for field in ("url", "kinds", "digest"):
        assert re.search(rf'aria-describedby=nf-{field}-new[^>]*>|id="nf-{field}-new"', page), field
        assert f'id="nf-{field}-new"' in page
    assert "not a URL Apprise can send to" in page and "tick at least one kind" in page and "time of day" in page
    added = await post_form(api.client, "/settings/notify/entries", [
        ("csrf", csrf), ("url", "json://127.0.0.1:9/x"), ("kinds", "failed"), ("kinds", "needs_you"),
        ("digest_time", "08:00"), ("digest_zone", "Europe/Berlin")])
    assert added.status_code == 303
    (entry,) = (await api.get("/v1/outpost/notify/entries")).body["entries"]
    assert entry["kinds"] == ["failed", "needs_you"] and entry["digest"] == "08:00 Europe/Berlin"
    settings = await (await api.client.get("/settings")).get_data(as_text=True)
    assert f'data-entry="{entry["id"]}"' in settings and "added here" in settings
    # an edit with the URL left empty keeps the stored one
    saved = await post_form(api.client, "/settings/notify/entries", [("csrf", csrf), ("entry_id", entry["id"]),
                                                                      ("url", ""), ("kinds", "failed")])
    assert saved.status_code == 303
    (entry,) = (await api.get("/v1/outpost/notify/entries")).body["entries"]
    assert entry["kinds"] == ["failed"] and entry["url"].startswith("json://127.0.0.1:9") and entry["digest"] is None
    removed = await api.client.post(f"/settings/notify/entries/{entry['id']}/delete", form={"csrf": csrf})
    assert removed.status_code == 303 and (await api.get("/v1/outpost/notify/entries")).body == {"entries": []}


# --- what a hostile caller cannot make these do -----------------------------------------------------------

async def test_a_proposer_key_can_neither_add_a_receiver_nor_act_on_a_selection(api):
    """A person's own agent holds a proposer key: a notification entry of its choosing would send it
    every item; a bulk cancel would stop every run. Both need the API token or a session."""
    key = call(api.store, api.store.access.create_key, "laptop", "proposer", T0)["key"]
    as_agent = {"Authorization": f"Bearer {key}"}
    sched = await api.schedule(name="guarded")
    api.clock.at += timedelta(minutes=1)
    run_id = (await api.fire(sched["id"]))["run_id"]
    for path, body in (("/v1/outpost/notify/entries", {"url": "json://attacker.example/x"}),
                       ("/v1/outpost/runs/cancel", {"ids": [run_id]}), ("/v1/outpost/runs/rerun", {"ids": [run_id]}),
                       ("/v1/outpost/attention/ack", {"ids": ["att_x"]})):
        reply = await api.post(path, body, auth=False, headers=as_agent)
        assert_problem(reply, 403, "forbidden")
    assert (await api.get(f"/v1/outpost/runs/{run_id}")).body["status"] == "queued"
    assert call(api.store, api.store.notify.entry_states) == []


async def test_search_text_is_data_and_secrets_stay_masked_on_every_page(api):
    sched = await api.schedule(name="quoted")
    failed = await fired_and_settled(api, sched, outpost.RunStatus.FAILED, error="it's 100% broken_now: ÉCOLE straße")
    for text in ("' OR 1=1 --", "%' OR '1'='1", "\\"):
        assert ids(await api.get("/v1/outpost/runs?" + urllib.parse.urlencode({"q": text}))) == []
    for text in ("100% broken_", "ÉCOLE", "école", "STRAßE"):   # any case, every letter
        assert ids(await api.get("/v1/outpost/runs?" + urllib.parse.urlencode({"q": text}))) == [failed], text
    for text in ("\x00", "a\nb", "x" * 201):   # never silently cut or read as an empty pattern
        reply = await api.get("/v1/outpost/runs?" + urllib.parse.urlencode({"q": text}))
        assert_problem(reply, 422, "validation_failed", "q")
    assert_problem(await api.get("/v1/outpost/runs?since=2026-12-03&until=2026-12-01"), 422, "validation_failed",
                   "until")
    added = await api.post("/v1/outpost/notify/entries", {"url": "ntfys://outpost:hunter2pass@ntfy.example.com/topic"})
    assert added.status == 201 and "hunter2pass" not in added.text
    sign_in_client(api.client, api.store, T0)
    settings = await (await api.client.get("/settings")).get_data(as_text=True)
    assert "ntfy.example.com" in settings and "hunter2pass" not in settings
    assert "hunter2pass" not in (await api.get("/v1/outpost/notify/entries")).text
    hook = await api.post("/v1/outpost/notify/entries", {"url": "json://hooks.example.com/services/SuperSecretPath9"})
    assert hook.status == 201 and hook.body["url"] == "json://hooks.example.com/****"
    assert "SuperSecretPath9" not in (await api.get("/v1/outpost/notify/entries")).text
    too_long = await api.post("/v1/outpost/notify/entries", {"url": "json://h/" + "x" * 3000})
    assert_problem(too_long, 422, "validation_failed", "url")


# --- schedules by state and next fire ---------------------------------------------------------------------

async def test_schedules_filter_by_state_and_sort_by_next_fire(api):
    late = await api.schedule(name="late", timing={"kind": "cron", "expression": "0 23 * * *", "timezone": "UTC"})
    soon = await api.schedule(name="soon", timing={"kind": "cron", "expression": "*/5 * * * *", "timezone": "UTC"})
    held = await api.schedule(name="held")
    assert (await api.control(held["id"], "pause", held["revision"])).status == 200
    gone = await api.schedule(name="gone")
    assert (await api.control(gone["id"], "archive", gone["revision"])).status == 200
    auto = await api.auto_paused()

    def names(reply):
        assert reply.status == 200, reply.body
        return [s["name"] for s in reply.body["schedules"]]
    assert names(await api.get("/v1/outpost/schedules?state=enabled")) == ["late", "soon"]
    assert names(await api.get("/v1/outpost/schedules?state=paused")) == ["held"]
    assert names(await api.get("/v1/outpost/schedules?state=auto_paused")) == [auto["name"]]
    assert names(await api.get("/v1/outpost/schedules?state=archived")) == ["gone"]
    assert names(await api.get("/v1/outpost/schedules?state=enabled&sort=next_fire")) == ["soon", "late"]
    assert_problem(await api.get("/v1/outpost/schedules?state=sleeping"), 422, "validation_failed", "state")
    assert_problem(await api.get("/v1/outpost/schedules?sort=name"), 422, "validation_failed", "sort")

    sign_in_client(api.client, api.store, T0)
    page = await (await api.client.get("/schedules?state=enabled&sort=next_fire")).get_data(as_text=True)
    assert page.index(f'href="/schedules/{soon["id"]}"') < page.index(f'href="/schedules/{late["id"]}"')
    assert f'href="/schedules/{held["id"]}"' not in page
    archived = await (await api.client.get("/schedules?state=archived")).get_data(as_text=True)
    assert f'href="/schedules/{gone["id"]}"' in archived


async def test_upcoming_walks_a_sparse_cron_only_to_the_window_and_says_where_a_busy_one_was_cut(api):
    yearly = {"kind": "cron", "expression": "0 4 1 1 *", "timezone": "UTC"}
    assert outpost.fires_until(yearly, T0, T0 + timedelta(days=1), 10_000) == []
    minutely = {"kind": "cron", "expression": "* * * * *", "timezone": "UTC"}
    assert len(outpost.fires_until(minutely, T0, T0 + timedelta(days=1), 10_000)) == 1440
    busy = await api.schedule(name="busy", timing=minutely)
    week = (await api.get("/v1/outpost/upcoming?days=7")).body
    assert week["cut"] == [] and len(week["fires"]) == 10_080
    month = (await api.get("/v1/outpost/upcoming?days=31")).body
    assert month["cut"] == [busy["id"]] and len(month["fires"]) == outpost.UPCOMING_MAX_EACH
    assert (await api.get("/v1/outpost/upcoming?days=")).body["days"] == 7   # empty: the default
    sign_in_client(api.client, api.store, T0)
    page = await (await api.client.get("/upcoming?days=31&tz=UTC")).get_data(as_text=True)
    assert 'id="upcoming-cut"' in page and "busy" in page


# --- what a new user hit ----------------------------------------------------------------------------------

async def test_a_refused_entry_form_keeps_what_was_typed_and_speaks_the_forms_words(api):
    csrf = sign_in_client(api.client, api.store, T0)
    refused = await post_form(api.client, "/settings/notify/entries", [
        ("csrf", csrf), ("url", "json://127.0.0.1:9/typed"), ("digest_zone", "Europe/Berlin")])
    page = await refused.get_data(as_text=True)
    assert refused.status_code == 422 and 'value="json://127.0.0.1:9/typed"' in page
    assert "tick at least one kind" in page and "give the time of day too" in page


async def test_a_mistyped_runs_bookmark_names_every_bad_filter_on_the_runs_page(api):
    sign_in_client(api.client, api.store, T0)
    reply = await api.client.get("/runs?status=bogus&since=notadate")
    page = await reply.get_data(as_text=True)
    assert reply.status_code == 422 and 'id="filter-errors"' in page and 'id="run-filters"' in page
    assert "<strong>status</strong>" in page and "<strong>since</strong>" in page
    both = await api.get("/v1/outpost/runs?status=bogus&since=notadate")
    assert {e["field"] for e in both.body["errors"]} == {"status", "since"}


async def test_mute_these_says_what_it_ticked_and_confirming_it_clears_the_open_items(api):
    sched = await api.schedule(name="chatty")
    for _ in range(2):
        await fired_and_settled(api, sched, commits=1)
    (item,) = await open_items(api)
    sign_in_client(api.client, api.store, T0)
    form = await (await api.client.get(f"/schedules/{sched['id']}/edit?mute=changes_returned")).get_data(as_text=True)
    assert 'id="mute-notice"' in form and "changes returned" in form
    composed = await api.compose({"schedule_id": sched["id"], "mute": ["changes_returned"]})
    assert "muted: changes returned" in composed.body["summary"]
    assert (await api.edit(sched["id"], {"mute": ["changes_returned"]}, sched["revision"])).status == 200
    assert await open_items(api) == []   # the item it was muted from is done
    page = await (await api.client.get("/attention")).get_data(as_text=True)
    assert "and 1 more run returned changes" in page   # one more: singular


async def test_an_interval_written_as_a_duration_in_seconds_says_its_seconds(api):
    reply = await api.compose(api.raw(timing={"kind": "interval", "seconds": "6h", "timezone": "UTC"}))
    assert_problem(reply, 422, "validation_failed", "timing.seconds")
    assert "use 21600 (6h)" in reply.body["detail"]

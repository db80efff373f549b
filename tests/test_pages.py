"""Every dashboard page of the route table, in process: signed out it redirects to sign-in;
signed in it answers 200 on an empty database and on a filled one, never a server error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import (
    T0,
    call,
    ended,
    make_deps,
    make_repo,
    new_agent,
    new_task,
    normalized,
    set_settings,
    sign_in_client,
)

import outpost

#: Every GET page of the dashboard (the ``pages`` table), the public sign-in pages aside.
PAGES = [r.rule for r in outpost.pages.routes if r.method == "GET" and r.auth is outpost.Auth.SESSION]


def fill(store: outpost.Store, repo: Path) -> dict[str, str]:
    """One of everything a page shows: a schedule with a failed run and its attention item, an
    agent with a task, its wakeup and Office run, and a routine with a webhook trigger."""
    set_settings(store, repository=str(repo))
    schedule_id = call(store, store.schedules.create_schedule, normalized(repo), T0)["id"]
    run_id = call(store, store.schedules.fire_manual, schedule_id, 1, T0)["run_id"]
    call(store, store.runs.admit_ready, 2, T0)
    call(store, store.runs.settle_run, run_id, ended(outpost.RunStatus.FAILED, error="boom"), T0, exit_code=1)
    call(store, store.schedules.notify_run, run_id, T0)
    agent_id = new_agent(store, "Worker", T0)
    task_id = new_task(store, "Write notes", T0, assignee_agent_id=agent_id)
    (office_run_id,), _ = call(store, store.pipeline.dispatch_wakeups, T0, {"demo": outpost.demo_profile()})
    routine = call(store, store.routines.create_routine, None,
                   outpost.normalize_routine({"name": "nightly", "assignee_agent_id": agent_id}),
                   [outpost.normalize_trigger({"kind": "webhook", "signing_mode": "hmac_sha256"}, 0, T0, "UTC")], T0)
    definition = normalized(repo, name="proposed")
    proposal = call(store, store.access.create_proposal, "create", None, {"definition": definition}, None,
                    {**outpost.composed(definition, T0, definition["timing"]), "name": "proposed"}, "my-agent", T0)
    return {"schedule_id": schedule_id, "run_id": run_id, "agent_id": agent_id, "task_id": task_id,
            "routine_id": routine["id"], "office_run_id": office_run_id, "proposal_id": proposal["id"]}


def path_of(rule: str, ids: dict[str, str]) -> str:
    ids = {**ids, "run_id": ids["office_run_id"]} if rule.startswith("/office/runs/") else ids
    return re.sub(r"<(\w+)>", lambda m: ids[m[1]], rule)


@pytest.fixture
def dashboard(tmp_path: Path):
    deps = make_deps(tmp_path)
    yield deps
    deps.store.close()


async def test_the_settings_page_names_the_embedded_repository_while_none_is_set(dashboard):
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, dashboard.store, T0)
    page = await (await client.get("/office/settings")).get_data(as_text=True)
    assert 'id="embedded-repository"' in page and dashboard.store.embedded_repository in page


def test_every_page_is_in_the_table():
    assert {"/schedules", "/runs/<run_id>", "/office/board", "/office/routines/<routine_id>"} <= set(PAGES)
    assert len(PAGES) == 26


@pytest.mark.parametrize("rule", PAGES)
async def test_a_page_redirects_to_sign_in_when_signed_out(dashboard, rule):
    client = outpost.create_app(dashboard).test_client()
    response = await client.get(path_of(rule, dict.fromkeys(("schedule_id", "run_id", "agent_id", "task_id",
                                                              "routine_id", "office_run_id", "proposal_id"), "x")))
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/signin?next=")


@pytest.mark.parametrize("rule", PAGES)
async def test_a_page_answers_on_an_empty_database(dashboard, rule):
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, dashboard.store, T0)
    missing = dict.fromkeys(("schedule_id", "run_id", "agent_id", "task_id", "routine_id", "office_run_id",
                             "proposal_id"),
                            "no_such_id")
    response = await client.get(path_of(rule, missing), headers={"Accept": "text/html"})
    expected = (404,) if "<" in rule else (200, 302)   # "/" and "/office" redirect to their first page
    assert response.status_code in expected, (rule, response.status_code)
    if response.status_code != 302:
        assert "text/html" in response.headers["Content-Type"]


@pytest.mark.parametrize("rule", PAGES)
async def test_a_page_answers_on_a_filled_database(dashboard, tmp_path, rule):
    ids = fill(dashboard.store, make_repo(tmp_path / "repo"))
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, dashboard.store, T0)
    response = await client.get(path_of(rule, ids), headers={"Accept": "text/html"})
    if rule in ("/", "/office"):
        assert response.status_code == 302
        return
    if rule == "/office/runs/<run_id>":   # an Office run's page is the run page
        assert response.status_code == 303 and response.headers["Location"] == f"/runs/{ids['office_run_id']}"
        return
    if rule == "/runs/<run_id>/log":   # the raw log, a download
        assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
        assert response.headers["Content-Disposition"] == f'attachment; filename="{ids["run_id"]}.log"'
        return
    page = await response.get_data(as_text=True)
    assert response.status_code == 200, (rule, page[:500])
    for name in ("schedule_id", "run_id", "agent_id", "task_id", "routine_id", "proposal_id"):
        if f"<{name}>" in rule:
            assert ids["office_run_id" if rule.startswith("/office/runs/") else name] in page


async def test_the_agents_page_shows_this_appliance_as_its_only_node(dashboard):
    call(dashboard.store, dashboard.store.nodes.register_node, 3)
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, dashboard.store, T0)
    page = await (await client.get("/agents")).get_data(as_text=True)
    row = re.search(r'<tr data-node="([^"]+)">(.*?)</tr>', page, re.S)
    assert row and row[1] == dashboard.store.node and "(this one)" in row[2] and "0 / 3" in row[2]
    assert 'id="nodes-single"' in page and "Running a fleet" in page


# --- POST/redirect/GET: every form answers 303 to a GET page -------------------------------------------

#: Forms that write nothing and show their answer: the compose step's review (its Confirm posts
#: the reviewed definition; a reload of the review only reviews again).
PREVIEWS = {"/schedules/review", "/schedules/<schedule_id>/review"}


class Forms:
    """A signed-in browser posting the dashboard's forms, in process."""

    def __init__(self, client, csrf: str):
        self.client, self.csrf, self.posted = client, csrf, set()

    async def post(self, rule: str, path: str, *, follow: bool = True, **form) -> str:
        """POST a form: 303 to a GET page, which answers 200 (the page a reload shows); its Location.
        ``follow=False``: the caller views that page itself (it has something to show once)."""
        self.posted.add(rule)
        response = await self.client.post(path, form={"csrf": self.csrf, **form}, headers={"Accept": "text/html"})
        body = await response.get_data(as_text=True)
        assert response.status_code == 303, (rule, response.status_code, body[:800])
        location = response.headers["Location"]
        if follow and rule != "/signout":
            target = await self.client.get(location, headers={"Accept": "text/html"})
            assert target.status_code == 200, (rule, location)
        return location

    async def get(self, path: str) -> str:
        return await (await self.client.get(path, headers={"Accept": "text/html"})).get_data(as_text=True)


async def test_every_form_answers_303_to_a_get_page_and_a_secret_shows_once(dashboard, tmp_path):
    import dataclasses
    repo = make_repo(tmp_path / "repo")
    ids = fill(dashboard.store, repo)
    store = dashboard.store
    deps = dataclasses.replace(dashboard, config=dataclasses.replace(
        dashboard.config, notify=(outpost.NotifyEntry(0, "json://127.0.0.1:9", "json://127.0.0.1:9", id="toml-0"),)))
    dashboard.store.notify.configure(deps.config.notify)   # as serve does
    client = outpost.create_app(deps).test_client()
    forms = Forms(client, sign_in_client(client, store, T0))
    sid, run_id, agent_id, task_id, routine_id = (ids[k] for k in ("schedule_id", "run_id", "agent_id", "task_id",
                                                                  "routine_id"))

    # Schedules: confirm a reviewed definition, edit it, control it; Fire now lands on the new run.
    definition = outpost.canonical_json(normalized(repo, name="prg"))
    confirmation = outpost.confirmation_of(normalized(repo, name="prg"))
    created = await forms.post("/schedules", "/schedules", definition=definition, confirmation=confirmation)
    new_id = re.fullmatch(r"/schedules/(\w+)\?done=created", created)[1]
    assert len(call(store, store.schedules.list_schedules)) == 2, "one create, one schedule"
    edited = normalized(repo, name="prg edited")
    assert await forms.post("/schedules/<schedule_id>", f"/schedules/{new_id}", base=definition, revision="1",
                            definition=outpost.canonical_json(edited),
                            confirmation=outpost.confirmation_of(edited)) == f"/schedules/{new_id}?done=updated"
    fired = await forms.post("/schedules/<schedule_id>/control", f"/schedules/{new_id}/control", action="fire",
                             revision="2")
    fired_run = re.fullmatch(r"/runs/(\w+)\?done=admitted", fired)[1]
    assert await forms.post("/runs/<run_id>/control", f"/runs/{fired_run}/control",
                            action="cancel") == f"/runs/{fired_run}?done=cancel"
    assert await forms.post("/schedules/<schedule_id>/control", f"/schedules/{new_id}/control", action="pause",
                            revision="2") == f"/schedules/{new_id}?done=pause"

    # Runs: a needs_you run is answered in one step (adopted as part of it); its item closes.
    call(store, store.runs.resume_profile, "demo", T0)
    asking = call(store, store.schedules.fire_manual, sid, 1, T0)["run_id"]
    call(store, store.runs.admit_ready, 2, T0)
    call(store, store.runs.ask_human, asking, "Which branch?", T0)
    call(store, store.runs.settle_run, asking, ended(outpost.RunStatus.NEEDS_YOU), T0, exit_code=0)
    call(store, store.schedules.notify_run, asking, T0)
    open_before = call(store, store.open_attention_count)
    replied = await forms.post("/runs/<run_id>/reply", f"/runs/{asking}/reply", message="Use main", workspace="team")
    reply_run = re.fullmatch(r"/runs/(\w+)\?done=replied", replied)[1]
    assert call(store, store.open_attention_count) == open_before - 1
    answered = call(store, store.runs.get_run, asking)
    assert (answered["owner"], answered["answered_by"], answered["answer"]) == ("team", reply_run, "Use main")
    thread = await forms.get(f"/runs/{reply_run}")
    assert 'id="thread"' in thread and "Which branch?" in thread and "Use main" in thread
    assert f'href="/runs/{asking}"' in thread
    assert await forms.post("/runs/<run_id>/adopt", f"/runs/{run_id}/adopt",
                            workspace="team") == f"/runs/{run_id}?done=adopted"
    rerun = await forms.post("/runs/<run_id>/rerun", f"/runs/{fired_run}/rerun")
    assert re.fullmatch(r"/runs/\w+\?done=rerun", rerun)
    assert await forms.post("/agents/<name>/resume", "/agents/demo/resume") == "/agents?done=resumed"
    # Proposals: a person's agent proposed; a human confirms one (its schedule opens), declines another.
    pid = ids["proposal_id"]
    confirmed = await forms.post("/proposals/<proposal_id>/confirm", f"/proposals/{pid}/confirm")
    assert re.fullmatch(r"/schedules/\w+\?done=created", confirmed)
    assert call(store, store.access.get_proposal, pid, T0)["state"] == "confirmed"
    edited = normalized(repo, name="prg edited")
    second = call(store, store.access.create_proposal, "change", new_id, {"changes": {"brief": "Other."}}, 3,
                  {**outpost.composed(edited, T0, edited["timing"]), "name": "prg edited", "diff": []}, "x", T0)
    assert await forms.post("/proposals/<proposal_id>/decline", f"/proposals/{second['id']}/decline",
                            note="no") == f"/proposals/{second['id']}?done=proposal_declined"
    item = call(store, store.list_attention, True)[0]["id"]
    assert await forms.post("/attention/<attention_id>/ack", f"/attention/{item}/ack") == "/attention?done=acked"
    assert await forms.post("/attention/ack-all", "/attention/ack-all") == "/attention?done=acked_all"
    assert await forms.post("/settings/notify/test", "/settings/notify/test",
                            entry="0") == "/settings?done=notify_test"

    # Office: agents, tasks, comments, approvals, settings.
    agent = await forms.post("/office/agents", "/office/agents", name="Second", executor="demo")
    second = re.fullmatch(r"/office/agents/(\w+)\?done=agent_created", agent)[1]
    assert len(call(store, store.office.list_agents, None)) == 2
    call(store, store.channels.sync, (outpost.ChannelEntry("ops", "slack", "C1", "create", "Second", "xoxb",
                                                           signing_secret="s"),), T0)
    assert await forms.post("/settings/channels/<name>/test", "/settings/channels/ops/test") == (
        "/settings?done=channel_test")
    assert await forms.post("/office/agents/<agent_id>", f"/office/agents/{second}", name="Second",
                            role="worker", status="idle") == f"/office/agents/{second}?done=agent_updated"
    assert await forms.post("/office/agents/<agent_id>/wake", f"/office/agents/{second}/wake",
                            context="hi") == f"/office/agents/{second}?done=woken"
    made = await forms.post("/office/tasks", "/office/tasks", title="Another", description="")
    new_task_id = re.fullmatch(r"/office/tasks/(\w+)\?done=task_created", made)[1]
    assert await forms.post("/office/tasks/<task_id>", f"/office/tasks/{new_task_id}", title="Another one",
                            description="") == f"/office/tasks/{new_task_id}?done=task_updated"
    assert await forms.post("/office/tasks/<task_id>/comments", f"/office/tasks/{new_task_id}/comments",
                            body="a note") == f"/office/tasks/{new_task_id}?done=commented#comments"
    assert await forms.post("/office/tasks/<task_id>/move", f"/office/tasks/{new_task_id}/move",
                            state="CANCELLED") == f"/office/tasks/{new_task_id}?done=moved"
    approval = call(store, store.office.request_approval, task_id, agent_id, "ok?", T0, outpost.DEFAULT_WORKSPACE)
    assert await forms.post("/office/approvals/<approval_id>/resolve", f"/office/approvals/{approval['id']}/resolve",
                            status="approved") == f"/office/tasks/{task_id}?done=approval_resolved"
    assert await forms.post("/office/settings", "/office/settings",
                            name="Default") == "/office/settings?done=settings_saved"

    # Routines: a webhook secret is shown once on the page the form redirects to, never in its URL.
    made = await forms.post("/office/routines", "/office/routines", name="hooked", assignee_agent_id=agent_id,
                            concurrency_policy="coalesce_if_active", catch_up_policy="skip_missed",
                            webhook_mode="hmac_sha256", follow=False)
    new_routine = re.fullmatch(r"/office/routines/(\w+)\?done=routine_created", made)[1]
    (trigger,) = call(store, store.routines.get_routine, new_routine)["triggers"]
    first = await forms.get(made)
    shown = re.search(rf'id="secret-{trigger["id"]}">([^<]+)</pre>', first)
    assert shown and len(shown[1]) > 30 and shown[1] not in made
    assert shown[1] not in await forms.get(made), "a reload no longer shows the secret"
    for rule, path, form, done in (
            ("/office/routines/<routine_id>/triggers", f"/office/routines/{routine_id}/triggers",
             {"kind": "webhook", "signing_mode": "hmac_sha256"}, "trigger_added"),
            ("/office/routines/<routine_id>/triggers/<trigger_id>/rotate",
             f"/office/routines/{new_routine}/triggers/{trigger['id']}/rotate", {}, "secret_rotated")):
        location = await forms.post(rule, path, follow=False, **form)
        assert location.endswith(f"?done={done}")
        page = await forms.get(location)
        fresh = re.search(r'id="secret-[^"]+">([^<]+)</pre>', page)
        assert fresh and fresh[1] != shown[1] and fresh[1] not in await forms.get(location)
    assert await forms.post("/office/routines/<routine_id>", f"/office/routines/{new_routine}", name="hooked 2",
                            assignee_agent_id=agent_id, concurrency_policy="coalesce_if_active",
                            catch_up_policy="skip_missed") == f"/office/routines/{new_routine}?done=routine_updated"
    assert await forms.post("/office/routines/<routine_id>/status", f"/office/routines/{new_routine}/status",
                            status="paused") == f"/office/routines/{new_routine}?done=routine_updated"
    assert (await forms.post("/office/routines/<routine_id>/fire", f"/office/routines/{routine_id}/fire")
            ).startswith(f"/office/routines/{routine_id}?done=fired_")
    assert await forms.post("/office/routines/<routine_id>/triggers/<trigger_id>/delete",
                            f"/office/routines/{new_routine}/triggers/{trigger['id']}/delete"
                            ) == f"/office/routines/{new_routine}?done=trigger_deleted"
    assert await forms.post("/office/routines/<routine_id>/delete",
                            f"/office/routines/{new_routine}/delete") == "/office/routines?done=routine_deleted"

    # Daily use: a selection of runs or attention items; notification entries from Settings.
    assert await forms.post("/runs/bulk", "/runs/bulk", action="rerun", ids=run_id,
                            back="/runs?status=succeeded") == "/runs?status=succeeded"
    assert await forms.post("/attention/ack-selected", "/attention/ack-selected",
                            ids="att_none") == "/attention?done=acked_selected"
    assert await forms.post("/settings/notify/entries", "/settings/notify/entries", url="json://127.0.0.1:9/page",
                            kinds="failed") == "/settings?done=notify_saved#notifications"
    (added,) = [e for e in call(store, store.notify.entry_states) if e["source"] == "dashboard"]
    rule = "/settings/notify/entries/<entry_id>/delete"
    removed = await forms.post(rule, rule.replace("<entry_id>", added["id"]))
    assert removed == "/settings?done=notify_removed#notifications"

    # Sign-in and sign-out.
    assert await forms.post("/signout", "/signout") == "/signin"
    assert await forms.post("/signin", "/signin", token=dashboard.token, next="/runs", follow=False) == "/runs"

    every_form = {r.rule for r in outpost.pages.routes if r.method == "POST"}
    assert every_form - PREVIEWS == forms.posted, "a new form: post it here"


async def test_compose_shows_every_field_error_of_one_submit(dashboard, tmp_path):
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    response = await client.post("/schedules/review", headers={"Accept": "text/html"}, form={
        "csrf": csrf, "name": " ", "brief": "@print hi", "repository": "relative/path", "timing_kind": "cron",
        "expression": "61 * * * *", "timezone": "Mars/Olympus", "agent": "nobody", "timeout_seconds": "0"})
    page = await response.get_data(as_text=True)
    assert response.status_code == 422
    shown = set(re.findall(r'data-error-for="([^"]+)"', page))
    assert {"name", "repository", "agent", "limits.timeout_seconds"} <= shown, shown
    assert {"timing.timezone", "timing.expression"} <= shown, "a wrong timezone no longer hides a wrong cron"
    with pytest.raises(outpost.ValidationFailed) as refused:   # the API's problem+json carries them all too
        outpost.normalize_definition({"name": "", "brief": "", "repository": "/x", "timing": {}}, T0, agents=["demo"])
    assert [e["field"] for e in refused.value.errors] == ["name", "brief", "timing.timezone", "timing.kind"]
    assert refused.value.detail.startswith("name: ")


async def test_the_runs_page_filters_by_status(dashboard, tmp_path):
    """A status filter is the list's, never the page's HTTP status (it answered 500: int("failed"))."""
    ids = fill(dashboard.store, make_repo(tmp_path / "repo"))
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, dashboard.store, T0)
    failed = await client.get("/runs?status=failed", headers={"Accept": "text/html"})
    page = await failed.get_data(as_text=True)
    assert failed.status_code == 200 and ids["run_id"] in page
    assert '<option value="failed" selected>' in page
    none = await client.get("/runs?status=cancelled", headers={"Accept": "text/html"})
    assert none.status_code == 200 and ids["run_id"] not in await none.get_data(as_text=True)

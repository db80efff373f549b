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
    call(store, store.runs.notify_run, run_id, T0)
    agent_id = new_agent(store, "Worker", T0)
    task_id = new_task(store, "Write notes", T0, assignee_agent_id=agent_id)
    (office_run_id,), _ = call(store, store.pipeline.dispatch_wakeups, T0, {"demo": outpost.demo_profile()})
    routine = call(store, store.routines.create_routine, None,
                   outpost.normalize_routine({"name": "nightly", "assignee_agent_id": agent_id}),
                   [outpost.normalize_trigger({"kind": "webhook", "signing_mode": "hmac_sha256"}, 0, T0, "UTC")], T0)
    return {"schedule_id": schedule_id, "run_id": run_id, "agent_id": agent_id, "task_id": task_id,
            "routine_id": routine["id"], "office_run_id": office_run_id}


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
    assert len(PAGES) == 22


@pytest.mark.parametrize("rule", PAGES)
async def test_a_page_redirects_to_sign_in_when_signed_out(dashboard, rule):
    client = outpost.create_app(dashboard).test_client()
    response = await client.get(path_of(rule, dict.fromkeys(("schedule_id", "run_id", "agent_id", "task_id",
                                                              "routine_id", "office_run_id"), "x")))
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/signin?next=")


@pytest.mark.parametrize("rule", PAGES)
async def test_a_page_answers_on_an_empty_database(dashboard, rule):
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, dashboard.store, T0)
    missing = dict.fromkeys(("schedule_id", "run_id", "agent_id", "task_id", "routine_id", "office_run_id"),
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
    page = await response.get_data(as_text=True)
    assert response.status_code == 200, (rule, page[:500])
    for name in ("schedule_id", "run_id", "agent_id", "task_id", "routine_id"):
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

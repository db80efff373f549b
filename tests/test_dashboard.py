"""Dashboard pages in-process (the browser tests cover the flows in Chromium)."""

from __future__ import annotations

import re

import pytest
from conftest import T0, make_deps, normalized, sign_in_client

import outpost


@pytest.fixture
def signed_in(tmp_path, store):
    """Makes an in-process dashboard client on ``store`` with a signed-in session (wall clock)."""
    def client():
        deps = make_deps(tmp_path, store=store, clock=outpost.WallClock())
        c = outpost.create_app(deps).test_client()
        sign_in_client(c, store, outpost.WallClock().now())
        return c
    return client


async def test_the_schedules_page_shows_a_hundred_at_a_time(store, signed_in):
    ids = [store.transaction(store.schedules.create_schedule, normalized("/tmp", name=f"s{i:03}"), T0)[0]["id"]
           for i in range(outpost.SCHEDULES_PAGE + 1)]
    fired = store.transaction(store.schedules.fire_manual, ids[-1], 1, T0)[0]["run_id"]   # the newest run, on page 2
    client = signed_in()

    first = await (await client.get("/schedules", headers={"Accept": "text/html"})).get_data(as_text=True)
    names = re.findall(r'href="/schedules/sch_\w+">(s\d{3})</a>', first)
    assert names == [f"s{i:03}" for i in range(100)]
    assert "1-100 of 101" in first and "?page=2" in first
    second = await (await client.get("/schedules?page=2")).get_data(as_text=True)
    assert re.findall(r'href="/schedules/sch_\w+">(s\d{3})</a>', second) == ["s100"]
    assert f'href="/runs/{fired}"' in second and "never ran" not in second
    assert first.count("never ran") == 100
    assert "?page=1" in second and "?page=3" not in second


def sweep_every_5_minutes(store: outpost.Store, sweeps: int) -> None:
    """A task assigned with no wakeup for it (assigned behind the API: a paused agent's wakeups
    now wait for it instead of ending), then ``sweeps`` recovery sweeps 5 minutes apart: the
    first recovers the task, the rest find its wakeup queued."""
    idle = outpost.normalize_agent({"name": "w", "executor": "demo"}, profiles=["demo"])
    agent = store.transaction(store.office.create_agent, None, idle, T0)[0]
    task = store.transaction(store.office.create_task, None, outpost.normalize_task({"title": "t"}, profiles=["demo"]),
                             T0)[0]

    def assign_behind_the_api():
        store.db.Task[task["id"]].assignee_agent_id = agent["id"]
    store.transaction(assign_behind_the_api)
    for k in range(sweeps):
        store.transaction(store.routines.recovery_sweep, T0 + outpost.timedelta(minutes=5 * k))


async def test_the_activity_page_lists_empty_recovery_sweeps_only_when_asked(store, signed_in):
    sweep_every_5_minutes(store, 12)
    client = signed_in()
    page = await (await client.get("/office/activity")).get_data(as_text=True)
    assert "recovery_dispatch" in page and page.count("recovery_sweep_complete</span>") == 1   # the one that found it
    filtered = await (await client.get("/office/activity?code=recovery_sweep_complete")).get_data(as_text=True)
    assert filtered.count("recovery_sweep_complete</span>") == 12


async def test_days_of_empty_recovery_sweeps_do_not_bury_the_activity_page(store, signed_in):
    sweep_every_5_minutes(store, 1101)   # four days of sweeps that find nothing after the first
    client = signed_in()
    page = await (await client.get("/office/activity")).get_data(as_text=True)
    assert "recovery_dispatch</span>" in page and page.count("recovery_sweep_complete</span>") == 1
    newest = store.transaction(store.office.list_activity, None, None, 1000)[0]
    assert {x["code"] for x in newest} == {"recovery_sweep_complete"}   # the API still lists every sweep


async def test_a_task_page_lists_its_own_wakeups_however_many_newer_ones_the_workspace_has(store, signed_in):
    agent = store.transaction(store.office.create_agent, None, outpost.normalize_agent({"name": "w",
                                                                                        "executor": "demo"},
                                                                       profiles=["demo"]), T0)[0]

    def assigned(title: str, minutes: int) -> str:
        fields = outpost.normalize_task({"title": title, "assignee_agent_id": agent["id"]}, profiles=["demo"])
        return store.transaction(store.office.create_task, None, fields,
                                 T0 + outpost.timedelta(minutes=minutes))[0]["id"]
    first = assigned("first", 0)
    for k in range(1, 251):   # newer wakeups of other tasks
        assigned(f"other {k}", k)
    (own,) = store.transaction(store.office.list_wakeups, None, None, None, None, 1000, first)[0]
    client = signed_in()
    page = await (await client.get(f"/office/tasks/{first}")).get_data(as_text=True)
    assert page.count("data-wakeup=") == 1 and f'data-wakeup="{own["id"]}"' in page


async def test_a_comments_mentions_show_who_it_woke_and_which_names_are_no_agent(store, signed_in):
    """A newcomer posting "@Ghost and @Worker" was told only "Comment posted."."""
    worker = store.transaction(store.office.create_agent, None, outpost.normalize_agent(
        {"name": "Worker", "executor": "demo"}, profiles=["demo"]), T0)[0]
    fields = outpost.normalize_task({"title": "t"}, profiles=["demo"])
    tid = store.transaction(store.office.create_task, None, fields, T0)[0]["id"]
    store.transaction(store.office.add_comment, tid, "@Ghost and @worker, check this", T0)
    page = await (await signed_in().get(f"/office/tasks/{tid}")).get_data(as_text=True)
    assert ('Mentions: <span class="warn-text">Ghost (no agent of that name: woke nobody)</span>, '
            f'<a href="/office/agents/{worker["id"]}">Worker</a>') in page

"""One page per run (issue 36): an Office run's /runs/<id> with its agent, task and wakeup, the old
/office/runs/<id> a redirect; the run's instants to the second and its timeline; the raw log as a
download; the task page's live status while its agent works, ids linked, open blockers only."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import (
    T0,
    call,
    dispatch,
    ended,
    make_deps,
    make_repo,
    new_agent,
    new_task,
    normalized,
    set_settings,
    sign_in_client,
    start,
)

import outpost

SEC = timedelta(seconds=1)


@pytest.fixture
def dashboard(tmp_path: Path):
    deps = make_deps(tmp_path)
    yield deps
    deps.store.close()


async def get(deps: outpost.Deps, path: str):
    client = outpost.create_app(deps).test_client()
    sign_in_client(client, deps.store, T0)
    return await client.get(path)


async def page_of(deps: outpost.Deps, path: str) -> str:
    response = await get(deps, path)
    assert response.status_code == 200, path
    return await response.get_data(as_text=True)


def part(page: str, element_id: str) -> str:
    """The element with this id, up to the end of its tag's first closing (enough for a <p> or a <div>)."""
    m = re.search(rf'<(\w+)[^>]*id="{element_id}"[^>]*>(.*?)</\1>', page, re.S)
    assert m, element_id
    return " ".join(m[2].split())


def office_setup(store: outpost.Store, repo: Path) -> tuple[str, str]:
    set_settings(store, repository=str(repo))
    agent = new_agent(store, "ada")
    return agent, new_task(store, "Write the release notes", assignee_agent_id=agent)


# --- one run, one page -------------------------------------------------------------------------------------

async def test_an_office_run_has_one_page_that_links_its_agent_task_and_wakeup(tmp_path, dashboard):
    store = dashboard.store
    agent, task = office_setup(store, make_repo(tmp_path / "repo"))
    (run_id,) = dispatch(store, T0)
    wakeup_id = call(store, store.office.office_run, run_id)["wakeup_id"]

    old = await get(dashboard, f"/office/runs/{run_id}?raw=1")
    assert old.status_code == 303 and old.headers["Location"] == f"/runs/{run_id}?raw=1"

    page = await page_of(dashboard, f"/runs/{run_id}")
    origin = part(page, "run-origin")
    assert f'<a href="/office/agents/{agent}">ada</a>' in origin
    assert f'<a id="run-task" href="/office/tasks/{task}">Write the release notes</a>' in origin
    assert f'href="/office/wakeups?agent_id={agent}#wakeup-{wakeup_id}"' in origin and wakeup_id[-8:] in origin
    assert "one-shot dispatch" not in page
    assert 'id="prompt-tab"' in page and 'id="assembled-prompt"' in page and 'id="context-snapshot"' in page
    assert 'id="run-controls"' in page   # the run's controls, on the same page as its tabs

    # Every link to an Office run names the one page; the wakeup the run page links is there.
    wakeups = await page_of(dashboard, "/office/wakeups")
    assert f'id="wakeup-{wakeup_id}"' in wakeups and f'href="/runs/{run_id}"' in wakeups
    for path in ("/office/wakeups", f"/office/agents/{agent}", f"/office/tasks/{task}"):
        assert "/office/runs/" not in await page_of(dashboard, path), path


async def test_an_unknown_office_run_is_404_not_a_redirect(dashboard):
    assert (await get(dashboard, "/office/runs/out_nope")).status_code == 404


async def test_a_schedule_run_page_shows_its_instants_to_the_second_and_its_timeline(tmp_path, dashboard):
    store = dashboard.store
    repo = make_repo(tmp_path / "repo")
    set_settings(store, repository=str(repo))
    schedule_id = call(store, store.schedules.create_schedule, normalized(repo), T0)["id"]
    run_id = call(store, store.schedules.fire_manual, schedule_id, 1, T0)["run_id"]
    call(store, store.runs.admit_ready, 2, T0 + 2 * SEC)
    steps = {"worktree_ready": T0 + 2.4 * SEC, "agent_started": T0 + 2.5 * SEC, "first_output": T0 + 3.5 * SEC,
             "agent_exited": T0 + 75 * SEC, "branch_back": T0 + 75.5 * SEC}
    call(store, store.runs.settle_run, run_id, ended(outpost.RunStatus.SUCCEEDED), T0 + 76 * SEC, commits=1,
         steps={k: outpost.instant_ms(v) for k, v in steps.items()})
    page = await page_of(dashboard, f"/runs/{run_id}")
    assert "2026-11-30 08:00:00 UTC" in part(page, "run-queued")
    started = part(page, "run-started")
    assert "2026-11-30 08:00:02 UTC" in started and "(2.0 s in the queue)" in started
    assert "2026-11-30 08:01:16 UTC" in part(page, "run-finished")
    rows = re.findall(r'<tr data-step="(\w+)">\s*<td data-label="Step">([^<]+)</td>\s*<td data-label="At">'
                      r'<time[^>]*>([^<]+)</time></td>\s*<td class="num"[^>]*>([^<]+)</td>\s*'
                      r'<td class="num"[^>]*>([^<]+)</td>', page)
    assert rows == [
        ("queued", "Queued", "08:00:00.000", "-", "0.00 s"),
        ("worktree_ready", "Worktree ready", "08:00:02.400", "+2.4 s", "2.4 s"),
        ("agent_started", "Agent started", "08:00:02.500", "+0.10 s", "2.5 s"),
        ("first_output", "First output", "08:00:03.500", "+1.0 s", "3.5 s"),
        ("agent_exited", "Agent exited", "08:01:15.000", "+1 m 11 s", "1 m 15 s"),
        ("branch_back", "Branch brought back", "08:01:15.500", "+0.50 s", "1 m 15 s"),
        ("settled", "Settled", "08:01:16.000", "+0.50 s", "1 m 16 s")]


async def test_the_queued_banner_goes_once_the_run_is_not_queued(tmp_path, dashboard):
    store = dashboard.store
    repo = make_repo(tmp_path / "repo")
    schedule_id = call(store, store.schedules.create_schedule, normalized(repo), T0)["id"]
    run_id = call(store, store.schedules.fire_manual, schedule_id, 1, T0)["run_id"]
    assert "this run is queued" in part(await page_of(dashboard, f"/runs/{run_id}?done=admitted"), "flash")
    call(store, store.runs.admit_ready, 2, T0)
    # The live refresh reloads the same address: the notice of the queue is gone with the queue.
    flash = part(await page_of(dashboard, f"/runs/{run_id}?done=admitted"), "flash")
    assert flash == "Fired: this run has started; it updates live here."


async def test_the_raw_log_downloads_under_the_session_cookie(tmp_path, dashboard):
    store = dashboard.store
    repo = make_repo(tmp_path / "repo")
    schedule_id = call(store, store.schedules.create_schedule, normalized(repo), T0)["id"]
    run_id = call(store, store.schedules.fire_manual, schedule_id, 1, T0)["run_id"]
    dashboard.log_path(run_id).parent.mkdir(parents=True, exist_ok=True)
    dashboard.log_path(run_id).write_text("one\ntwo <b>\n")
    page = await page_of(dashboard, f"/runs/{run_id}")
    assert f'<a class="btn" id="log-download" href="/runs/{run_id}/log" download="{run_id}.log">' in page
    assert 'id="log-search"' in page
    response = await get(dashboard, f"/runs/{run_id}/log")
    assert response.status_code == 200 and await response.get_data(as_text=True) == "one\ntwo <b>\n"
    assert response.headers["Content-Disposition"] == f'attachment; filename="{run_id}.log"'
    signed_out = await outpost.create_app(dashboard).test_client().get(f"/runs/{run_id}/log")
    assert signed_out.status_code == 302 and signed_out.headers["Location"].startswith("/signin")


async def test_each_log_line_shows_when_it_began_in_the_schedules_zone(tmp_path, dashboard):
    """Issue 36: the log with line timestamps. The time is the span's data-t (CSS draws it), so
    the log's text, what search and copy see, stays exactly what the agent printed."""
    store = dashboard.store
    repo = make_repo(tmp_path / "repo")
    berlin = {"kind": "cron", "expression": "0 0 1 1 *", "timezone": "Europe/Berlin"}
    schedule_id = call(store, store.schedules.create_schedule, normalized(repo, timing=berlin), T0)["id"]
    run_id = call(store, store.schedules.fire_manual, schedule_id, 1, T0)["run_id"]
    at = [T0]
    sink = outpost.LogSink(dashboard.log_path(run_id), lambda: at[0])
    sink.write(b"cloning\n")
    at[0] = T0 + 65 * SEC
    sink.write(b"tests <b>passed</b>\ndone")
    sink.close()
    page = await page_of(dashboard, f"/runs/{run_id}")
    log = re.search(r'<pre class="log" id="run-log"[^>]*data-tz="Europe/Berlin"[^>]*>(.*?)</pre>', page, re.S)
    assert log, "the log says the zone its times are in"
    assert re.findall(r'<span class="log-block" data-t="([\d:]+)">([^<]*)</span>', log[1]) == [
        ("09:00:00", "cloning\n"), ("09:01:05", "tests &lt;b&gt;passed&lt;/b&gt;\ndone")]
    response = await get(dashboard, f"/runs/{run_id}/log")   # the download: the log as printed, no times
    assert await response.get_data(as_text=True) == "cloning\ntests <b>passed</b>\ndone"


async def test_a_log_of_a_million_empty_lines_is_one_block_on_the_page(tmp_path, dashboard):
    """A hostile agent's output cannot blow the page up: lines of one second are one span."""
    store = dashboard.store
    schedule_id = call(store, store.schedules.create_schedule, normalized(make_repo(tmp_path / "repo")), T0)["id"]
    run_id = call(store, store.schedules.fire_manual, schedule_id, 1, T0)["run_id"]
    sink = outpost.LogSink(dashboard.log_path(run_id), lambda: T0)
    sink.write(b"\n" * 1_000_000)
    sink.close()
    page = await page_of(dashboard, f"/runs/{run_id}")
    assert page.count('class="log-block"') == 1 and len(page) < 1_200_000


# --- the task page while its agent works -------------------------------------------------------------------

async def test_the_task_page_says_who_works_on_it_with_a_link_to_the_live_log(tmp_path, dashboard):
    store = dashboard.store
    agent, task = office_setup(store, make_repo(tmp_path / "repo"))
    page = await page_of(dashboard, f"/office/tasks/{task}")   # assigned: its wakeup waits
    (wakeup,) = call(store, store.office.list_wakeups, None, agent, "queued", None, 10)
    live = part(page, "task-live")
    assert f'A wakeup of <a href="/office/agents/{agent}">ada</a> is queued for it' in live
    assert f'<a href="#wakeup-{wakeup["id"]}" title="{wakeup["id"]}"><span class="mono">{wakeup["id"][-8:]}' in live
    assert f'id="wakeup-{wakeup["id"]}"' in page   # the row that link lands on

    (run_id,) = dispatch(store, T0)
    live = part(await page_of(dashboard, f"/office/tasks/{task}"), "task-live")
    assert "ada</a> is about to work on it" in live and "is queued" in live

    start(store, run_id, T0)
    page = await page_of(dashboard, f"/office/tasks/{task}")
    live = part(page, "task-live")
    assert f'<a href="/office/agents/{agent}">ada</a> is working on it: run <a href="/runs/{run_id}"' in live
    assert re.search(r'started <span data-since="2026-11-30T08:00:00Z">[^<]+</span> ago', live)
    assert f'<a href="/runs/{run_id}#log-panel" class="live-log-link">Follow its live log</a>' in live
    assert 'id="main" data-live="1"' in page   # it refreshes on the event stream

    call(store, store.runs.settle_run, run_id, ended(outpost.RunStatus.SUCCEEDED), T0 + 60 * SEC)
    page = await page_of(dashboard, f"/office/tasks/{task}")
    assert 'id="task-live"' not in page


async def test_a_merged_wakeup_links_the_wakeup_it_was_merged_into(tmp_path, dashboard):
    store = dashboard.store
    agent, task = office_setup(store, make_repo(tmp_path / "repo"))
    for i in range(2):   # the second within the first's window: merged into it
        call(store, store.wakeups.enqueue_wakeup, outpost.DEFAULT_WORKSPACE, agent,
             outpost.WakeupSource.TASK_CHILDREN_COMPLETED, {"task_id": task}, T0 + i * SEC)
    rows = call(store, store.office.list_wakeups, None, agent, None, None, 10)
    merged = [w for w in rows if w["status"] == "coalesced"]
    assert merged, rows
    page = await page_of(dashboard, f"/office/tasks/{task}")
    into = merged[0]["coalesced_into"]
    assert f'<a href="/office/wakeups?agent_id={agent}#wakeup-{into}" data-wakeup-link="{into}">Merged into' in page


# --- blocked by: only blockers still open ---------------------------------------------------------------------

def card(page: str, task_id: str) -> str:
    return re.search(rf'id="card-{task_id}".*?</article>', page, re.S)[0]


async def test_the_blocked_badge_counts_only_open_blockers_and_no_done_card_has_one(tmp_path, dashboard):
    store = dashboard.store
    set_settings(store, repository=str(make_repo(tmp_path / "repo")))
    first, other = new_task(store, "First"), new_task(store, "Other")
    blocked = new_task(store, "Blocked", blocked_by=[first, other])
    finished = new_task(store, "Finished", blocked_by=[other])
    call(store, store.office.move_task, finished, "DONE", T0)
    board = await page_of(dashboard, "/office/board")
    assert ">blocked by 2</span>" in card(board, blocked)
    assert "blocked by" not in card(board, finished)   # a Done card is blocked by nothing
    assert "blocked by 2" in part(await page_of(dashboard, f"/office/tasks/{blocked}"), "task-blocked")

    call(store, store.office.move_task, first, "DONE", T0)
    board = await page_of(dashboard, "/office/board")
    assert ">blocked by 1</span>" in card(board, blocked)
    call(store, store.office.move_task, other, "CANCELLED", T0)
    board = await page_of(dashboard, "/office/board")
    assert "blocked by" not in card(board, blocked)
    page = await page_of(dashboard, f"/office/tasks/{blocked}")
    assert 'id="task-blocked"' not in page and 'id="blockers"' in page   # the list stays, with their states

"""The Office and run pages as a user reads them (issue 28): the repository banner only when
Office cannot run, a repository refused at save, titles instead of ids, the running badge,
transcripts of agent logs, empty charts, the "Agent CLIs" label and costs. In process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import T0, call, dispatch, make_deps, make_repo, new_agent, new_task, set_settings, sign_in_client, start

import outpost


@pytest.fixture
def dashboard(tmp_path: Path):
    deps = make_deps(tmp_path)
    yield deps
    deps.store.close()


async def page_of(deps: outpost.Deps, path: str, status: int = 200) -> str:
    client = outpost.create_app(deps).test_client()
    sign_in_client(client, deps.store, T0)
    response = await client.get(path)
    assert response.status_code == status, path
    return await response.get_data(as_text=True)


# --- the repository: a banner only when Office cannot run, refused at save when missing -----------------

async def test_no_repository_banner_while_the_embedded_repository_runs_office(dashboard):
    store = dashboard.store
    for path in ("/office/board", "/office/agents", "/office/wakeups", "/office/routines"):
        assert 'id="no-repository"' not in await page_of(dashboard, path)
    agent = new_agent(store, "builder")
    new_task(store, "Write notes", assignee_agent_id=agent)

    def wait_for_repository():   # what the dispatcher records when the repository is gone
        for w in store.db.Wakeup.select(lambda w: w.status == "queued"):
            w.last_error = "repository unavailable: repository /srv/gone does not exist"
    call(store, wait_for_repository)
    banner = re.search(r'id="no-repository">(.*?)</div>', await page_of(dashboard, "/office/board"), re.S)[1]
    assert "waiting for their repository" in banner and "/srv/gone does not exist" in banner


async def test_the_settings_api_refuses_a_repository_that_does_not_exist(tmp_path, dashboard):
    from conftest import OfficeApi, assert_problem
    api = OfficeApi(dashboard, tmp_path)
    missing = await api.patch("/api/office/settings", {"repository": str(tmp_path / "nope")})
    assert_problem(missing, 422, "validation_failed", "repository")
    (tmp_path / "plain").mkdir()
    assert_problem(await api.patch("/api/office/settings", {"repository": str(tmp_path / "plain")}), 422,
                   "validation_failed", "repository")
    repo = make_repo(tmp_path / "repo")
    assert_problem(await api.patch("/api/office/settings", {"repository": str(repo), "source_ref": "no-such-branch"}),
                   422, "validation_failed", "source_ref")
    assert (await api.get("/api/office/settings")).body["repository"] is None   # nothing was saved
    saved = await api.patch("/api/office/settings", {"repository": str(repo)})
    assert saved.status == 200 and saved.body["repository"] == str(repo)


async def test_the_settings_form_names_a_missing_repository(tmp_path, dashboard):
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    response = await client.post("/office/settings", form={"csrf": csrf, "name": "Default", "timezone": "UTC",
                                                           "repository": str(tmp_path / "nope"),
                                                           "recovery_lookback_hours": "24"})
    assert response.status_code == 422
    page = await response.get_data(as_text=True)
    error = re.search(r'<label class="has-error">Repository.*?<span class="field-error">(.*?)</span>', page, re.S)
    assert error and "is not an existing git repository" in error[1]
    assert call(dashboard.store, dashboard.store.office.office_settings, None)["repository"] is None


# --- titles, running badge, plurals ----------------------------------------------------------------------

def office_run(store: outpost.Store, title: str, repo: Path) -> tuple[str, str, str]:
    """An agent with a task and the run its wakeup started: (agent id, task id, run id)."""
    set_settings(store, repository=str(repo))
    agent = new_agent(store, "builder")
    task = new_task(store, title, assignee_agent_id=agent)
    (run_id,) = dispatch(store, T0)
    return agent, task, run_id


async def test_office_tables_name_tasks_by_title_not_by_id(tmp_path, dashboard):
    agent, task, run_id = office_run(dashboard.store, "Write the release notes", make_repo(tmp_path / "repo"))
    for path in (f"/office/agents/{agent}", "/office/wakeups"):
        page = await page_of(dashboard, path)
        assert f'<a href="/office/tasks/{task}">Write the release notes</a>' in page, path
        assert task[-8:] + "<" not in page
    assert f'<a href="/office/agents/{agent}">builder</a>' in await page_of(dashboard, "/office/wakeups")


async def test_the_board_marks_a_task_whose_agent_is_running(tmp_path, dashboard):
    agent, task, run_id = office_run(dashboard.store, "Write the release notes", make_repo(tmp_path / "repo"))
    card = re.search(rf'id="card-{task}".*?</article>', await page_of(dashboard, "/office/board"), re.S)[0]
    assert "data-running" not in card   # queued, not yet running
    start(dashboard.store, run_id, T0)
    card = re.search(rf'id="card-{task}".*?</article>', await page_of(dashboard, "/office/board"), re.S)[0]
    assert re.search(rf'data-running="{agent}">running: builder</span>', card)


@pytest.mark.parametrize(("commits", "words"), [(0, "0 commits"), (1, "1 commit"), (2, "2 commits")])
async def test_the_office_run_page_counts_commits_in_good_english(tmp_path, dashboard, commits, words):
    _, _, run_id = office_run(dashboard.store, "t", make_repo(tmp_path / "repo"))

    def committed():
        dashboard.store.db.Run[run_id].commits = commits
    call(dashboard.store, committed)
    assert f"({words})</dd>" in await page_of(dashboard, f"/office/runs/{run_id}")


# --- charts, labels, costs -------------------------------------------------------------------------------

async def test_a_chart_with_no_runs_says_so(dashboard):
    page = await page_of(dashboard, "/runs")
    chart = re.search(r'id="runs-chart">(.*?)</div>', page, re.S)[1]
    assert "No runs in the last 30 days" in chart and "<rect" not in chart and "chart-legend" not in chart


async def test_the_cli_profiles_page_is_called_agent_clis(dashboard):
    page = await page_of(dashboard, "/agents")
    assert '<a href="/agents" class="active">Agent CLIs</a>' in page
    assert "<title>Agent CLIs · Outpost</title>" in page and "<h1>Agent CLIs</h1>" in page
    assert '<a href="/office/agents" class="">Agents</a>' in await page_of(dashboard, "/office/board")


@pytest.mark.parametrize(("cost", "shown"), [(None, "-"), (0, "$0.00"), (0.0123, "$0.0123"), (0.5, "$0.50"),
                                             (0.00042, "$0.00042"), (0.9999, "$1.00"), (1.234, "$1.23"),
                                             (1234.5, "$1,234.50")])
def test_costs_under_a_dollar_keep_their_significant_digits(cost, shown):
    assert outpost.TEMPLATE_FILTERS["usd"](cost) == shown

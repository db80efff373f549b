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
    response = await client.get(path, follow_redirects=True)   # /office/runs/<id>: the run page
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
    error = re.search(r'<label class="has-error">Repository.*?<span class="field-error"[^>]*>(.*?)</span>', page, re.S)
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
    assert f'id="commit-count">{words}</dd>' in await page_of(dashboard, f"/office/runs/{run_id}")


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


# --- a run's log as a transcript -------------------------------------------------------------------------

RECORDED = Path(__file__).parent / "fakes" / "recorded"


def claude_run(deps: outpost.Deps, repo: Path, log: str, *, settled: bool = True) -> str:
    """An Office run whose agent printed ``log`` (Claude Code's stream-json), settled or running."""
    store = deps.store
    _, _, run_id = office_run(store, "t", repo)
    start(store, run_id, T0)
    deps.log_path(run_id).parent.mkdir(parents=True, exist_ok=True)
    deps.log_path(run_id).write_text(log)
    if settled:
        reading = outpost.read_claude(log.splitlines())
        outcome = outpost.Outcome(outpost.RunStatus.SUCCEEDED, None, None, None, reading=reading)
        assert call(store, store.runs.settle_run, run_id, outcome, T0)
    return run_id


async def test_a_claude_log_reads_as_a_transcript_with_its_tool_call_and_result(tmp_path, dashboard):
    recorded = __import__("json").loads((RECORDED / "claude-tool.json").read_text())["stdout"]
    run_id = claude_run(dashboard, make_repo(tmp_path / "repo"), recorded)
    for path in (f"/office/runs/{run_id}", f"/runs/{run_id}"):
        page = await page_of(dashboard, path)
        shown = re.search(r'<ol class="plain transcript" id="run-transcript">(.*?)</ol>', page, re.S)[1]
        kinds = re.findall(r'data-kind="(\w+)"', shown)
        assert kinds == ["session", "tool", "tool_result", "message", "result"], path
        assert re.search(r'<strong class="mono">Bash</strong> <code>git push origin HEAD</code>', shown)
        assert "error: This command requires approval" in shown
        assert "Done: the stub model answered." in shown and "cost $0.0377" in shown and "2 turns" in shown
        raw = re.search(r'<details id="raw-log"><summary>Raw log</summary>\s*<pre class="log" id="run-log"[^>]*>(.*?)'
                        r'</pre>', page, re.S)[1]
        assert "&#34;type&#34;:&#34;result&#34;" in raw   # every raw line, behind the toggle
    assert '<details id="raw-log" open>' in await page_of(dashboard, f"/runs/{run_id}?raw=1")


async def test_a_hostile_log_is_escaped_and_clipped_in_the_transcript(tmp_path, dashboard):
    json = __import__("json")
    hostile = [{"type": "system", "subtype": "init", "model": "<img src=x onerror=alert(1)>", "session_id": 7},
               {"type": "assistant", "message": {"content": [{"type": "text", "text": "<script>alert(1)</script>"},
                                                             {"type": "tool_use", "name": "</pre><script>",
                                                              "input": {"command": "x" * 100_000}}]}},
               {"type": "user", "message": {"content": [{"type": "tool_result",
                                                         "content": [{"type": "text", "text": "y" * 500_000}]}]}},
               {"type": "assistant", "message": "not a dict"}, {"type": "user", "message": {"content": [None, 3]}},
               {"type": "result", "subtype": "success", "result": {"not": "text"}, "total_cost_usd": "lots"}]
    log = "\n".join(json.dumps(e) for e in hostile) + "\n" + "[" * 100_000 + "\n" + "plain </pre> line\n"
    run_id = claude_run(dashboard, make_repo(tmp_path / "repo"), log * 3)
    page = await page_of(dashboard, f"/office/runs/{run_id}")
    shown = re.search(r'id="run-transcript">(.*?)</ol>', page, re.S)[1]
    assert "<script>" not in page.replace('<script src="/static/outpost.js', "") and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in shown and "&lt;/pre&gt;&lt;script&gt;" in shown
    assert len(shown) < 30_000   # 1.8 MB of log, clipped: 300 characters of input, 800 of a result
    assert "(99,700 more characters)" in shown and "(499,200 more characters)" in shown


async def test_a_running_log_stays_raw_and_followed_live(tmp_path, dashboard):
    recorded = __import__("json").loads((RECORDED / "claude-tool.json").read_text())["stdout"]
    run_id = claude_run(dashboard, make_repo(tmp_path / "repo"), recorded, settled=False)
    page = await page_of(dashboard, f"/office/runs/{run_id}")
    assert 'id="run-transcript"' not in page and 'data-following="1"' in page


def test_codex_and_gemini_logs_read_as_transcripts():
    json = __import__("json")
    codex = json.loads((RECORDED / "codex-success.json").read_text())["stdout"] + json.dumps(
        {"type": "item.completed", "item": {"type": "command_execution", "command": "ls", "aggregated_output": "a\n",
                                            "exit_code": 2}})
    entries = outpost.transcript(codex, "codex")["entries"]
    assert [e["kind"] for e in entries] == ["session", "message", "result", "tool", "tool_result"]
    assert entries[-1]["error"] and entries[-1]["text"].endswith("(exit code 2)")
    gemini = outpost.transcript(json.loads((RECORDED / "gemini-tool.json").read_text())["stdout"], "gemini")["entries"]
    assert [(e["kind"], e.get("role")) for e in gemini] == [
        ("session", None), ("message", "user"), ("tool", None), ("tool_result", None), ("message", "assistant"),
        ("result", None)]
    assert gemini[2]["name"] == "run_shell_command" and gemini[2]["text"] == "git push origin HEAD"
    assert outpost.transcript("plain text\n", "claude-code") is None and outpost.transcript("{}", "generic") is None

"""The run page in a real browser (issue 36): the timeline of a real run, the log's search box,
the raw log's download, the queued banner that goes once the run starts, and the task page
that says, live, who works on it."""

from __future__ import annotations

import re
import uuid

import chromium
import test_browser
from test_browser import ARTIFACTS, shot, sign_in

#: Chromium and a signed-out page (tests/browser/chromium.py), test_browser's server and repository.
browser, page, server, repo = chromium.browser, chromium.page, test_browser.server, test_browser.repo


def keyed() -> dict[str, str]:
    return {"Idempotency-Key": uuid.uuid4().hex}


def create(api, repository, name: str, brief: str) -> str:
    raw = {"name": name, "brief": brief, "repository": str(repository), "agent": "demo",
           "timing": {"kind": "cron", "expression": "0 0 1 1 *", "timezone": "Europe/Berlin"}}
    composed = api.post("/v1/outpost/schedules/compose", json=raw).json()
    created = api.post("/v1/outpost/schedules", headers=keyed(),
                       json={"definition": composed["definition"], "confirmation": composed["confirmation"]})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def test_a_run_page_shows_its_timeline_and_its_log_can_be_searched_and_downloaded(page, server, repo):
    with server.client() as api:
        schedule_id = create(api, repo, "timeline-look",
                             "@print alpha one\n@print beta two\n@sleep 1.5\n@print gamma three\n@commit notes.txt hi")
    sign_in(page, server)
    page.goto(f"{server.url}/schedules/{schedule_id}")
    page.click("#schedule-controls button[data-action=fire]")
    page.wait_for_url(re.compile(r".*/runs/out_\w+\?done=admitted"))
    run_id = page.url.rsplit("/", 1)[1].split("?")[0]
    # Live: the page follows the run to its end, and the banner about the queue is gone.
    page.wait_for_selector("#run-status.succeeded", timeout=30_000)
    assert page.inner_text("#flash") == "Fired: this run has started; it updates live here."
    page.wait_for_selector("#run-timeline tr[data-step=settled]")

    steps = page.locator("#run-timeline tr[data-step]")
    assert [steps.nth(i).get_attribute("data-step") for i in range(steps.count())] == [
        "queued", "worktree_ready", "agent_started", "first_output", "agent_exited", "branch_back", "settled"]
    shown = page.locator("#run-timeline td[data-label=At]").all_inner_texts()
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", t.strip()) for t in shown), shown
    after = page.locator("#run-timeline tr[data-step=agent_exited] td").nth(2).inner_text()
    assert re.fullmatch(r"\+\d\.\d s", after), after   # the agent slept 1.5 s after its first line
    assert re.search(r"\d\d:\d\d:\d\d CET", page.inner_text("#run-queued"))   # the schedule's zone, to the second

    log = page.locator("#run-log")
    assert "alpha one" in log.inner_text() and "gamma three" in log.inner_text()
    page.fill("#log-search", "BETA")   # case does not matter
    assert log.inner_text().strip() == "beta two"
    assert page.locator("#run-log mark").all_inner_texts() == ["beta"]
    assert page.inner_text("#log-matches") == "1 matching line"
    shot(page, "run-page-search")
    page.fill("#log-search", "")
    assert "alpha one" in log.inner_text() and page.locator("#run-log mark").count() == 0

    with page.expect_download() as download:
        page.click("#log-download")
    assert download.value.suggested_filename == f"{run_id}.log"
    assert "gamma three" in download.value.path().read_text()

    page.goto(f"{server.url}/runs/{run_id}")   # the page down to its timeline (docs/img/run-timeline.png)
    # Each line shows the second it began (CET, the schedule's zone), drawn before it by CSS and
    # outside its text: the log's text is the download's, byte for byte.
    blocks = page.locator("#run-log .log-block").evaluate_all(
        "spans => spans.map(s => [s.dataset.t, getComputedStyle(s, '::before').content, s.textContent])")
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", t) and before == f'"{t}"' for t, before, _ in blocks), blocks
    second = {line: t for t, _, text in blocks for line in text.splitlines()}
    assert second["alpha one"] != second["gamma three"], "gamma was printed 1.5 s after alpha, in a later second"
    assert page.locator("#run-log").evaluate("el => el.textContent") == download.value.path().read_text()
    page.fill("#log-search", "gamma")
    assert page.locator("#run-log .log-block").evaluate_all("spans => spans.map(s => s.dataset.t)") == [
        second["gamma three"]]
    page.fill("#log-search", "")
    bottom = page.locator("#run-timeline").evaluate("el => el.getBoundingClientRect().bottom + window.scrollY")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "run-timeline.png"), full_page=True,
                    clip={"x": 0, "y": 0, "width": 1280, "height": bottom + 16})


def test_the_task_page_says_live_who_works_on_it_and_links_the_run(page, server, repo):
    with server.client() as api:
        agent = api.post("/api/office/agents", headers=keyed(),
                         json={"name": "ada", "executor": "demo", "cooldown_sec": 0}).json()["id"]
        sign_in(page, server)
        task = api.post("/api/office/tasks", headers=keyed(), json={
            "title": "Slow work", "description": "@print started\n@sleep 4\n@print done", "assignee_agent_id": agent,
        }).json()["id"]
        page.goto(f"{server.url}/office/tasks/{task}")
        page.wait_for_selector("#task-live:has-text('is working on it')", timeout=30_000)
        link = page.locator("#task-live a.live-log-link")
        run_id = link.get_attribute("href").split("/runs/")[1].split("#")[0]
        assert re.search(r"ada is working on it: run \w{8}, started (< 1 s|\d+ s) ago", page.inner_text("#task-live"))
        shot(page, "task-page-working")
        # When the run ends the status goes by itself (the page refreshes on the event stream).
        page.wait_for_selector("#task-live", state="detached", timeout=30_000)
        link_target = f"/runs/{run_id}"
        page.goto(server.url + link_target)
        assert page.inner_text("#run-origin").startswith("Office run of ada")
        assert page.locator("#run-task").inner_text() == "Slow work"

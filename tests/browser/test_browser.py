"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against the real
server and a real git repository. Screenshots of the main pages land in tests/artifacts/."""

from __future__ import annotations

import os
import re
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import chromium
import pytest
from conftest import Server, git, make_repo

import outpost

ARTIFACTS = Path(__file__).parent.parent / "artifacts"
#: Chromium and a signed-out page (tests/browser/chromium.py), fixtures of this module.
browser, page = chromium.browser, chromium.page

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return make_repo(tmp_path_factory.mktemp("browser") / "repo")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("browser-data") / "data").start()
    yield server
    server.stop()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def sign_in(page, server: Server) -> None:
    page.goto(server.url + "/schedules")
    assert page.url.endswith("/signin?next=/schedules")
    page.fill("input[name=token]", server.token)
    page.click("button[type=submit]")
    page.wait_for_url("**/schedules")


def compose(page, server: Server, repo: Path, name: str, brief: str) -> str:
    """Compose, review, confirm through the pages; the new schedule's id."""
    page.goto(server.url + "/schedules/new")
    page.fill("input[name=name]", name)
    page.fill("textarea[name=brief]", brief)
    page.fill("input[name=repository]", str(repo))
    page.check("input[name=timing_kind][value=cron]")
    page.fill("input[name=expression]", "30 2 * * *")
    page.fill("input[name=timezone]", "Europe/Berlin")
    page.click("#review-button")
    page.wait_for_selector("#review-summary")
    page.click("#confirm-button")
    page.wait_for_selector("#schedule-controls")
    return page.url.rsplit("/", 1)[1].split("?")[0]


def test_sign_in_with_the_token_then_sign_out(page, server):
    page.goto(server.url + "/signin")
    page.fill("input[name=token]", "not-the-token")
    page.click("button[type=submit]")
    assert "not the API token" in page.inner_text("#signin-error")
    shot(page, "signin")
    sign_in(page, server)
    assert "No schedules yet" in page.inner_text("#main")
    shot(page, "schedules-empty")
    cookie = next(c for c in page.context.cookies() if c["name"] == "outpost_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    page.click("text=Sign out")
    page.wait_for_url("**/signin")
    page.goto(server.url + "/runs")
    assert "/signin" in page.url


def test_the_one_time_sign_in_link_works_once(page, server):
    assert "/signin/" in server.signin_link
    page.goto(server.signin_link)
    page.wait_for_url("**/schedules")
    assert page.query_selector("#attention-count") is not None
    page.context.clear_cookies()
    page.goto(server.signin_link)
    assert "used already or has expired" in page.inner_text("#signin-error")


def test_compose_review_confirm_fire_and_watch_the_run_live(page, server, repo):
    sign_in(page, server)
    page.goto(server.url + "/schedules/new")
    shot(page, "compose")
    page.fill("input[name=name]", "bad one")
    page.fill("input[name=repository]", "relative/path")
    page.click("#review-button")
    assert "must be an absolute path" in page.inner_text("[data-error-for=repository]")

    page.fill("input[name=name]", "nightly-notes")
    page.fill("textarea[name=brief]", "Leave a note.\n@print working on {{date}}\n@sleep 2\n@commit notes.txt hello")
    page.fill("input[name=repository]", str(repo))
    page.fill("input[name=expression]", "30 2 * * *")
    page.fill("input[name=timezone]", "Europe/Berlin")
    page.click("#review-button")
    summary = page.inner_text("#review-summary")
    assert "Runs agent 'demo'" in summary and "Europe/Berlin" in summary
    assert len(page.query_selector_all("#review-fires li")) == 5
    assert "02:30 CE" in page.inner_text("#review-fires")
    assert "does not exist in Europe/Berlin" in page.inner_text("#review-warnings")
    shot(page, "review")
    page.click("#confirm-button")
    page.wait_for_selector("#schedule-controls")
    assert "Schedule created" in page.inner_text("#flash")
    shot(page, "schedule")

    page.click("button[data-action=fire]")   # Fire now lands on the new run's live page
    page.wait_for_url("**/runs/*?done=admitted")
    assert page.inner_text("#flash").startswith("Fired: this run")   # queued, or already started
    page.evaluate("window.__notReloaded = true")
    sync_api.expect(page.locator("#run-status")).to_have_text("running", timeout=15_000)
    sync_api.expect(page.locator("#run-status")).to_have_text("succeeded", timeout=30_000)
    assert page.evaluate("window.__notReloaded") is True, "the page reloaded instead of updating live"
    assert "working on" in page.inner_text("#run-log")
    assert page.inner_text("#commit-count") == "1 commit"
    assert "notes.txt" in page.inner_text("#changes-stat")
    head = git(repo, "rev-parse", "HEAD")
    assert page.inner_text("#resolved-commit") == head
    shot(page, "run")

    page.goto(server.url + "/runs")
    assert "succeeded" in page.inner_text("#runs-table")
    shot(page, "runs")


def test_acknowledge_the_attention_item(page, server, repo):
    sign_in(page, server)
    page.goto(server.url + "/attention")
    assert int(page.inner_text("#attention-count")) >= 1
    shot(page, "attention")
    first = page.query_selector("#attention-open tr")
    assert "returned 1 commit" in first.inner_text()
    while page.query_selector("#attention-open [data-ack]"):
        page.click("#attention-open [data-ack]")
    assert page.inner_text("#attention-count") == "0"
    assert "Nothing needs you" in page.inner_text("#attention-empty")


def test_a_stale_edit_is_refused_and_shows_the_difference(page, server, repo):
    sign_in(page, server)
    sid = compose(page, server, repo, "stale-demo", "@print v1")
    page.goto(f"{server.url}/schedules/{sid}/edit")
    page.fill("textarea[name=brief]", "@print mine")

    with server.client() as api:   # someone else edits the same schedule meanwhile
        compose_reply = api.post("/v1/outpost/schedules/compose", json={"schedule_id": sid, "brief": "@print theirs"})
        api.patch(f"/v1/outpost/schedules/{sid}", headers={"If-Match": '"1"', "Idempotency-Key": "other-edit"},
                  json={"changes": {"brief": "@print theirs"},
                        "confirmation": compose_reply.json()["confirmation"]}).raise_for_status()

    page.click("#review-button")
    page.click("#confirm-button")
    assert "Someone else changed stale-demo" in page.inner_text("#stale-edit")
    diff = page.inner_text("#stale-diff")
    assert "@print theirs" in diff and "@print mine" in diff
    shot(page, "stale-edit")
    with server.client() as api:
        assert api.get(f"/v1/outpost/schedules/{sid}").json()["brief"] == "@print theirs"


def test_a_cross_origin_post_is_refused(page, server, repo):
    sign_in(page, server)
    page.goto(server.url + "/attention")
    csrf = page.get_attribute('meta[name="csrf-token"]', "content")
    request = page.context.request
    cross = request.post(server.url + "/attention/ack-all", form={"csrf": csrf},
                         headers={"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"})
    assert cross.status == 403
    missing = request.post(server.url + "/attention/ack-all", form={})
    assert missing.status == 403
    same = request.post(server.url + "/attention/ack-all", form={"csrf": csrf}, headers={"Origin": server.url})
    assert same.ok


def test_pages_fit_a_phone(page, server):
    sign_in(page, server)
    page.set_viewport_size({"width": 390, "height": 800})
    for path, name in (("/schedules", "phone-schedules"), ("/runs", "phone-runs")):
        page.goto(server.url + path)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} scrolls sideways on a phone ({width}px)"
        shot(page, name)


def test_live_updates_resume_after_the_daemon_restarts(browser, repo, tmp_path_factory):
    """The page keeps its event stream across a daemon restart: new runs appear without a reload."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data_dir = tmp_path_factory.mktemp("restart") / "data"
    first = Server(data_dir, ("--port", str(port))).start()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        sign_in(page, first)
        page.goto(first.url + "/runs")
        assert page.query_selector("#runs-empty") is not None
        page.evaluate("window.__notReloaded = true")
        assert first.stop() == 0
        second = Server(data_dir, ("--port", str(port))).start()
        try:
            with second.client() as api:
                api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": "after-restart"},
                         json={"brief": "@print back", "repository": str(repo)}).raise_for_status()
            sync_api.expect(page.locator("#runs-table")).to_contain_text("succeeded", timeout=20_000)
            assert page.evaluate("window.__notReloaded") is True, "the page reloaded instead of reconnecting"
        finally:
            second.stop()
    finally:
        context.close()


def test_what_is_typed_while_a_live_refresh_is_on_its_way_is_kept(page, server, repo):
    """A live page's refresh asks for the page, then swaps it in: a search typed into the page
    while that answer was on its way is not wiped by the swap."""
    import urllib.parse
    sign_in(page, server)
    page.goto(server.url + "/runs")
    held = []

    def the_refresh(request) -> bool:
        return request.resource_type == "fetch" and urllib.parse.urlsplit(request.url).path == "/runs"
    page.route(lambda url: urllib.parse.urlsplit(url).path == "/runs",
               lambda route: held.append(route) if the_refresh(route.request) else route.continue_())
    # the page's own fetch, whose answer it has read: the swap follows in the same task
    page.evaluate("""() => { const fetched = window.fetch; window.fetch = async (...args) => {
        const reply = await fetched(...args), text = reply.text.bind(reply);
        reply.text = async () => { const body = await text(); window.__refreshRead = true; return body; };
        return reply; }; }""")
    with page.expect_request(the_refresh), api_client(server) as api:
        api.post("/v1/outpost/dispatches", headers=keyed(),   # an event: the page refreshes
                 json={"brief": "@print typed", "repository": str(repo)}).raise_for_status()
    page.fill("#run-filters input[name=q]", "nightly")   # while the refresh's answer is held
    held[0].continue_()
    from conftest import wait_for
    # polled from here: the page's CSP refuses wait_for_function's eval
    wait_for(lambda: page.evaluate("window.__refreshRead === true"), 15)
    assert page.input_value("#run-filters input[name=q]") == "nightly"


# --- Office: the user journey of issue 4, from the dashboard alone --------------------------------

def wait_for_text(page, selector: str, text: str, timeout_s: float = 30) -> None:
    """Live pages refresh themselves from the event stream; reload as a fallback."""
    import time
    deadline = time.monotonic() + timeout_s
    while text not in (page.inner_text(selector) if page.query_selector(selector) else ""):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {selector}: {page.inner_text('#main')[:2000]}"
        page.wait_for_timeout(500)
        if int(time.monotonic() * 2) % 10 == 0:
            page.reload()


def test_office_agent_wakes_on_assignment_comment_and_resolved_blocker(page, server, repo):
    sign_in(page, server)
    page.goto(server.url + "/office/board")
    assert page.query_selector("#no-repository") is None   # the embedded repository runs Office
    page.goto(server.url + "/office/settings")
    page.fill("#repository", str(repo))
    page.click("#save-settings")
    page.wait_for_selector("#flash")
    page.goto(server.url + "/office/agents")
    assert page.query_selector("#agents-empty")
    page.fill("#agent-form input[name=name]", "builder")
    page.select_option("#agent-form select[name=executor]", "demo")
    page.fill("#agent-form input[name=cooldown_sec]", "0")
    page.click("#create-agent")
    page.wait_for_selector("#agent-status")
    shot(page, "office-agent")

    # Create and assign a task: the agent wakes, runs, and comments through its run token.
    page.goto(server.url + "/office/board")
    page.fill("#task-form input[name=title]", "Write the notes")
    page.fill("#task-form textarea[name=description]", "@print hello from office\n@comment first pass done")
    page.select_option("#task-form select[name=assignee_agent_id]", label="builder")
    page.click("#create-task")
    page.wait_for_selector("#task-state")
    wait_for_text(page, "#comments", "first pass done")
    wait_for_text(page, ".wakeups", "Finished")
    shot(page, "office-task")

    # A user comment wakes it again; the resumed session reads only the new comment.
    page.fill("#comment-form textarea[name=body]", "@comment second pass done")
    page.click("#post-comment")
    wait_for_text(page, "#comments", "second pass done")
    assert "comment" in page.inner_text(".wakeups")

    # A blocked task is held; moving its blocker to Done on the board wakes its agent.
    page.goto(server.url + "/office/board")
    page.fill("#task-form input[name=title]", "Blocker")
    page.select_option("#task-form select[name=assignee_agent_id]", label="builder")
    page.click("#create-task")
    page.wait_for_selector("#task-state")
    blocker_id = page.url.rsplit("/", 1)[1].split("?")[0]
    page.goto(server.url + "/office/board")
    page.fill("#task-form input[name=title]", "Blocked work")
    page.fill("#task-form textarea[name=description]", "@comment unblocked and done")
    page.select_option("#task-form select[name=assignee_agent_id]", label="builder")
    page.select_option("#task-form select[name=blocked_by]", blocker_id)
    page.click("#create-task")
    wait_for_text(page, ".wakeups", "held until its blockers are done")
    blocked_url = page.url.split("?")[0]
    page.goto(server.url + "/office/board")
    page.drag_and_drop(f"#card-{blocker_id}", ".column[data-state=DONE]")
    page.wait_for_selector(f".column[data-state=DONE] #card-{blocker_id}")
    shot(page, "office-board")
    page.goto(blocked_url)
    wait_for_text(page, "#comments", "unblocked and done")
    assert "task_blockers_resolved" in page.inner_text(".wakeups")
    page.goto(server.url + "/office/wakeups")
    shot(page, "office-wakeups")

    # Run inspection: the Prompt tab shows what the agent read.
    page.locator(".wakeups td:last-child a").first.click()   # a locator: a live refresh may swap the row
    page.click("#prompt-tab")
    assert page.is_visible("#assembled-prompt")
    assert "Why you woke" in page.inner_text("#assembled-prompt")
    shot(page, "office-run-prompt")


def test_office_routine_run_now_asks_for_a_required_variable_first(page, server, repo):
    sign_in(page, server)
    page.goto(server.url + "/office/settings")
    page.fill("#repository", str(repo))
    page.click("#save-settings")
    page.goto(server.url + "/office/agents")
    page.fill("#agent-form input[name=name]", "router")
    page.select_option("#agent-form select[name=role]", "coordinator")
    page.click("#create-agent")
    page.wait_for_selector("#agent-status")
    assert not page.query_selector("#coordinator-empty-state"), "its heartbeat routine was installed"
    page.goto(server.url + "/office/routines")
    assert "Coordinator heartbeat" in page.inner_text("#routines-table")
    assert "every 5 minutes" in page.inner_text("#routines-table")
    page.fill("#routine-form input[name=name]", "Explain")
    page.select_option("#routine-form select[name=assignee_agent_id]", label="router (coordinator)")
    page.fill("#routine-form textarea[name=description]", "@print because {{reason}}")
    page.fill("#routine-form textarea[name=variables]", "reason:text::required")
    page.select_option("#routine-form select[name=webhook_mode]", "hmac_sha256")
    page.click("#create-routine")
    secret = page.inner_text("#new-secret pre")
    assert len(secret) > 30
    assert "openssl dgst -sha256 -hmac" in page.inner_text(".curl")
    shot(page, "office-routine")
    # Run now without the required value: the browser asks for it and nothing is fired.
    page.click("#fire-routine")
    assert page.evaluate("document.querySelector('input[name=var_reason]').validity.valueMissing")
    assert "Not fired yet" in page.inner_text("#history")
    page.fill("input[name=var_reason]", "it was asked")
    page.click("#fire-routine")
    page.wait_for_url("**done=fired_*")
    assert "wakeup is queued" in page.inner_text("#flash")
    assert "reason=it was asked" in page.inner_text("#routine-runs")
    # The secret is not shown again.
    page.reload()
    assert secret not in page.content()


def test_reply_in_one_step_shows_the_thread_and_closes_the_attention_item(page, server, repo):
    import uuid

    import httpx
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as api:
        run_id = api.post("/v1/outpost/dispatches", json={"brief": "@needs-you Which branch may I push to?",
                                                          "repository": str(repo), "agent": "demo"},
                          headers={"Idempotency-Key": uuid.uuid4().hex}).json()["run_id"]
        wait_until(lambda: any(a["run_id"] == run_id for a in api.get("/v1/outpost/attention").json()["attention"]))
    sign_in(page, server)
    page.goto(f"{server.url}/runs/{run_id}")
    sync_api.expect(page.locator("#run-status")).to_have_text("needs you", timeout=30_000)
    page.reload()
    badge = int(page.inner_text("#attention-count"))
    assert "Which branch may I push to?" in page.inner_text("#run-question")
    assert page.query_selector("#adopt-form") is None, "no separate Adopt step"
    page.fill("#reply-form input[name=workspace]", "team")
    page.fill("#reply-message", "Push to release/2.0\n@print answered")
    shot(page, "reply")
    page.click("#reply-form button[type=submit]")   # adopts and replies at once
    page.wait_for_url("**/runs/*?done=replied")
    reply_url = page.url
    assert "Reply sent" in page.inner_text("#flash")
    assert int(page.inner_text("#attention-count")) == badge - 1, "the answered item is closed"
    thread = page.locator("#thread")
    assert "Which branch may I push to?" in thread.locator(".thread-question").inner_text()
    assert "Push to release/2.0" in thread.locator(".thread-answer").inner_text()
    assert thread.locator(f'a[href="/runs/{run_id}"]').count() == 1
    sync_api.expect(page.locator("#run-status")).to_have_text("succeeded", timeout=30_000)
    page.reload()   # the result of the reply closes the thread
    last = page.locator("#thread li.thread-step").last
    assert "succeeded" in last.inner_text() and last.locator(".thread-result").count() == 1
    assert page.url == reply_url
    shot(page, "thread")
    page.goto(f"{server.url}/runs/{run_id}")
    assert "Answered by run" in page.inner_text("#needs-you")
    assert page.query_selector("#reply-form") is None
    assert "team" in page.inner_text(".facts")   # adopted as part of the reply
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as api:
        assert api.get(f"/v1/outpost/runs/{run_id}").json()["answer"] == "Push to release/2.0\n@print answered"


def test_a_reload_after_a_form_does_not_post_it_again(page, server, repo):
    """POST/redirect/GET: each create form lands on a GET page; reloading it creates nothing."""
    sign_in(page, server)

    def counts():
        """How many of each thing this test makes exist (other tests share the server)."""
        with api_client(server) as api:
            return (sum(s["name"] == "reload-once" for s in api.get("/v1/outpost/schedules").json()["schedules"]),
                    sum(a["name"] == "reloader" for a in api.get("/api/office/agents").json()["agents"]),
                    sum(t["title"] == "Reload me not" for t in api.get("/api/office/tasks").json()["tasks"]),
                    sum(r["name"] == "Hooked once" for r in api.get("/api/office/routines").json()["routines"]))

    assert counts() == (0, 0, 0, 0)
    compose(page, server, repo, "reload-once", "@print once")
    page.reload()
    page.wait_for_selector("#schedule-controls")
    page.goto(server.url + "/office/settings")
    page.fill("#repository", str(repo))
    page.click("#save-settings")
    page.wait_for_selector("#flash")
    page.goto(server.url + "/office/agents")
    page.fill("#agent-form input[name=name]", "reloader")
    page.click("#create-agent")
    page.wait_for_selector("#agent-status")
    page.reload()
    page.goto(server.url + "/office/board")
    page.fill("#task-form input[name=title]", "Reload me not")
    page.click("#create-task")
    page.wait_for_selector("#task-state")
    page.reload()
    page.goto(server.url + "/office/routines")
    page.fill("#routine-form input[name=name]", "Hooked once")
    page.select_option("#routine-form select[name=assignee_agent_id]", label="reloader (worker)")
    page.select_option("#routine-form select[name=webhook_mode]", "hmac_sha256")
    page.click("#create-routine")
    page.wait_for_url("**/office/routines/*?done=routine_created")
    secret = page.inner_text("#new-secret pre")
    assert len(secret) > 30 and secret not in page.url
    page.reload()
    assert page.query_selector("#new-secret") is None and secret not in page.content(), "shown once"
    page.once("dialog", lambda dialog: dialog.accept())   # "Make a new secret?"
    page.click("button:has-text('Rotate secret')")
    page.wait_for_url("**?done=secret_rotated")
    rotated = page.inner_text("#new-secret pre")
    assert rotated != secret and rotated not in page.url
    page.reload()
    assert page.query_selector("#new-secret") is None
    assert counts() == (1, 1, 1, 1), "each form posted once, whatever the reloads"


def test_the_agents_page_shows_a_paused_profile_and_resumes_it(browser, repo, tmp_path_factory):
    import uuid

    import httpx
    data = tmp_path_factory.mktemp("agents-page") / "data"
    data.mkdir()
    (data / "outpost.toml").write_text('[agents.claude]\npreset = "claude-code"\nmodel = "sonnet"\n'
                                       'pass_env = ["PATH", "HOME"]\n')
    home = data.parent / "home"
    home.mkdir()
    fakes = Path(__file__).parent.parent / "fakes"
    server = Server(data, env={"PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}", "HOME": str(home)}).start()
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as api:
            api.post("/v1/outpost/dispatches", json={"brief": "fake:auth", "repository": str(repo), "agent": "claude"},
                     headers={"Idempotency-Key": uuid.uuid4().hex})
            wait_until(lambda: api.get("/v1/outpost/agents").json()["agents"][0]["paused_reason"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        sign_in(page, server)
        page.goto(server.url + "/agents")
        row = page.locator("tr[data-agent=claude]")
        assert "claude-code" in row.inner_text() and "sonnet" in row.inner_text()
        assert "2.1.197" in row.inner_text(), "the version its last run reported"
        assert "paused" in row.locator(".agent-standing").inner_text()
        assert "ready" in page.locator("tr[data-agent=demo] .agent-standing").inner_text()
        shot(page, "agents")
        row.locator("button.resume-agent").click()
        assert "Profile resumed" in page.inner_text("#flash")
        assert "ready" in page.locator("tr[data-agent=claude] .agent-standing").inner_text()
        context.close()
    finally:
        server.stop()


def wait_until(predicate, timeout_s: float = 30):
    from conftest import wait_for
    return wait_for(predicate, timeout_s)


def api_client(server: Server):
    import httpx
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=30)


def keyed() -> dict:
    import uuid
    return {"Idempotency-Key": uuid.uuid4().hex}


def settled(api, run_id: str) -> dict:
    from conftest import wait_for
    return wait_for(lambda: (r := api.get(f"/v1/outpost/runs/{run_id}").json())["status"]
                    in ("succeeded", "failed", "needs_you") and r, 30)


def test_chart_diff_and_compare_of_two_runs(page, server, repo):
    with api_client(server) as api:
        raw = {"name": "notes-twice", "brief": "@commit notes.txt written at {{datetime}}", "repository": str(repo),
               "agent": "demo", "timing": {"kind": "cron", "expression": "0 3 * * *", "timezone": "Europe/Berlin"}}
        composed = api.post("/v1/outpost/schedules/compose", json=raw).json()
        sched = api.post("/v1/outpost/schedules", json={"definition": composed["definition"],
                                                         "confirmation": composed["confirmation"]},
                         headers=keyed()).json()
        runs = []
        for revision in (1, 1):
            fired = api.post(f"/v1/outpost/schedules/{sched['id']}/control", json={"action": "fire"},
                             headers={**keyed(), "If-Match": f'"{revision}"'}).json()
            runs.append(settled(api, fired["run_id"]))
        drafts = [settled(api, api.post("/v1/outpost/dispatches", json={
            "brief": f"@commit notes.txt {word} draft", "repository": str(repo), "agent": "demo"},
            headers=keyed()).json()["run_id"]) for word in ("first", "second")]
    first, second = runs
    assert first["status"] == second["status"] == "succeeded"
    sign_in(page, server)
    page.goto(f"{server.url}/schedules/{sched['id']}")
    chart = page.locator("#schedule-chart svg.chart")
    assert chart.get_attribute("role") == "img"
    assert page.locator("#schedule-chart g.day").count() == 30
    assert "2 succeeded" in page.locator("#schedule-chart g.day").last.inner_html()
    shot(page, "schedule-chart")
    page.goto(f"{server.url}/runs/{first['id']}")
    assert "notes.txt" in page.inner_text("#run-diff summary")
    assert "+written at" in page.inner_text("#run-diff pre.diff")
    shot(page, "run-diff")
    page.click("#compare-link")
    page.select_option("select[name=with]", second["id"])   # the other run of the schedule
    page.click("#compare-form button[type=submit]")
    assert "✓ same commit" in page.inner_text("#compare-verdict")
    page.goto(f"{server.url}/runs/{drafts[0]['id']}/compare")   # two dispatches: no schedule, an id to type
    page.fill("#compare-form input[name=with]", drafts[1]["id"])
    page.click("#compare-form button[type=submit]")
    assert "✗ same prompt" in page.inner_text("#compare-verdict")
    assert "✓ same agent profile" in page.inner_text("#compare-verdict")
    assert "-first draft" in page.inner_text("#compare-diff") and "+second draft" in page.inner_text("#compare-diff")
    shot(page, "compare")
    page.goto(f"{server.url}/runs/{second['id']}")
    page.click("#rerun-button")
    assert re.match(r"Re-run (queued|started): same commit", page.inner_text("#flash"))
    assert second["id"] in page.inner_text("main")


def test_a_catch_up_plan_is_approved_from_the_dashboard(browser, repo, tmp_path_factory):
    import sqlite3
    data = tmp_path_factory.mktemp("catch-up") / "data"
    server = Server(data).start()
    try:
        with api_client(server) as api:
            raw = {"name": "hourly-ask", "brief": "@print caught up", "repository": str(repo), "agent": "demo",
                   "timing": {"kind": "interval", "seconds": 3600, "timezone": "UTC"},
                   "catch_up": {"policy": "ask"}}
            composed = api.post("/v1/outpost/schedules/compose", json=raw).json()
            sched = api.post("/v1/outpost/schedules", json={"definition": composed["definition"],
                                                            "confirmation": composed["confirmation"]},
                             headers=keyed()).json()
        server.stop()
        # Three hours of downtime: the schedule's fires came due 3 h, 2 h and 1 h ago (its next is 30 s ahead).
        first_missed = outpost.sql_time(datetime.now(UTC) - timedelta(hours=3) + timedelta(seconds=30))
        with sqlite3.connect(data / "outpost.sqlite3") as db:
            db.execute('UPDATE "Schedule" SET next_fire_at = ?, anchored_at = ? WHERE id = ?',
                       (first_missed, first_missed, sched["id"]))
        server.start()
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        sign_in(page, server)
        page.goto(f"{server.url}/schedules/{sched['id']}")
        plan = page.inner_text("#catch-up-plan")
        assert "missed 3 occurrences" in plan and "Nothing ran" in plan
        shot(page, "catch-up-plan")
        page.click("#catch-up-plan button[data-action=approve_catch_up]")
        assert "Catch-up approved" in page.inner_text("#flash")
        assert page.query_selector("#catch-up-plan") is None
        with api_client(server) as api:
            (run,) = api.get(f"/v1/outpost/runs?schedule_id={sched['id']}").json()["runs"]
        assert (run["trigger"], run["missed_count"]) == ("catch_up", 3)
        context.close()
    finally:
        server.stop()

"""How every dashboard page looks, in a real browser (issue 28): with data on every page, in the
light and the dark colour scheme, axe-core finds no serious or critical violation and every form
control is readable; on a phone (390x844) no page scrolls sideways; list times are <time>
elements that name their zone on hover, and runs show how long they took.

One server and one data set for the module. axe-core comes from npm (``.ci/run`` installs it;
``OUTPOST_AXE_CORE`` names the npm prefix or the axe.min.js file). Set ``OUTPOST_LOOK_SHOTS`` to
a folder to get a screenshot of every page in every mode there."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import chromium
import httpx
import pytest
from conftest import Server, make_repo, wait_for

import outpost

AXE = Path(os.environ.get("OUTPOST_AXE_CORE") or Path.home() / ".cache/outpost/axe-core")
AXE_JS = AXE if AXE.is_file() else AXE / "node_modules/axe-core/axe.min.js"
SHOTS = os.environ.get("OUTPOST_LOOK_SHOTS")
#: Chromium (tests/browser/chromium.py), a fixture of this module.
browser = chromium.browser

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.slow

#: The pages, by a short name: a path (ids filled in from the data set), or "review" (the
#: compose form submitted) and "signin" (signed out).
PAGES = {
    "schedules": "/schedules", "compose": "/schedules/new", "review": "review",
    "schedule": "/schedules/{east}", "schedule-edit": "/schedules/{east}/edit",
    "runs": "/runs", "run": "/runs/{committed}", "run-failed": "/runs/{failed}", "run-needs-you": "/runs/{asked}",
    "compare": "/runs/{committed}/compare?with={again}", "agents": "/agents", "attention": "/attention",
    "office-agents": "/office/agents", "office-agent": "/office/agents/{agent}", "office-board": "/office/board",
    "office-task": "/office/tasks/{task}", "office-wakeups": "/office/wakeups",
    "office-run": "/office/runs/{office_run}", "office-activity": "/office/activity",
    "office-routines": "/office/routines", "office-routine": "/office/routines/{routine}",
    "office-settings": "/office/settings", "settings": "/settings", "signin": "signin",
    "proposals": "/proposals", "proposal": "/proposals/{proposal}", "upcoming": "/upcoming",
    "compose-errors": "compose-errors", "office-settings-errors": "office-settings-errors",
}
#: Forms submitted with every field wrong (the browser's own checks off): path, the fields, the submit button.
FORM_ERRORS = {
    "compose-errors": ("/schedules/new", {
        "name": " ", "brief": "", "repository": "relative/path", "source_ref": "-x", "workdir": "../up",
        "expression": "61 25 * * mon", "timezone": "PST", "timeout_seconds": "0", "catch_up_max": "99"},
        "#review-button"),
    "office-settings-errors": ("/office/settings", {
        "name": " ", "timezone": "Europe/Berlinn", "repository": "relative", "source_ref": "-bad",
        "recovery_lookback_hours": "1.5", "budget_runs_per_day": "0", "budget_usd_per_month": "0"},
        "#save-settings"),
}
#: List pages: their times are relative, in <time> elements; none is in a schedule's own zone.
LIST_PAGES = ["schedules", "runs", "attention", "agents", "office-agents", "office-agent", "office-wakeups",
              "office-activity", "office-routines", "office-task", "office-routine", "proposals"]
#: The zone the browser is in for the time checks: none of the data set's.
VIEWER_ZONE = "Asia/Tokyo"
STREAM = "**/v1/outpost/events/stream*"   # blocked: no live refresh swaps a page while it is checked


def test_every_dashboard_page_is_checked():
    rules = {r.rule for r in outpost.pages.routes if r.method == "GET" and r.auth is outpost.Auth.SESSION}
    checked = {re.sub(r"\{(\w+)\}", "<id>", p.split("?")[0]) for p in PAGES.values()}
    unchecked = {rule for rule in rules if re.sub(r"<\w+>", "<id>", rule) not in checked} - {"/", "/office"}
    unchecked -= {"/runs/<run_id>/log"}   # a download (the raw log), no page
    assert not unchecked, f"add these pages to PAGES: {sorted(unchecked)}"


# --- one server, one data set -------------------------------------------------------------------

def keyed() -> dict:
    return {"Idempotency-Key": uuid.uuid4().hex}


def settled(api: httpx.Client, run_id: str) -> dict:
    return wait_for(lambda: (r := api.get(f"/v1/outpost/runs/{run_id}").json())["status"]
                    in ("succeeded", "failed", "needs_you") and r, 60)


def schedule(api: httpx.Client, repo: Path, name: str, brief: str, zone: str, cron: str = "0 9 * * 1-5") -> str:
    raw = {"name": name, "brief": brief, "repository": str(repo), "agent": "demo",
           "timing": {"kind": "cron", "expression": cron, "timezone": zone}}
    composed = api.post("/v1/outpost/schedules/compose", json=raw).json()
    return api.post("/v1/outpost/schedules", json={"definition": composed["definition"],
                                                   "confirmation": composed["confirmation"]},
                    headers=keyed()).json()["id"]


def fire(api: httpx.Client, schedule_id: str) -> dict:
    revision = api.get(f"/v1/outpost/schedules/{schedule_id}").json()["revision"]
    fired = api.post(f"/v1/outpost/schedules/{schedule_id}/control", json={"action": "fire"},
                     headers={**keyed(), "If-Match": f'"{revision}"'}).json()
    return settled(api, fired["run_id"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("look-data") / "data").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ids(server, tmp_path_factory) -> dict[str, str]:
    """Schedules in three zones; a run that committed (twice, to compare), a failed one and one
    that needs you; an Office agent with a task it worked, an idle one whose routine was skipped.
    The Office workspace has no repository of its own: it works in the embedded one, whose long
    path the settings page shows."""
    # a long path without a space: it must wrap on a phone wherever it shows
    repo = make_repo(tmp_path_factory.mktemp("look") / "the-projects-we-keep-on-this-machine" / "dashboard-repo")
    with server.client() as api:
        east = schedule(api, repo, "east-report", "@print report\n@commit notes.txt {{datetime}}", "America/New_York")
        india = schedule(api, repo, "india-sync", "@print syncing\n@fail the remote refused", "Asia/Kolkata",
                         "30 18 * * *")
        schedule(api, repo, "utc-nightly", "@print nightly", "UTC", "0 3 * * *")
        committed, again, failed = fire(api, east), fire(api, east), fire(api, india)
        assert (committed["status"], again["status"], failed["status"]) == ("succeeded", "succeeded", "failed")
        asked = settled(api, api.post("/v1/outpost/dispatches", headers=keyed(), json={
            "brief": "@needs-you Which branch may I push to?", "repository": str(repo), "agent": "demo",
        }).json()["run_id"])
        assert asked["status"] == "needs_you"

        agent = api.post("/api/office/agents", headers=keyed(),
                         json={"name": "builder", "executor": "demo", "cooldown_sec": 0}).json()["id"]
        idler = api.post("/api/office/agents", headers=keyed(), json={"name": "idler", "executor": "demo"}).json()["id"]
        task = api.post("/api/office/tasks", headers=keyed(), json={
            "title": "Write the release notes", "description": "@print on it\n@comment first draft is up",
            "assignee_agent_id": agent}).json()["id"]
        routine = api.post("/api/office/routines", headers=keyed(), json={
            "name": "Poll the tracker", "assignee_agent_id": idler, "description": "@print polling",
            "triggers": [{"kind": "schedule", "cron_expression": "0 3 * * *", "timezone": "Asia/Kolkata"},
                         {"kind": "webhook", "signing_mode": "hmac_sha256"}]}).json()["id"]
        api.post(f"/api/office/routines/{routine}/fire", headers=keyed(), json={"variables": {}}).raise_for_status()

        def ended(agent_id: str) -> dict | None:
            listed = api.get("/api/office/wakeups", params={"agent_id": agent_id}).json()["wakeups"]
            return listed[0] if listed and all(w["status"] not in ("queued", "claimed") for w in listed) else None
        office_run = wait_for(lambda: ended(agent), 60)["run_id"]
        wait_for(lambda: ended(idler), 60)
        settled(api, office_run)
        wait_for(lambda: api.get("/api/office/activity").json()["activity"], 30)
        # a change a person's agent proposed (a proposer key), with a brief that wraps on a phone
        key = api.post("/v1/outpost/keys", headers=keyed(), json={"name": "laptop", "role": "proposer"}).json()["key"]
        proposal = api.post("/v1/outpost/proposals", json={
            "kind": "change", "schedule_id": east, "changes": {
                "brief": "@print report, then the-changelog-of-this-release-with-a-long-name.md\n@commit notes.txt x",
                "timing": {"kind": "cron", "expression": "30 7 * * *", "timezone": "America/New_York"}}},
            headers={**keyed(), "Authorization": f"Bearer {key}"}).json()["id"]
    return {"east": east, "proposal": proposal, "committed": committed["id"], "again": again["id"],
            "failed": failed["id"], "asked": asked["id"], "agent": agent, "task": task, "routine": routine,
            "office_run": office_run}


@pytest.fixture(scope="module")
def signed_in(browser, server, ids) -> dict:
    """The session cookie of one sign-in, for every context of the module."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.url + "/signin")
    page.fill("input[name=token]", server.token)
    page.click("button[type=submit]")
    page.wait_for_url("**/schedules")
    state = context.storage_state()
    context.close()
    return state


class Viewer:
    """One browser context (a scheme, a viewport, a zone) and its page, reused across tests."""

    def __init__(self, browser, server: Server, state: dict, ids: dict[str, str], name: str, **options):
        self.server, self.ids, self.name, self.cookies = server, ids, name, state["cookies"]
        self.context = browser.new_context(storage_state=state, timezone_id=VIEWER_ZONE, **options)
        self.context.route(STREAM, lambda route: route.abort())
        self.page = self.context.new_page()
        self.page.set_default_timeout(15_000)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def visit(self, key: str):
        page, target = self.page, PAGES[key]
        if target == "signin":
            self.context.clear_cookies()
            try:
                page.goto(self.server.url + "/signin")
                page.wait_for_selector("input[name=token]")
                self.shot(key)
            finally:
                self.context.add_cookies(self.cookies)
            return page
        if target in FORM_ERRORS:
            path, fields, button = FORM_ERRORS[target]
            page.goto(self.server.url + path)
            page.evaluate("document.querySelectorAll('form').forEach(f => f.noValidate = true)")
            for name, value in fields.items():
                page.fill(f"[name={name}]", value)
            with page.expect_navigation():
                page.click(button)
            page.wait_for_selector("#form-error")
            page.wait_for_load_state("load")
            self.shot(key)
            return page
        if target == "review":
            page.goto(self.server.url + f"/schedules/{self.ids['east']}/edit")
            with page.expect_navigation():   # the POST's answer, with its stylesheet applied
                page.click("#review-button")
            page.wait_for_selector("#review-summary")
            page.wait_for_load_state("load")
        else:
            page.goto(self.server.url + target.format(**self.ids))
            page.wait_for_selector("#main")
        assert "/signin" not in page.url, f"{key}: signed out"
        self.shot(key)
        return page

    def shot(self, key: str) -> None:
        if SHOTS:
            Path(SHOTS).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(SHOTS) / f"{self.name}-{key}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()
        assert not self.errors, f"JavaScript errors: {self.errors}"


@pytest.fixture(scope="module", params=["light", "dark"])
def scheme(request, browser, server, signed_in, ids):
    if not AXE_JS.is_file():
        pytest.skip(f"axe-core is not installed at {AXE_JS} (npm install --prefix {AXE} axe-core@4; "
                    "OUTPOST_AXE_CORE names another prefix)")
    v = Viewer(browser, server, signed_in, ids, request.param, color_scheme=request.param,
               viewport={"width": 1280, "height": 900}, bypass_csp=True)
    v.context.add_init_script(path=str(AXE_JS))
    yield v
    v.close()


@pytest.fixture(scope="module")
def dark(browser, server, signed_in, ids):
    v = Viewer(browser, server, signed_in, ids, "dark-controls", color_scheme="dark",
               viewport={"width": 1280, "height": 900})
    yield v
    v.close()


@pytest.fixture(scope="module")
def phone(browser, server, signed_in, ids):
    v = Viewer(browser, server, signed_in, ids, "phone", viewport={"width": 390, "height": 844},
               device_scale_factor=1, has_touch=True, is_mobile=True)
    yield v
    v.close()


# --- (a) axe-core, light and dark -----------------------------------------------------------------

def describe(violations: list[dict]) -> str:
    lines = []
    for v in violations:
        for node in v["nodes"][:4]:
            lines.append(f"  {v['impact']} {v['id']}: {' '.join(node['target'])}: "
                         f"{(node.get('failureSummary') or '').splitlines()[-1].strip()[:160]}")
    return "\n".join(lines)


@pytest.mark.parametrize("key", PAGES)
def test_axe_finds_nothing_serious(scheme, key):
    page = scheme.visit(key)
    result = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    bad = [v for v in result["violations"] if v["impact"] in ("serious", "critical")]
    assert not bad, f"{key} in {scheme.name}:\n{describe(bad)}"


# --- (b) form controls readable in dark mode --------------------------------------------------------

#: Each visible control's text colour, its background (its own and its ancestors', blended over the
#: page's canvas) and their WCAG contrast ratio.
CONTROL_CONTRAST = """() => {
  const parse = (text) => {
    const m = text.match(/^rgba?\\(([^)]+)\\)$/);
    if (!m) return null;
    const p = m[1].split(/[\\s,/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, bottom) => [0, 1, 2].map((i) => top[i] * top[3] + bottom[i] * (1 - top[3])).concat(1);
  const canvas = matchMedia("(prefers-color-scheme: dark)").matches ? [18, 18, 18, 1] : [255, 255, 255, 1];
  const background = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    return layers.reverse().reduce((bottom, top) => over(top, bottom), canvas);
  };
  const luminance = (c) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
  };
  const out = [];
  for (const el of document.querySelectorAll("input, select, textarea, button")) {
    if (["hidden", "checkbox", "radio"].includes(el.type) || !el.getClientRects().length) continue;
    const style = getComputedStyle(el);
    if (style.visibility === "hidden") continue;
    const bg = background(el), fg = parse(style.color);
    const name = el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.name ? `[name=${el.name}]` : "")
      + (el.tagName === "BUTTON" ? ` "${el.textContent.trim().slice(0, 30)}"` : "");
    if (!fg) { out.push({name, ratio: 0, color: style.color, background: String(bg)}); continue; }
    const [a, b] = [luminance(over(fg, bg)), luminance(bg)];
    out.push({name, ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05), color: style.color,
              background: `rgb(${bg.slice(0, 3).map(Math.round).join(", ")})`});
  }
  return out;
}"""


@pytest.mark.parametrize("key", PAGES)
def test_every_form_control_is_readable_in_dark_mode(dark, key):
    page = dark.visit(key)
    assert page.evaluate("matchMedia('(prefers-color-scheme: dark)').matches")
    controls = page.evaluate(CONTROL_CONTRAST)
    poor = [c for c in controls if c["ratio"] < 4.5]
    assert not poor, f"{key}: controls under 4.5:1 in dark mode:\n" + "\n".join(
        f"  {c['name']}: {c['color']} on {c['background']} = {c['ratio']:.2f}" for c in poor)


def test_the_board_columns_and_text_fields_are_dark_in_dark_mode(dark):
    page = dark.visit("office-board")
    lightness = """(sel) => { const [r, g, b] = getComputedStyle(document.querySelector(sel)).backgroundColor
                                .match(/\\d+/g).map(Number); return (r + g + b) / 3; }"""
    assert page.evaluate(lightness, ".column") < 80, "a board column is light in dark mode"
    assert page.evaluate(lightness, "#task-form input[name=title]") < 80, "a text field is light in dark mode"


# --- (c) a phone: no page scrolls sideways ------------------------------------------------------------

#: Boxes in the page that scroll or clip sideways (a table cut at the screen's edge), code aside.
CUT_BOXES = """() => [...document.querySelectorAll("#main *")].filter((el) => {
  if (el.closest("pre") || ["INPUT", "SELECT", "TEXTAREA", "OPTION"].includes(el.tagName) || el.clientWidth <= 1)
    return false;
  return getComputedStyle(el).overflowX !== "visible" && el.scrollWidth > el.clientWidth + 1;
}).map((el) => `${el.tagName.toLowerCase()}${el.id ? "#" + el.id : ""}.${[...el.classList].join(".")}: ` +
              `${el.scrollWidth} px in ${el.clientWidth}`)"""


@pytest.mark.parametrize("key", PAGES)
def test_no_page_scrolls_sideways_on_a_phone(phone, key):
    page = phone.visit(key)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"{key} is {width} px wide at 390"
    assert not page.evaluate(CUT_BOXES), f"{key} cuts content at 390 px"


#: Each field the page marks invalid: whether the message that describes it is visible, and how far below
#: the field's top it starts (px), or null when the field names no message.
FIELD_MESSAGES = """() => [...document.querySelectorAll('[aria-invalid=true]')].map(field => {
  const ids = (field.getAttribute('aria-describedby') || '').split(' ').filter(Boolean);
  const messages = ids.map(id => document.getElementById(id)).filter(Boolean);
  const top = field.getBoundingClientRect().top;
  return {name: field.name, visible: messages.length === ids.length && messages.every(m => m.checkVisibility()
          && m.textContent.trim()), below: messages.length ? messages[0].getBoundingClientRect().top - top : null};
})"""


@pytest.mark.parametrize("key", FORM_ERRORS)
def test_every_error_of_a_form_is_seen_at_its_field_on_a_phone(phone, key):
    fields = phone.visit(key).evaluate(FIELD_MESSAGES)
    assert set(FORM_ERRORS[key][1]) <= {f["name"] for f in fields}, fields
    for field in fields:
        assert field["visible"] and 0 <= field["below"] < 120, field


def test_tables_become_labelled_cards_on_a_phone(phone):
    page = phone.visit("runs")
    row = page.locator("#runs-table tbody tr").first
    assert row.evaluate("tr => getComputedStyle(tr).display") == "block"
    labels = row.locator("td[data-label]").evaluate_all("tds => tds.map(td => getComputedStyle(td, '::before')"
                                                        ".content)")
    assert '"Status"' in labels and '"Queued"' in labels


# --- (d) times and durations ----------------------------------------------------------------------------

ZONE_NAMED = re.compile(r"\b(UTC|GMT[+-]\d+(:\d\d)?|[A-Z]{3,4}|[A-Z][a-z]+/[A-Za-z_]+)\b")


@pytest.mark.parametrize("key", LIST_PAGES)
def test_list_times_are_relative_and_name_their_zone_on_hover(phone, key):
    page = phone.visit(key)
    times = page.locator("#main time[data-rel]").evaluate_all(
        "ts => ts.map(t => ({datetime: t.getAttribute('datetime'), title: t.title, text: t.textContent}))")
    assert times, f"{key} shows no <time>"
    for t in times:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", t["datetime"]), t
        assert VIEWER_ZONE in t["title"] and ZONE_NAMED.search(t["title"]), t
        assert re.fullmatch(r"just now|in under a minute|(in )?\d+ (min|h|days?)( ago)?|\d{4}-\d\d-\d\d \d\d:\d\d",
                            t["text"]), t
    # (a routine's own page shows its schedule trigger's next fire in the trigger's zone, as a schedule's does)
    shown = page.inner_text("#history" if key == "office-routine" else "#main")
    own_zone = re.search(r"\b(EST|EDT|IST)\b|\([+-]\d\d:\d\d\)", shown)
    assert not own_zone, f"{key} shows a schedule's own zone ({own_zone[0]})"


def test_without_javascript_list_times_are_exact_and_name_utc(server, signed_in, ids):
    cookies = {c["name"]: c["value"] for c in signed_in["cookies"]}
    with httpx.Client(base_url=server.url, cookies=cookies) as web:
        html = web.get("/runs", headers={"Accept": "text/html"}).text
    times = re.findall(r'<time datetime="([^"]+)" title="([^"]+)" data-rel>([^<]+)</time>', html)
    assert times
    for iso, title, text in times:
        assert title.endswith("UTC") and text.endswith("UTC") and iso[:10] in title


def test_the_relative_words(phone):
    page = phone.visit("runs")
    words = page.evaluate("""() => {
      const now = Date.parse("2026-05-01T12:00:00Z"), at = (s) => new Date(now + s * 1000).toISOString();
      return [-20, 20, -185, 600, -3 * 3600 - 60, 2 * 3600 + 100, -3 * 86400, 40 * 86400]
        .map((s) => outpost.relative(at(s), now));
    }""")
    assert words[:7] == ["just now", "in under a minute", "3 min ago", "in 10 min", "3 h ago", "in 2 h", "3 days ago"]
    assert re.fullmatch(r"2026-06-10 \d\d:\d\d", words[7])
    assert page.evaluate("outpost.duration(72)") == "1 m 12 s"
    assert page.evaluate("outpost.duration(3 * 3600 + 5 * 60 + 9)") == "3 h 5 m"


def test_runs_show_how_long_they_took(phone, ids):
    page = phone.visit("runs")
    durations = page.locator("#runs-table td.duration").all_inner_texts()
    assert durations and all(re.fullmatch(r"(\d+ [hm] )?\d+ [sm]|< 1 s|-", d.strip()) for d in durations), durations
    assert any(re.fullmatch(r"\d+ s|< 1 s", d.strip()) for d in durations)
    page = phone.visit("run")
    assert re.fullmatch(r"(\d+ m )?\d+ s|< 1 s", page.inner_text("#run-duration").strip())
    page = phone.visit("office-run")
    assert re.fullmatch(r"(\d+ m )?\d+ s|< 1 s", page.inner_text("#run-duration").strip())


def test_a_schedule_page_keeps_the_schedule_zone(phone):
    page = phone.visit("schedule")
    assert re.search(r"\bE[SD]T\b", page.inner_text("#next-fire"))
    ledger = page.inner_text("#slot-ledger")
    assert re.search(r"\bE[SD]T\b", ledger), ledger
    title = page.get_attribute("#next-fire time", "title")
    assert "America/New_York" in title, title


def test_the_data_set_is_what_the_pages_show(phone, ids):
    """A guard for the checks above: the data they look at is there."""
    page = phone.visit("attention")
    assert page.locator("#attention-open tbody tr").count() >= 3
    page = phone.visit("office-activity")
    assert "wakeup_idle_skipped" in page.inner_text("#activity-table")
    page = phone.visit("office-settings")
    assert "/workspaces/" in page.inner_text("#embedded-repository")

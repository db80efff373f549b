"""The dashboard for every day (issue 36), in Chromium against the real server: keyboard
shortcuts, copy buttons, the board's words on a phone, Office Settings on a 390 px phone, the
webhook's curl example with its once-shown secret. Reuses test_browser's server."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import chromium
import pytest
from test_browser import repo, server, settled, shot, sign_in, sync_api  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

AXE = Path(os.environ.get("OUTPOST_AXE_CORE") or Path.home() / ".cache/outpost/axe-core")
AXE_JS = AXE if AXE.is_file() else AXE / "node_modules/axe-core/axe.min.js"
#: What a phone is to Chromium here: 390 px wide, touch, no hover.
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 1, "is_mobile": True, "has_touch": True}
#: Chromium and a signed-out page (tests/browser/chromium.py), fixtures of this module.
browser, page = chromium.browser, chromium.page


def keyed() -> dict:
    return {"Idempotency-Key": uuid.uuid4().hex}


@pytest.fixture(scope="module")
def run_id(server, repo) -> str:  # noqa: F811 - the imported fixtures
    """One settled run that committed (a result branch, a commit)."""
    with server.client() as api:
        dispatched = api.post("/v1/outpost/dispatches", headers=keyed(), json={
            "brief": "@commit notes.txt daily", "repository": str(repo), "agent": "demo"}).json()
        assert settled(api, dispatched["run_id"])["status"] == "succeeded"
    return dispatched["run_id"]


@pytest.fixture
def phone(browser, server):  # noqa: F811
    context = browser.new_context(**PHONE)
    page = context.new_page()  # noqa: F811
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, server)
    yield page
    context.close()
    assert not errors, f"JavaScript errors: {errors}"


# --- keyboard shortcuts ------------------------------------------------------------------------------

def test_g_then_r_goes_to_runs_and_g_then_s_to_schedules(page, server):  # noqa: F811
    sign_in(page, server)
    page.keyboard.press("g")
    page.keyboard.press("r")
    page.wait_for_url("**/runs")
    page.keyboard.press("g")
    page.keyboard.press("a")
    page.wait_for_url("**/attention")
    page.keyboard.press("g")
    page.keyboard.press("s")
    page.wait_for_url("**/schedules")


def test_question_mark_lists_the_shortcuts_in_a_dialog_that_escape_closes(page, server):  # noqa: F811
    sign_in(page, server)
    assert "? for keyboard shortcuts" in page.inner_text("#shortcuts-hint")
    page.keyboard.press("?")
    dialog = page.locator("dialog#shortcuts")
    sync_api.expect(dialog).to_be_visible()
    text = dialog.inner_text()
    for keys, where in (("g then s", "Schedules"), ("g then r", "Runs"), ("g then a", "Attention"),
                        ("g then u", "Upcoming"), ("g then o", "Office")):
        assert keys in text and f"Go to {where}" in text, text
    assert "Search" in text and "This list" in text
    assert dialog.get_attribute("aria-labelledby") == "shortcuts-title"
    assert page.evaluate("document.activeElement.closest('dialog')?.id") == "shortcuts", "focus is not in the dialog"
    shot(page, "shortcuts")
    page.keyboard.press("g")   # the dialog has the keyboard: no shortcut behind it
    page.keyboard.press("r")
    assert page.url.endswith("/schedules")
    page.keyboard.press("Escape")
    sync_api.expect(dialog).to_be_hidden()
    page.click("#shortcuts-hint")   # the words in the footer open it too
    sync_api.expect(dialog).to_be_visible()
    page.click("#shortcuts button:has-text('Close')")
    sync_api.expect(dialog).to_be_hidden()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_nothing_serious_in_the_shortcuts_dialog(browser, server, scheme):  # noqa: F811
    if not AXE_JS.is_file():
        pytest.skip(f"axe-core is not installed at {AXE_JS} (see test_browser_look)")
    context = browser.new_context(color_scheme=scheme, bypass_csp=True)
    context.add_init_script(path=str(AXE_JS))
    page = context.new_page()  # noqa: F811
    try:
        sign_in(page, server)
        page.keyboard.press("?")
        sync_api.expect(page.locator("dialog#shortcuts")).to_be_visible()
        result = page.evaluate("async () => await axe.run('#shortcuts', {resultTypes: ['violations']})")
        assert not [(v["id"], v["nodes"][0]["target"]) for v in result["violations"]
                    if v["impact"] in ("serious", "critical")]
    finally:
        context.close()


def test_typing_g_in_a_field_types_it(page, server):  # noqa: F811
    sign_in(page, server)
    page.goto(server.url + "/schedules/new")
    page.click("input[name=name]")
    page.keyboard.type("gr?/")
    assert page.input_value("input[name=name]") == "gr?/"
    page.click("textarea[name=brief]")
    page.keyboard.type("g s")
    assert page.input_value("textarea[name=brief]").endswith("hellog s")
    page.wait_for_timeout(300)
    assert page.url.endswith("/schedules/new") and not page.locator("dialog#shortcuts").is_visible()


def test_a_modifier_key_keeps_the_browser_s_own_shortcut(page, server):  # noqa: F811
    sign_in(page, server)
    page.goto(server.url + "/attention")
    page.keyboard.press("g")
    page.keyboard.press("Alt+r")
    page.keyboard.press("Control+Shift+?")
    page.wait_for_timeout(300)
    assert page.url.endswith("/attention") and not page.locator("dialog#shortcuts").is_visible()


def test_slash_focuses_the_page_s_search_box_or_goes_to_the_runs_search(page, server):  # noqa: F811
    sign_in(page, server)
    page.goto(server.url + "/agents")
    page.keyboard.press("/")   # the Agent CLIs page has no search box: the Runs page's
    page.wait_for_url("**/runs*")
    box = page.locator("input[data-search]")
    if box.count():   # the Runs page's search box (the filters' branch of issue 36)
        assert box.evaluate("el => el === document.activeElement")
        assert "#" not in page.url, "the #search that asked for the focus stays in the URL"
    # on a page with its own box, "/" focuses it and types nothing (the Runs box let go first: typed into, "/" is text)
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    page.evaluate("""() => document.getElementById('main').insertAdjacentHTML('afterbegin',
        '<input type=search name=q aria-label=Search data-search value=old>')""")
    page.keyboard.press("/")
    first = page.locator("input[data-search]").first
    assert first.evaluate("el => el === document.activeElement") and first.input_value() == "old"


# --- copy buttons ------------------------------------------------------------------------------------

def test_the_copy_button_beside_a_run_id_puts_it_on_the_clipboard(browser, server, run_id):  # noqa: F811
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()  # noqa: F811
    try:
        sign_in(page, server)
        page.goto(server.url + "/runs")
        button = page.locator(f"#runs-table a[href='/runs/{run_id}'] + button.copy-btn")
        assert button.get_attribute("aria-label") == "Copy run id"
        assert button.evaluate("b => getComputedStyle(b, '::before').content") == '"Copy"'
        button.click()
        assert page.evaluate("navigator.clipboard.readText()") == run_id
        sync_api.expect(button).to_have_attribute("data-copied", "yes")
        assert button.evaluate("b => getComputedStyle(b, '::before').content") == '"Copied"'
        assert page.inner_text("#copy-status") == "Copied run id"
        sync_api.expect(button).not_to_have_attribute("data-copied", "yes", timeout=5_000)   # "Copied" only briefly

        page.goto(f"{server.url}/runs/{run_id}")   # the run's page: its id, its commit, its branch
        branch = page.inner_text("#result-branch")
        assert branch.startswith("outpost/"), "the button's words joined the branch's text"
        page.click("#result-branch button.copy-btn")
        assert page.evaluate("navigator.clipboard.readText()") == branch
        assert page.get_attribute("#result-branch button.copy-btn", "aria-label") == "Copy result branch"
        page.click("h1 button.copy-btn")
        assert page.evaluate("navigator.clipboard.readText()") == run_id
        shot(page, "run-copy")
    finally:
        context.close()


def test_without_the_clipboard_api_the_copy_falls_back_to_a_selected_textarea(browser, server, run_id):  # noqa: F811
    """Plain http on a LAN address is no secure context: no navigator.clipboard there."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script("""
      Object.defineProperty(Navigator.prototype, 'clipboard', {get: () => undefined});
      const copy = document.execCommand.bind(document);
      document.execCommand = (command, ...rest) => {
        window.__copied = {command, text: document.activeElement.value};
        return copy(command, ...rest);
      };""")
    page = context.new_page()  # noqa: F811
    try:
        sign_in(page, server)
        page.goto(f"{server.url}/runs/{run_id}")
        page.click("h1 button.copy-btn")
        assert page.evaluate("window.__copied") == {"command": "copy", "text": run_id}
        assert page.locator("textarea.copy-buffer").count() == 0, "the textarea stays in the page"
        assert page.evaluate("document.activeElement.classList.contains('copy-btn')"), "the focus did not come back"
    finally:
        context.close()


def test_a_new_webhook_secret_is_in_the_curl_example_with_a_copy_button(page, server):  # noqa: F811
    sign_in(page, server)
    with server.client() as api:
        api.post("/api/office/agents", headers=keyed(), json={"name": "hooked", "executor": "demo"}).raise_for_status()
    page.goto(server.url + "/office/routines")
    menu = page.locator("#routine-form select[name=webhook_mode] option").all_inner_texts()
    assert menu[0] == "no webhook" and sum("none" in words for words in menu) == 0, menu
    assert "webhook, unsigned: anyone with its URL can fire it" in menu
    page.fill("#routine-form input[name=name]", "On push")
    page.select_option("#routine-form select[name=webhook_mode]", "hmac_sha256")
    page.click("#create-routine")
    page.wait_for_selector("#new-secret")
    secret = page.inner_text("#new-secret pre").strip()
    curl = page.locator("pre.curl")
    assert curl.inner_text().startswith(f"SECRET='{secret}'\n"), curl.inner_text()
    assert page.get_attribute("pre.curl + button.copy-btn", "aria-label") == "Copy curl example"
    assert page.get_attribute("#new-secret pre + button.copy-btn", "aria-label") == "Copy webhook secret"
    assert page.get_attribute("code.webhook-url + button.copy-btn", "aria-label") == "Copy webhook URL"
    shot(page, "routine-secret")
    page.reload()   # shown once: afterwards the example asks for it
    assert page.locator("#new-secret").count() == 0
    assert page.locator("pre.curl").inner_text().startswith("SECRET=...")


# --- a phone -----------------------------------------------------------------------------------------

def test_the_board_says_what_works_on_a_phone(phone, server, page):  # noqa: F811
    phone.goto(server.url + "/office/board")
    hint = phone.inner_text("#board-hint")
    assert "Tap a card" in hint and "Move" in hint and "Drag" not in hint, hint
    assert "Ctrl-click" not in phone.inner_text("#blocked-by-hint")
    shot(phone, "phone-board")
    sign_in(page, server)   # with a mouse: drag, and Ctrl-click for several
    page.goto(server.url + "/office/board")
    assert "Drag a card" in page.inner_text("#board-hint") and "Tap" not in page.inner_text("#board-hint")
    assert "Ctrl-click" in page.inner_text("#blocked-by-hint")


#: Elements whose box reaches past the right edge of a 390 px screen (a phone widens its layout
#: viewport to what overflows, so innerWidth is no measure).
PAST_THE_EDGE = """() => [...document.querySelectorAll('body *')]
  .filter((el) => el.getBoundingClientRect().right > 391 && !el.closest('pre'))
  .map((el) => `${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''}.${[...el.classList].join('.')}: `
               + `right edge at ${Math.round(el.getBoundingClientRect().right)} px`)"""


def test_office_settings_fit_a_390_px_phone(phone, server, repo):  # noqa: F811
    """A workspace name of one long word and errors naming a long path, at 390 px."""
    with server.client() as api:
        api.patch("/api/office/settings", headers=keyed(),
                  json={"name": "platform_infrastructure_nightly_maintenance_workspace"}).raise_for_status()
    phone.goto(server.url + "/office/settings")
    assert phone.evaluate("document.documentElement.scrollWidth") <= 390, phone.evaluate(PAST_THE_EDGE)
    assert not phone.evaluate(PAST_THE_EDGE)
    phone.fill("input[name=repository]", str(repo))
    phone.fill("input[name=source_ref]", "no_such_branch_of_this_repository_anywhere_on_this_machine_at_all")
    phone.click("#save-settings")
    phone.wait_for_selector(".field-error")
    assert phone.evaluate("document.documentElement.scrollWidth") <= 390, phone.evaluate(PAST_THE_EDGE)
    assert not phone.evaluate(PAST_THE_EDGE)
    shot(phone, "phone-office-settings")

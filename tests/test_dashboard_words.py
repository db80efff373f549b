"""The dashboard's words (issue 36, item 7), in process: the review (its summary and its facts)
says a schedule's policies in the compose form's words, and a paused schedule or routine shows
"paused" where its next fire was."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from conftest import T0, call, make_deps, make_repo, new_agent, normalized, sign_in_client

import outpost


@pytest.fixture
def dashboard(tmp_path: Path):
    deps = make_deps(tmp_path)
    client = outpost.create_app(deps).test_client()
    csrf = sign_in_client(client, deps.store, T0)
    yield deps.store, client, csrf
    deps.store.close()


async def text_of(client, path: str, **post) -> str:
    response = await (client.post(path, form=post, headers={"Accept": "text/html"}) if post
                      else client.get(path, headers={"Accept": "text/html"}))
    assert response.status_code == 200, path
    return await response.get_data(as_text=True)


def test_every_policy_and_signing_mode_has_its_words():
    assert list(outpost.POLICY_WORDS["concurrency_policy"]) == list(outpost.CONCURRENCY_POLICIES)
    assert list(outpost.POLICY_WORDS["catch_up"]) == list(outpost.CATCH_UP_POLICIES)
    assert list(outpost.POLICY_WORDS["notify"]) == list(outpost.NOTIFY_POLICIES)
    assert set(outpost.SIGNING_WORDS) == set(outpost.SIGNING_MODES)


def options(page: str, name: str) -> dict[str, str]:
    """A form menu's choices: value -> the words shown."""
    menu = re.search(rf'<select name="{name}">(.*?)</select>', page, re.S)[1]
    return {v: html.unescape(words) for v, words in re.findall(r'<option value="([^"]+)"[^>]*>([^<]+)</option>', menu)}


def fact(page: str, policy: str) -> str:
    return html.unescape(re.search(rf'<dd data-policy="{policy}">([^<]*)</dd>', page)[1])


async def test_the_review_says_the_policies_in_the_words_of_the_form(dashboard, tmp_path):
    store, client, csrf = dashboard
    form = await text_of(client, "/schedules/new")
    review = await text_of(client, "/schedules/review", csrf=csrf, name="words", brief="@print hi",
                           repository=str(make_repo(tmp_path / "repo")), timing_kind="cron", expression="0 9 * * *",
                           timezone="UTC", concurrency_policy="coalesce_if_active", catch_up_policy="skip_missed",
                           notify="failures_only", skip_if_unchanged="yes", timeout_seconds="600")
    summary = html.unescape(re.search(r'<p id="review-summary">([^<]+)</p>', review)[1])
    assert "while a run is still active, fold it into the active run;" in summary, summary
    assert summary.endswith("attention: failures and needs-you only; skips a fire when the commit has not changed "
                            "since its last successful run."), summary
    assert fact(review, "concurrency_policy") == options(form, "concurrency_policy")["coalesce_if_active"] \
        == "fold it into the active run"
    assert fact(review, "catch_up") == options(form, "catch_up_policy")["skip_missed"] == "skip what was missed"
    assert fact(review, "notify") == options(form, "notify")["failures_only"] == "failures and needs-you only"
    assert fact(review, "skip_if_unchanged") == "yes"
    shown = re.sub(r'<input type="hidden"[^>]*>', "", review)   # the signed definition travels raw, unseen
    for raw in ("coalesce_if_active", "skip_missed", "failures_only"):
        assert raw not in shown, raw

    capped = await text_of(client, "/schedules/review", csrf=csrf, name="capped", brief="@print hi",
                           repository=str(tmp_path / "repo"), timing_kind="cron", expression="0 9 * * *",
                           timezone="UTC", catch_up_policy="enqueue_missed_with_cap", catch_up_max="3")
    assert fact(capped, "catch_up") == "catch up (missed fires fold into runs), at most 3 catch-up runs"
    assert fact(capped, "concurrency_policy") == "skip the new fire" and fact(capped, "skip_if_unchanged") == "no"


async def test_a_schedule_page_says_its_policies_in_the_form_s_words(dashboard, tmp_path):
    store, client, _ = dashboard
    sid = call(store, store.schedules.create_schedule,
               normalized(make_repo(tmp_path / "repo"), concurrency_policy="always_enqueue", notify="always"), T0)["id"]
    page = await text_of(client, f"/schedules/{sid}")
    assert fact(page, "concurrency_policy") == "queue another run" and fact(page, "notify") == "every run"


def next_fire_cell(page: str, name: str) -> str:
    row = next(r for r in re.findall(r"<tr>(.*?)</tr>", page, re.S) if f">{name}</a>" in r)
    return re.search(r'data-label="Next fire">(.*?)</td>', row, re.S)[1]


async def test_a_paused_schedule_shows_paused_instead_of_a_next_fire(dashboard, tmp_path):
    store, client, _ = dashboard
    repo = make_repo(tmp_path / "repo")
    paused = call(store, store.schedules.create_schedule, normalized(repo, name="held"), T0)
    call(store, store.schedules.create_schedule, normalized(repo, name="going"), T0)
    call(store, store.schedules.control_schedule, paused["id"], paused["revision"], "pause", T0)
    assert call(store, store.schedules.get_schedule, paused["id"])["next_fire_at"], "the store still has one"

    listed = await text_of(client, "/schedules")
    assert "<time" in next_fire_cell(listed, "going")
    assert next_fire_cell(listed, "held") == '<span class="muted" data-next-fire="paused">paused</span>'
    page = await text_of(client, f"/schedules/{paused['id']}")
    assert re.search(r'<dd id="next-fire"><span class="muted" data-next-fire="paused">paused</span></dd>', page)
    assert "It is paused: it does not fire on its timing" in page


async def test_a_paused_or_archived_routine_shows_no_next_fire(dashboard):
    store, client, _ = dashboard
    agent = new_agent(store, "Worker", T0)
    routine = call(store, store.routines.create_routine, None,
                   outpost.normalize_routine({"name": "nightly", "assignee_agent_id": agent}),
                   [outpost.normalize_trigger({"kind": "schedule", "cron_expression": "0 3 * * *"}, 0, T0, "UTC")],
                   T0)
    trigger = routine["triggers"][0]["id"]
    listed = await text_of(client, "/office/routines")
    assert "<time" in next_fire_cell(listed, "nightly")
    assert "<time" in re.search(rf'id="next-fire-{trigger}">(.*?)</span>', await text_of(
        client, f"/office/routines/{routine['id']}"))[1]
    for status in ("paused", "archived"):
        current = call(store, store.routines.routine_fields, routine["id"])
        call(store, store.routines.update_routine, routine["id"],
             outpost.normalize_routine({"status": status}, current=current), T0)
        listed = await text_of(client, "/office/routines")
        assert f'data-next-fire="{status}">{status}</span>' in next_fire_cell(listed, "nightly")
        page = await text_of(client, f"/office/routines/{routine['id']}")
        assert re.search(rf'id="next-fire-{trigger}"><span class="muted" data-next-fire="{status}">{status}</span>',
                         page), status

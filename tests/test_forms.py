"""Every dashboard form, submitted once with every field wrong: each error is shown at its field
(the input is aria-invalid and described by an element holding the message), none is held back
for a second submit, and the top of the form lists them all. Then the messages themselves
(docs/schedules.md "When a definition is refused"): each names its field and says what to write."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from conftest import (
    PROBLEM,
    T0,
    Api,
    call,
    definition,
    ended,
    git,
    make_deps,
    make_repo,
    new_agent,
    normalized,
    sign_in_client,
)

import outpost


@pytest.fixture
def dashboard(tmp_path: Path):
    deps = make_deps(tmp_path)
    yield deps
    deps.store.close()


def field_errors(page: str) -> dict[str, str]:
    """Each form field the page marks invalid -> the text of what describes it (its error)."""
    texts = {m[1]: html.unescape(m[2]).strip()
             for m in re.finditer(r'<(?:span|p) class="field-error" id="([^"]+)"[^>]*>(.*?)</(?:span|p)>', page, re.S)}
    shown = {}
    for tag in re.finditer(r"<(?:input|select|textarea)\b[^>]*>", page):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', tag[0]))
        if attrs.get("aria-invalid") == "true":
            ids = attrs["aria-describedby"].split()
            assert all(i in texts for i in ids), (attrs["name"], ids, "describedby names no error on the page")
            shown[attrs["name"]] = " | ".join(texts[i] for i in ids)
    return shown


def summary(page: str) -> str:
    block = re.search(r'<div class="notice bad" id="[^"]+" role="alert">(.*?)</div>', page, re.S)
    assert block, "the form lists its errors at the top"
    return html.unescape(re.sub(r"<[^>]+>", "", block[1]))


async def submit(client, csrf: str, path: str, form: dict[str, str]) -> str:
    response = await client.post(path, form={"csrf": csrf, **form}, headers={"Accept": "text/html"})
    page = await response.get_data(as_text=True)
    assert response.status_code in (409, 422), (path, response.status_code, page[:500])
    return page


def assert_at_fields(page: str, expected: dict[str, str]) -> None:
    """Each named input shows an error holding the given words; the summary holds each too."""
    shown, top = field_errors(page), summary(page)
    for name, words in expected.items():
        assert name in shown, (name, "not marked; marked:", sorted(shown))
        assert words in shown[name], (name, shown[name])
        assert words in top, (name, "not in the summary")


#: The compose form with every field wrong.
WRONG_SCHEDULE = {
    "name": "x" * 101, "brief": "", "repository": "relative/path", "source_ref": "-x", "workdir": "../up",
    "agent": "nobody", "timing_kind": "cron", "expression": "61 25 * * mon", "timezone": "PST",
    "timeout_seconds": "0", "model": "m" * 201, "notify": "loud", "concurrency_policy": "twice",
    "catch_up_policy": "enqueue_missed_with_cap", "catch_up_max": "99"}
SCHEDULE_ERRORS = {
    "name": "1-100 characters", "brief": "1-32768 characters", "repository": "absolute path",
    "source_ref": "not starting with '-'", "workdir": "relative path", "agent": "no agent profile named 'nobody'",
    "expression": "minute 61 is out of range 0-59; hour 25 is out of range 0-23",
    "timezone": "did you mean America/Los_Angeles?", "timeout_seconds": "between 1 and 86400",
    "model": "1-200 characters", "notify": "attention, failures_only or always",
    "concurrency_policy": "skip_if_active", "catch_up_max": "between 1 and 25"}


async def test_compose_shows_every_error_at_its_field_on_the_first_submit(dashboard):
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    page = await submit(client, csrf, "/schedules/review", WRONG_SCHEDULE)
    assert_at_fields(page, SCHEDULE_ERRORS)
    assert 'id="review-button"' in page, "still the form, not the review"


async def test_compose_tells_a_taken_name_with_the_other_errors_before_confirm(dashboard, tmp_path):
    repo = make_repo(tmp_path / "repo")
    call(dashboard.store, dashboard.store.schedules.create_schedule, normalized(repo, name="nightly"), T0)
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    page = await submit(client, csrf, "/schedules/review", {
        "name": "nightly", "brief": "hi", "repository": str(repo), "timing_kind": "cron", "expression": "0 9 * * *",
        "timezone": "Europe/Berlinn", "agent": "demo"})
    assert_at_fields(page, {"name": "already used by another schedule", "timezone": "did you mean Europe/Berlin?"})
    alone = await submit(client, csrf, "/schedules/review", {
        "name": "nightly", "brief": "hi", "repository": str(repo), "timing_kind": "cron", "expression": "0 9 * * *",
        "timezone": "UTC", "agent": "demo"})
    assert_at_fields(alone, {"name": "already used by another schedule"})


async def test_the_edit_form_and_each_timing_kind_show_every_error(dashboard, tmp_path):
    repo = make_repo(tmp_path / "repo")
    current = normalized(repo, name="nightly")
    sid = call(dashboard.store, dashboard.store.schedules.create_schedule, current, T0)["id"]
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    edit = {"base": outpost.canonical_json(current), "revision": "1"}
    page = await submit(client, csrf, f"/schedules/{sid}/review", {**WRONG_SCHEDULE, **edit})
    assert_at_fields(page, SCHEDULE_ERRORS)
    interval = await submit(client, csrf, f"/schedules/{sid}/review", {
        **WRONG_SCHEDULE, **edit, "timing_kind": "interval", "interval_amount": "5", "interval_unit": "seconds"})
    assert_at_fields(interval, {"interval_amount": "between 10 and", "timezone": "America/Los_Angeles"})
    once = await submit(client, csrf, f"/schedules/{sid}/review", {
        **WRONG_SCHEDULE, **edit, "timing_kind": "once", "at": "soon", "timezone": "Europe/Berlinn"})
    assert_at_fields(once, {"at": "'soon' is not an ISO 8601 date and time", "timezone": "Europe/Berlin"})


WRONG_AGENT = {"name": " ", "role": "boss", "executor": "nobody", "max_concurrent_sessions": "99",
               "cooldown_sec": "-1", "instructions": "x" * (outpost.MAX_TEXT_CHARS + 1)}
AGENT_ERRORS = {"name": "must not be blank", "role": "must be coordinator, worker",
                "executor": "no agent profile named",
                "max_concurrent_sessions": "between 1 and 16", "cooldown_sec": "between 0 and 86400",
                "instructions": "characters long"}


async def test_the_agent_forms_show_every_error_at_its_field(dashboard):
    agent_id = new_agent(dashboard.store, "Worker", T0)
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    assert_at_fields(await submit(client, csrf, "/office/agents", WRONG_AGENT), AGENT_ERRORS)
    edited = await submit(client, csrf, f"/office/agents/{agent_id}", {
        **WRONG_AGENT, "status": "asleep", "budget_runs_per_day": "many", "budget_usd_per_day": "lots",
        "budget_usd_per_month": "0"})
    assert_at_fields(edited, {**AGENT_ERRORS, "status": "idle, paused or stopped",
                              "budget_runs_per_day": "whole number", "budget_usd_per_day": "US dollars",
                              "budget_usd_per_month": "from 0.01"})
    woken = await submit(client, csrf, f"/office/agents/{agent_id}/wake", {"context": "x" * 50_000})
    assert_at_fields(woken, {"context": "characters long"})


async def test_the_new_task_form_shows_every_error_at_its_field(dashboard):
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    page = await submit(client, csrf, "/office/tasks", {"title": " ", "description": "x" * 100_001})
    assert_at_fields(page, {"title": "must not be blank", "description": "0-100000 characters"})


async def test_office_settings_shows_every_error_at_once(dashboard, tmp_path):
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    page = await submit(client, csrf, "/office/settings", {
        "name": "n" * 101, "timezone": "Europe/Berlinn", "repository": "relative", "source_ref": "-bad",
        "default_executor": "nobody", "recovery_lookback_hours": "a day", "budget_runs_per_day": "0",
        "budget_usd_per_day": "lots", "budget_usd_per_month": "0", "budget_action": "explode"})
    assert_at_fields(page, {
        "name": "1-100 characters", "timezone": "did you mean Europe/Berlin?", "repository": "absolute path",
        "source_ref": "not starting with '-'", "default_executor": "no agent profile named",
        "recovery_lookback_hours": "number of hours", "budget_runs_per_day": "between 1 and",
        "budget_usd_per_day": "US dollars", "budget_usd_per_month": "from 0.01", "budget_action": "pause"})
    missing = await submit(client, csrf, "/office/settings", {"name": " ", "repository": str(tmp_path / "nope")})
    assert_at_fields(missing, {"name": "must not be blank", "repository": "is not an existing git repository"})


WRONG_ROUTINE = {"name": " ", "description": "d" * 10_001, "assignee_agent_id": "", "concurrency_policy": "twice",
                 "catch_up_policy": "never", "catch_up_max": "0", "variables": "9bad:text",
                 "heavy": "1", "template_title": "t" * 201}
ROUTINE_ERRORS = {"name": "must not be blank", "description": "0-10000 characters",
                  "assignee_agent_id": "wakes one agent", "concurrency_policy": "coalesce_if_active",
                  "catch_up_policy": "skip_missed", "catch_up_max": "between 1 and 1000",
                  "variables": "a name like branch", "template_title": "0-200 characters"}


async def test_the_routine_forms_show_every_error_at_its_field(dashboard):
    agent_id = new_agent(dashboard.store, "Worker", T0)
    routine = call(dashboard.store, dashboard.store.routines.create_routine, None,
                   outpost.normalize_routine({"name": "nightly", "assignee_agent_id": agent_id}), [], T0)
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    made = await submit(client, csrf, "/office/routines", {
        **WRONG_ROUTINE, "cron_expression": "61 25 * * mon", "timezone": "PST", "webhook_mode": "carrier-pigeon"})
    assert_at_fields(made, {**ROUTINE_ERRORS, "cron_expression": "minute 61 is out of range 0-59",
                            "timezone": "did you mean America/Los_Angeles?", "webhook_mode": "hmac_sha256"})
    assert call(dashboard.store, dashboard.store.routines.list_routines, None)[0]["id"] == routine["id"]
    edited = await submit(client, csrf, f"/office/routines/{routine['id']}", WRONG_ROUTINE)
    assert_at_fields(edited, ROUTINE_ERRORS)
    trigger = await submit(client, csrf, f"/office/routines/{routine['id']}/triggers",
                           {"kind": "schedule", "cron_expression": "* 24 * * *"})
    assert_at_fields(trigger, {"cron_expression": "hour 24 is out of range 0-23"})


async def test_a_form_error_that_belongs_to_no_field_is_still_shown(dashboard, tmp_path):
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    response = await client.post("/schedules/review", headers={"Accept": "text/html"}, form={
        "csrf": csrf, **WRONG_SCHEDULE, "timing_kind": "hourly"})
    page = await response.get_data(as_text=True)
    assert "timing.kind" in summary(page) and "must be cron, interval or once" in summary(page)
    assert "did you mean America/Los_Angeles?" in field_errors(page)["timezone"]


# --- the messages: each names its field and says what to write instead ------------------------------

def errors_of(reply) -> dict[str, str]:
    assert reply.status == 422 and reply.mimetype == PROBLEM, (reply.status, reply.body)
    errors = {e["field"]: e["message"] for e in reply.body["errors"]}
    for field, message in errors.items():   # the detail (what the CLI prints) holds each one too
        assert f"{field}: {message}" in reply.body["detail"]
    return errors


@pytest.fixture
async def api(tmp_path: Path, git_repo: Path):
    deps = make_deps(tmp_path)
    yield Api(deps, git_repo)
    deps.store.close()


async def test_an_interval_written_as_every_6h_says_to_use_seconds(api):
    errors = errors_of(await api.compose(api.raw(timing={"kind": "interval", "every": "6h", "timezone": "UTC"})))
    assert errors == {"timing.every": "is not a field of interval timing: an interval is given in seconds; "
                                      "use seconds = 21600 (6h)"}
    bare = errors_of(await api.compose(api.raw(timing={"kind": "interval", "timezone": "UTC"})))
    assert "in seconds" in bare["timing.seconds"]


async def test_a_cron_out_of_range_names_each_field(api):
    errors = errors_of(await api.compose(api.raw(timing={"kind": "cron", "expression": "61 25 * * mon",
                                                         "timezone": "UTC"})))
    assert errors["timing.expression"] == "minute 61 is out of range 0-59; hour 25 is out of range 0-23"
    steps = errors_of(await api.compose(api.raw(timing={"kind": "cron", "expression": "*/0 * 0 13 8",
                                                        "timezone": "UTC"})))
    assert steps["timing.expression"].split("; ") == [
        "minute step /0 is out of range 1-60", "day-of-month 0 is out of range 1-31",
        "month 13 is out of range 1-12", "day-of-week 8 is out of range 0-6"]
    names = errors_of(await api.compose(api.raw(timing={"kind": "cron", "expression": "mon 9 * * *",
                                                        "timezone": "UTC"})))
    assert "minute 'mon' is not a value of that field (it takes numbers 0-59)" in names["timing.expression"]


@pytest.mark.parametrize(("zone", "suggested"), [("PST", "America/Los_Angeles"), ("Europe/Berlinn", "Europe/Berlin"),
                                                 ("CEST", "Europe/Berlin"), ("EDT", "America/New_York"),
                                                 ("berlin", "Europe/Berlin"), ("america/new_york", "America/New_York")])
async def test_a_zone_that_is_no_iana_name_gets_the_closest_names(api, zone, suggested):
    errors = errors_of(await api.compose(api.raw(timing={"kind": "cron", "expression": "0 9 * * *",
                                                         "timezone": zone})))
    assert f"did you mean {suggested}?" in errors["timing.timezone"]
    settings = errors_of(await api.patch("/api/office/settings", {"timezone": zone}))
    assert f"did you mean {suggested}?" in settings["timezone"]


async def test_a_zone_far_from_any_name_gets_an_example_and_a_cron_error_beside_it(api):
    errors = errors_of(await api.compose(api.raw(timing={"kind": "cron", "expression": "0 9 * *",
                                                         "timezone": "Mars/Olympus"})))
    assert "such as Europe/Berlin" in errors["timing.timezone"] and "five fields" in errors["timing.expression"]


async def test_an_unknown_field_gets_a_did_you_mean(api):
    raw = {**api.raw(), "brif": "x", "concurency_policy": "skip_if_active"}
    raw["timing"] = {**raw["timing"], "expresion": "0 9 * * *"}
    raw["limits"] = {"timeout": 60}
    errors = errors_of(await api.compose(raw))
    assert errors["brif"] == "is not a field of a schedule definition; did you mean brief?"
    assert errors["concurency_policy"].endswith("did you mean concurrency_policy?")
    assert errors["timing.expresion"].endswith("did you mean expression?")
    assert errors["limits.timeout"].endswith("did you mean timeout_seconds?")


async def test_a_source_ref_that_does_not_resolve_lists_the_branches(api):
    for branch in ("develop", "release/1.0"):
        git(api.repo, "branch", branch)
    errors = errors_of(await api.compose(api.raw(source_ref="mian")))
    assert "its branches: " in errors["source_ref"] and "did you mean main?" in errors["source_ref"]
    assert {"develop", "main", "release/1.0"} <= set(errors["source_ref"].split("its branches: ")[1]
                                                     .split(";")[0].split(", "))


async def test_branches_listed_stop_at_ten(api):
    for i in range(14):
        git(api.repo, "branch", f"topic-{i:02}")
    listed = errors_of(await api.compose(api.raw(source_ref="nope")))["source_ref"].split("its branches: ")[1]
    assert len(listed.split(", ")) == outpost.BRANCHES_LISTED + 1 and listed.endswith(", ...")


async def test_a_repository_with_no_commit_says_make_a_first_commit(api, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q", "-b", "main")
    errors = errors_of(await api.compose(api.raw(repository=str(empty))))
    assert "no commit yet: make a first commit" in errors["source_ref"]
    assert f"git -C {empty} commit --allow-empty" in errors["source_ref"]


@pytest.mark.parametrize(("toml", "words"), [
    ("[settings]\nmax_runing = 2\n", "did you mean max_running?"),
    ("[setings]\n", "did you mean settings?"),
    ('[agents.me]\npreset = "claude-code"\ntimezone = "PST"\n', "did you mean America/Los_Angeles?"),
    ('[agents.me]\npreset = "claude-code"\ntimeout_second = 60\n', "did you mean timeout_seconds?"),
])
def test_outpost_toml_refusals_suggest_the_key_or_zone(tmp_path, toml, words):
    (tmp_path / "outpost.toml").write_text(toml)
    with pytest.raises(outpost.ConfigError) as refused:
        outpost.load_config(tmp_path)
    assert words in str(refused.value)


# --- "Why didn't it run?": a verdict first, the checks below -----------------------------------------

def verdict_of(store, sid: str) -> str:
    return call(store, store.schedules.inspect, sid)["verdict"]


async def test_the_schedule_page_puts_a_verdict_before_the_raw_checks(dashboard, tmp_path):
    repo = make_repo(tmp_path / "repo")
    store = dashboard.store
    timing = {"kind": "cron", "expression": "0 9 * * *", "timezone": "Europe/Berlin"}
    sid = call(store, store.schedules.create_schedule, normalized(repo, name="nightly", timing=timing), T0)["id"]
    assert verdict_of(store, sid).startswith("Healthy: it has not fired yet. Next fire at ")
    run_id = call(store, store.schedules.fire_manual, sid, 1, T0)["run_id"]
    assert verdict_of(store, sid).startswith(f"It is running now (run {run_id}): a fire due meanwhile is skipped "
                                             "(skip_if_active).")
    call(store, store.runs.admit_ready, 2, T0)
    call(store, store.runs.settle_run, run_id, ended(outpost.RunStatus.SUCCEEDED), T0, exit_code=0)
    ran = verdict_of(store, sid)
    assert ran.startswith(f"It ran at {T0.astimezone(outpost.ZoneInfo('Europe/Berlin')):%Y-%m-%d %H:%M} CET "
                          f"(run {run_id}): succeeded. Next fire at ")
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, store, T0)
    page = await (await client.get(f"/schedules/{sid}", headers={"Accept": "text/html"})).get_data(as_text=True)
    panel = page[page.index('id="why-panel"'):]
    assert panel.index('id="verdict"') < panel.index("<details") < panel.index("event cursor")
    assert html.escape(ran, quote=False) in panel[:panel.index("<details")]
    call(store, store.schedules.control_schedule, sid, 1, "pause", T0)
    berlin = T0.astimezone(outpost.ZoneInfo("Europe/Berlin"))
    assert verdict_of(store, sid) == f"It is paused since {berlin:%Y-%m-%d %H:%M} CET: it does not fire until enabled."


async def test_a_skipped_fire_is_the_verdict_when_it_is_the_latest(dashboard, tmp_path):
    store = dashboard.store
    sid = call(store, store.schedules.create_schedule, normalized(make_repo(tmp_path / "repo")), T0)["id"]
    first = call(store, store.schedules.fire_manual, sid, 1, T0)["run_id"]
    later = T0 + outpost.timedelta(minutes=5)
    fired = call(store, store.schedules.fire_manual, sid, 1, later)
    assert fired["outcome"] == outpost.SlotOutcome.SKIPPED_OVERLAP, fired
    call(store, store.runs.admit_ready, 2, later)
    call(store, store.runs.settle_run, first, ended(outpost.RunStatus.SUCCEEDED), later, exit_code=0)
    assert "was skipped: a run was still active (skip_if_active). Next fire at " in verdict_of(store, sid)


async def test_a_settled_rerun_is_the_verdict_and_the_schedule_page_still_opens(dashboard, tmp_path):
    """A re-run (or a reply) has no due instant: the verdict says what it was, and the schedule's
    page answers 200 (a new user found it 500 once the re-run settled)."""
    store = dashboard.store
    sid = call(store, store.schedules.create_schedule, normalized(make_repo(tmp_path / "repo")), T0)["id"]
    first = call(store, store.schedules.fire_manual, sid, 1, T0)["run_id"]
    call(store, store.runs.admit_ready, 2, T0)
    call(store, store.runs.set_resolved_commit, first, "0" * 40)
    call(store, store.runs.settle_run, first, ended(outpost.RunStatus.SUCCEEDED), T0, exit_code=0)
    later = T0 + outpost.timedelta(minutes=5)
    again = call(store, store.runs.rerun, first, later)["run_id"]
    call(store, store.runs.admit_ready, 2, later)
    call(store, store.runs.settle_run, again, ended(outpost.RunStatus.FAILED), later, exit_code=1)
    assert verdict_of(store, sid).startswith(f"Its latest run (run {again}) was a re-run or a reply, not a fire: "
                                             "failed. Next fire at ")
    client = outpost.create_app(dashboard).test_client()
    sign_in_client(client, store, T0)
    assert (await client.get(f"/schedules/{sid}", headers={"Accept": "text/html"})).status_code == 200


async def test_a_routine_trigger_refused_over_the_api_names_the_trigger_field_with_the_suggestion(api):
    agent = (await api.post("/api/office/agents", {"name": "Worker", "executor": "demo"})).body
    reply = await api.post("/api/office/routines", {
        "name": " ", "assignee_agent_id": agent["id"],
        "triggers": [{"kind": "schedule", "cron_expression": "0 9 * * *", "timezone": "PST"},
                     {"kind": "schedule", "cron_expression": "0 24 * * *"}]})
    errors = errors_of(reply)
    assert errors == {"name": "must not be blank",
                      "triggers[0].timezone": "'PST' is not an IANA timezone name; did you mean America/Los_Angeles?",
                      "triggers[1].cron_expression": "hour 24 is out of range 0-23"}


def test_a_huge_zone_or_field_name_is_refused_without_a_suggestion_search():
    assert outpost.zone_suggestions("Europe/" + "x" * 100_000) == []
    assert outpost.did_you_mean("b" * 100_000, ["brief"]) == ""


async def test_the_cli_prints_every_message_of_the_refusal(api, monkeypatch):
    """``outpost schedules create`` shows what the API answered: each field with its suggestion."""
    import io
    import urllib.error
    raw = api.raw(timing={"kind": "interval", "every": "6h", "timezone": "PST"})
    answer = await api.compose(raw)

    def refuse(request, timeout):
        raise urllib.error.HTTPError(request.full_url, answer.status, "Unprocessable", {},
                                     io.BytesIO(json.dumps(answer.body).encode()))
    monkeypatch.setattr(outpost.urllib.request, "urlopen", refuse)
    with pytest.raises(outpost.CliError) as refused:
        outpost.Client("http://127.0.0.1:9", "t").call("POST", "/v1/outpost/schedules/compose", raw)
    assert "use seconds = 21600" in str(refused.value) and "did you mean America/Los_Angeles?" in str(refused.value)


async def test_run_now_shows_each_missing_variable_at_its_field(dashboard):
    agent_id = new_agent(dashboard.store, "Worker", T0)
    routine = call(dashboard.store, dashboard.store.routines.create_routine, None, outpost.normalize_routine({
        "name": "deploy", "assignee_agent_id": agent_id,
        "variables": [{"name": "branch", "type": "text", "required": True},
                      {"name": "target", "type": "select", "options": ["eu", "us"], "required": True}]}), [], T0)
    client = outpost.create_app(dashboard).test_client()
    csrf = sign_in_client(client, dashboard.store, T0)
    page = await submit(client, csrf, f"/office/routines/{routine['id']}/fire", {})
    assert_at_fields(page, {"var_branch": "is required", "var_target": "is required"})


# --- the dashboard's Confirm forms, as a forged form could post them --------------------------------

async def confirm_form(dashboard, tmp_path, name: str = "taken"):
    """A signed-in client, its CSRF token, the repository and a schedule named ``name``."""
    repo = make_repo(tmp_path / "repo")
    store = dashboard.store
    sid = call(store, store.schedules.create_schedule, normalized(repo, name=name), T0)["id"]
    client = outpost.create_app(dashboard).test_client()
    return client, sign_in_client(client, store, T0), repo, sid


async def test_a_taken_name_at_confirm_gives_the_form_again_even_for_a_definition_with_fields_left_out(
        dashboard, tmp_path):
    """A Confirm form whose definition leaves fields to their defaults (not the review's own) and
    whose name is taken: 409 and the form again, filled in, never a 500 (an adversary found it)."""
    client, csrf, repo, _ = await confirm_form(dashboard, tmp_path)
    raw = definition(repo, name="  taken ")
    confirmation = outpost.confirmation_of(outpost.normalize_definition(raw, T0, agents=["demo"]))
    reply = await client.post("/schedules", form={"csrf": csrf, "definition": json.dumps(raw),
                                                  "confirmation": confirmation}, headers={"Accept": "text/html"})
    page = await reply.get_data(as_text=True)
    assert reply.status_code == 409, page[:300]
    assert 'value="taken"' in page and "already used by another schedule" in page


async def test_a_stale_confirm_shows_only_what_the_edit_changed(dashboard, tmp_path):
    """Two edits from one revision: the second's page lists the fields it changed, its own
    definition filled in as its check would (not every defaulted field as changed to nothing)."""
    client, csrf, repo, sid = await confirm_form(dashboard, tmp_path, "first")
    store = dashboard.store
    base = call(store, store.schedules.schedule_definition, sid)["definition"]
    call(store, store.schedules.update_schedule, sid, 1, {**base, "name": "second"}, T0)
    raw = definition(repo, name="third")
    confirmation = outpost.confirmation_of(outpost.normalize_definition(raw, T0, agents=["demo"]))
    reply = await client.post(f"/schedules/{sid}", form={
        "csrf": csrf, "revision": "1", "base": json.dumps(base), "definition": json.dumps(raw),
        "confirmation": confirmation}, headers={"Accept": "text/html"})
    page = await reply.get_data(as_text=True)
    assert reply.status_code == 412
    rows = re.findall(r'<tr[^>]*>\s*<t[hd][^>]*>\s*(?:<code>)?([a-z_]+)', page[page.index("<table"):])
    assert rows == ["name"], rows


async def test_a_dashboard_edit_cannot_store_a_past_instant_by_forging_its_base(dashboard, tmp_path):
    """The Confirm form's ``base`` is only what the edit started from: the past-instant rule is
    judged against the stored definition, as on the API (a once-instant in the past: 422)."""
    client, csrf, repo, sid = await confirm_form(dashboard, tmp_path, "soon")
    past = {"kind": "once", "at": "2000-01-01T00:00:00Z", "timezone": "UTC"}
    forged = {**call(dashboard.store, dashboard.store.schedules.schedule_definition, sid)["definition"],
              "timing": past}
    raw = outpost.normalize_definition(forged, T0, agents=["demo"], check_past=False)
    reply = await client.post(f"/schedules/{sid}", form={
        "csrf": csrf, "revision": "1", "base": json.dumps(raw), "definition": json.dumps(raw),
        "confirmation": outpost.confirmation_of(raw)}, headers={"Accept": "text/html"})
    assert reply.status_code == 422
    stored = call(dashboard.store, dashboard.store.schedules.schedule_definition, sid)
    assert stored["revision"] == 1 and stored["definition"]["timing"]["kind"] != "once"


@pytest.mark.parametrize("base", ["[]", '"x"', "1", "{}", '{"name": []}', "[1, 2]"])
async def test_an_edit_form_whose_base_is_no_definition_is_422_naming_it(dashboard, tmp_path, base):
    client, csrf, repo, sid = await confirm_form(dashboard, tmp_path, "kept")
    for path in (f"/schedules/{sid}/review", f"/schedules/{sid}"):
        reply = await client.post(path, form={"csrf": csrf, "revision": "1", "base": base, "definition": "{}"},
                                  headers={"Accept": "text/html"})
        assert reply.status_code == 422, (path, base)
        assert "the edit form is incomplete; open Edit again" in await reply.get_data(as_text=True)

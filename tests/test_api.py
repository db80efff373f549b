"""The HTTP contract of docs/http-api.md (the JSON API), in process, through Quart's test client.

No actors run here: runs stay ``queued`` unless a test settles them through the store.
Time is a ``FixedClock`` at ``T0`` so next fires and timestamps are exact."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import (
    AUTH,
    PROBLEM,
    RFC3339_Z,
    T0,
    TOKEN,
    Api,
    assert_problem,
    definition,
    git,
    make_deps,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import outpost


@pytest.fixture
async def api(tmp_path: Path, git_repo: Path):
    deps = make_deps(tmp_path)
    yield Api(deps, git_repo)
    deps.store.close()


def z(dt) -> str:
    return outpost.rfc3339(dt)


###############################################################################
# 3. Conventions: auth, host allowlist, bodies, errors.
###############################################################################

@pytest.mark.parametrize("authorization", [None, "Bearer nope", "Bearer ", f"Basic {TOKEN}", TOKEN,
                                           f"Bearer {TOKEN}x"])
async def test_missing_or_wrong_token_is_401(api, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    reply = await api.get("/v1/outpost/schedules", auth=False, headers=headers)
    assert_problem(reply, 401, "unauthorized")


async def test_every_api_path_needs_the_token(api):
    for method, path in [("GET", "/v1/outpost/runs"), ("GET", "/v1/outpost/snapshot"),
                         ("POST", "/v1/outpost/schedules/compose"), ("POST", "/v1/outpost/dispatches"),
                         ("GET", "/v1/outpost/no-such-thing")]:
        reply = await api.request(method, path, {}, auth=False)
        assert_problem(reply, 401, "unauthorized")
    assert (await api.get("/v1/outpost/schedules")).status == 200


@pytest.mark.parametrize("route", [r for t in (outpost.api, outpost.office_api, outpost.agent_api)
                                   for r in t.routes if r.auth in (outpost.Auth.TOKEN, outpost.Auth.RUN)],
                         ids=lambda r: f"{r.method} {r.rule}")
async def test_a_json_api_path_without_credentials_is_401_problem_json_never_a_sign_in_redirect(api, route):
    """Review found GET /api/office/agents answering 302 to the sign-in page: every JSON path
    of the tables answers 401 problem+json to a caller with neither token nor session."""
    path = re.sub(r"<(\w+)>", "x", route.rule)
    reply = await api.request(route.method, path, {}, auth=False, headers={"Accept": "text/html"})
    assert_problem(reply, 401, "unauthorized")


async def test_unknown_paths_answer_404_problem_json_under_the_apis(api):
    for path in ("/v1/outpost/no-such-thing", "/api/office/no-such-thing"):
        assert_problem(await api.get(path), 404, "not_found")
    assert_problem(await api.request("PUT", "/v1/outpost/schedules"), 405, "method_not_allowed")


async def test_healthz_needs_no_token(api):
    reply = await api.get("/healthz", auth=False)
    assert reply.status == 200
    assert reply.body["ok"] is True


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8321", "127.0.0.1.evil.example",
                                  "localhost.evil.example:8321", "10.0.0.5:8321"])
async def test_foreign_host_is_403_forbidden_host(api, host):
    for path in ("/v1/outpost/schedules", "/healthz"):
        assert_problem(await api.get(path, headers={"Host": host}), 403, "forbidden_host")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8321", "localhost", "localhost:9000", "[::1]:8321",
                                  "[::1]", "LOCALHOST:8321"])
async def test_local_hosts_are_allowed_on_any_port(api, host):
    assert (await api.get("/v1/outpost/schedules", headers={"Host": host})).status == 200


async def test_host_named_in_settings_is_allowed(tmp_path, git_repo):
    deps = make_deps(tmp_path, allowed_hosts=("outpost.lan",))
    api = Api(deps, git_repo)
    assert (await api.get("/v1/outpost/schedules", headers={"Host": "outpost.lan:8321"})).status == 200
    assert (await api.get("/v1/outpost/schedules", headers={"Host": "outpost.lan"})).status == 200
    assert_problem(await api.get("/v1/outpost/schedules", headers={"Host": "other.lan"}), 403, "forbidden_host")
    deps.store.close()


async def test_body_over_one_mib_is_413(api):
    big = b'{"name": "' + b"x" * outpost.MAX_BODY_BYTES + b'"}'
    assert_problem(await api.post("/v1/outpost/schedules/compose", raw=big), 413, "payload_too_large")
    assert_problem(await api.post("/v1/outpost/schedules", raw=big), 413, "payload_too_large")
    assert_problem(await api.post("/v1/outpost/dispatches", raw=big), 413, "payload_too_large")
    assert (await api.get("/v1/outpost/schedules")).body == {"schedules": []}


async def test_body_of_exactly_one_mib_is_accepted(api):
    body = json.dumps(api.raw()).encode()
    padded = body + b" " * (outpost.MAX_BODY_BYTES - len(body))
    assert len(padded) == outpost.MAX_BODY_BYTES
    assert (await api.post("/v1/outpost/schedules/compose", raw=padded)).status == 200


@pytest.mark.parametrize("raw", [b"{", b'{"name": }', b"not json", b'{"a": 1,}', b"\xff\xfe{", b"'x'"])
async def test_malformed_json_is_422(api, raw):
    for path in ("/v1/outpost/schedules/compose", "/v1/outpost/schedules", "/v1/outpost/dispatches"):
        assert_problem(await api.post(path, raw=raw), 422, "validation_failed", "body")


@pytest.mark.parametrize("body", [[], [1, 2], "text", 3, True, None])
async def test_body_that_is_not_an_object_is_422(api, body):
    raw = json.dumps(body).encode()
    for path in ("/v1/outpost/schedules/compose", "/v1/outpost/schedules", "/v1/outpost/dispatches"):
        assert_problem(await api.post(path, raw=raw), 422, "validation_failed", "body")


async def test_deeply_nested_json_is_422_not_500(api):
    raw = b"[" * 100_000 + b"]" * 100_000
    assert_problem(await api.post("/v1/outpost/schedules/compose", raw=raw), 422, "validation_failed")


async def test_unknown_route_is_404_problem(api):
    assert_problem(await api.get("/v1/outpost/no-such-thing"), 404, "not_found")
    assert_problem(await api.get("/no-such-page"), 404, "not_found")


async def test_wrong_method_is_a_problem_not_a_500(api):
    reply = await api.request("DELETE", "/v1/outpost/schedules")
    assert reply.status == 405
    assert reply.mimetype == PROBLEM


###############################################################################
# 4.1-4.2 Compose.
###############################################################################

async def test_compose_returns_normalized_definition_summary_fires_and_confirmation(api):
    raw = api.raw(name="  nightly  ", repository=str(api.repo) + "/./")
    reply = await api.compose(raw)
    assert reply.status == 200, reply.body
    assert reply.mimetype == "application/json"
    d = reply.body["definition"]
    assert d == {"name": "nightly", "brief": "@print hello", "repository": str(api.repo), "workdir": ".",
                 "source_ref": "HEAD", "agent": "demo",
                 "timing": {"kind": "cron", "expression": "*/5 * * * *", "timezone": "UTC"},
                 "limits": {"timeout_seconds": 3600, "model": None}, "notify": "attention",
                 "concurrency_policy": "skip_if_active",
                 "catch_up": {"policy": "enqueue_missed_with_cap", "max": 1}}
    assert isinstance(reply.body["summary"], str) and reply.body["summary"].endswith(".")
    assert "\n" not in reply.body["summary"]
    assert reply.body["next_fires"] == [z(T0 + timedelta(minutes=5 * k)) for k in range(1, 6)]
    assert all(RFC3339_Z.match(f) for f in reply.body["next_fires"])
    assert reply.body["warnings"] == []
    assert reply.body["confirmation"] == outpost.confirmation_of(d)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", reply.body["confirmation"])


async def test_compose_confirmation_is_the_sha256_of_canonical_json(api):
    import hashlib
    reply = await api.compose(api.raw())
    canonical = json.dumps(reply.body["definition"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert reply.body["confirmation"] == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


async def test_compose_keeps_given_values(api):
    raw = api.raw(workdir="sub", source_ref="main", limits={"timeout_seconds": 60, "model": "m1"},
                  notify="always", concurrency_policy="always_enqueue", catch_up={"policy": "skip_missed"},
                  timing={"kind": "interval", "seconds": 3600, "timezone": "Europe/Berlin"})
    reply = await api.compose(raw)
    assert reply.status == 200, reply.body
    d = reply.body["definition"]
    assert (d["workdir"], d["source_ref"], d["limits"], d["notify"], d["concurrency_policy"], d["catch_up"]) == (
        "sub", "main", {"timeout_seconds": 60, "model": "m1"}, "always", "always_enqueue", {"policy": "skip_missed"})
    assert reply.body["next_fires"] == [z(T0 + timedelta(hours=k)) for k in range(1, 6)]


async def test_compose_from_and_count_change_fires_not_confirmation(api):
    raw = api.raw(timing={"kind": "cron", "expression": "30 2 * * *", "timezone": "Europe/Berlin"})
    plain = await api.compose(raw)
    preview = await api.compose(raw, "?from=2027-03-27T00:00:00Z&count=3")
    assert preview.status == 200, preview.body
    # 2027-03-28 02:30 does not exist in Berlin: that day it fires at 03:00 CEST (01:00Z).
    assert preview.body["next_fires"] == ["2027-03-27T01:30:00Z", "2027-03-28T01:00:00Z", "2027-03-29T00:30:00Z"]
    assert len(plain.body["next_fires"]) == 5
    assert plain.body["next_fires"][0] == "2026-12-01T01:30:00Z"
    assert preview.body["confirmation"] == plain.body["confirmation"]
    assert preview.body["definition"] == plain.body["definition"]
    many = await api.compose(raw, "?count=100")
    assert len(many.body["next_fires"]) == 100
    assert many.body["confirmation"] == plain.body["confirmation"]


@pytest.mark.parametrize("query, field", [("?count=0", "count"), ("?count=101", "count"), ("?count=abc", "count"),
                                          ("?from=yesterday", "from"), ("?from=2027-01-01T00:00:00", "from")])
async def test_compose_bad_preview_query_is_422(api, query, field):
    assert_problem(await api.compose(api.raw(), query), 422, "validation_failed", field)


@pytest.mark.parametrize("instant", ["9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z"])
async def test_compose_extreme_from_is_not_500(api, instant):
    reply = await api.compose(api.raw(), f"?from={instant}")
    assert reply.status in (200, 422), reply.body


async def test_compose_warns_about_dst_either_match_and_short_intervals(api):
    dst = await api.compose(api.raw(timing={"kind": "cron", "expression": "30 2 * * *",
                                            "timezone": "Europe/Berlin"}))
    assert any("2027-03-28" in w and "02:30" in w and "does not exist" in w for w in dst.body["warnings"])
    assert any("2027-10-31" in w for w in dst.body["warnings"])
    either = await api.compose(api.raw(timing={"kind": "cron", "expression": "0 9 1 * 1", "timezone": "UTC"}))
    assert any("EITHER" in w for w in either.body["warnings"])
    short = await api.compose(api.raw(timing={"kind": "interval", "seconds": 60, "timezone": "UTC"}))
    assert len(short.body["warnings"]) == 1
    assert "60 s" in short.body["warnings"][0]


@pytest.mark.parametrize("overrides, field", [
    ({"name": ""}, "name"),
    ({"name": "   "}, "name"),
    ({"name": "x" * 101}, "name"),
    ({"name": 5}, "name"),
    ({"brief": ""}, "brief"),
    ({"brief": "x" * 32769}, "brief"),
    ({"repository": "relative/path"}, "repository"),
    ({"repository": "/no/such/repository"}, "repository"),
    ({"workdir": "../up"}, "workdir"),
    ({"workdir": "/abs"}, "workdir"),
    ({"source_ref": "-x"}, "source_ref"),
    ({"source_ref": "no-such-branch"}, "source_ref"),
    ({"source_ref": "main --upload-pack=x"}, "source_ref"),
    ({"agent": "nope"}, "agent"),
    ({"timing": None}, "timing"),
    ({"timing": {"kind": "cron", "expression": "* * * * * *", "timezone": "UTC"}}, "timing.expression"),
    ({"timing": {"kind": "cron", "expression": "@reboot", "timezone": "UTC"}}, "timing.expression"),
    ({"timing": {"kind": "cron", "expression": "61 * * * *", "timezone": "UTC"}}, "timing.expression"),
    ({"timing": {"kind": "cron", "expression": "0 0 31 2 *", "timezone": "UTC"}}, "timing.expression"),
    ({"timing": {"kind": "cron", "expression": "*/5 * * * *"}}, "timing.timezone"),
    ({"timing": {"kind": "cron", "expression": "*/5 * * * *", "timezone": "Mars/Olympus"}}, "timing.timezone"),
    ({"timing": {"kind": "weekly", "timezone": "UTC"}}, "timing.kind"),
    ({"timing": {"kind": "cron", "expression": "* * * * *", "timezone": "UTC", "seconds": 5}}, "timing.seconds"),
    ({"timing": {"kind": "interval", "seconds": 9, "timezone": "UTC"}}, "timing.seconds"),
    ({"timing": {"kind": "interval", "seconds": 31622401, "timezone": "UTC"}}, "timing.seconds"),
    ({"timing": {"kind": "interval", "seconds": 60.5, "timezone": "UTC"}}, "timing.seconds"),
    ({"timing": {"kind": "once", "at": "2026-11-30T07:59:00Z", "timezone": "UTC"}}, "timing.at"),
    ({"timing": {"kind": "once", "at": "tomorrow", "timezone": "UTC"}}, "timing.at"),
    ({"limits": {"timeout_seconds": 0}}, "limits.timeout_seconds"),
    ({"limits": {"timeout_seconds": 86401}}, "limits.timeout_seconds"),
    ({"limits": {"timeout_seconds": True}}, "limits.timeout_seconds"),
    ({"limits": {"model": 3}}, "limits.model"),
    ({"limits": {"memory": 3}}, "limits.memory"),
    ({"notify": "never"}, "notify"),
    ({"concurrency_policy": "queue"}, "concurrency_policy"),
    ({"catch_up": {"policy": "all"}}, "catch_up.policy"),
    ({"catch_up": {"policy": "enqueue_missed_with_cap", "max": 26}}, "catch_up.max"),
    ({"catch_up": {"policy": "enqueue_missed_with_cap", "max": 0}}, "catch_up.max"),
    ({"colour": "blue"}, "colour"),
])
async def test_compose_refuses_invalid_definitions_naming_the_field(api, overrides, field):
    assert_problem(await api.compose(api.raw(**overrides)), 422, "validation_failed", field)


async def test_compose_missing_required_fields_name_them(api):
    for missing in ("name", "brief", "repository", "timing"):
        raw = api.raw()
        del raw[missing]
        assert_problem(await api.compose(raw), 422, "validation_failed", missing)


async def test_compose_once_without_offset_is_wall_time_in_its_timezone(api):
    reply = await api.compose(api.raw(timing={"kind": "once", "at": "2026-12-01T09:00:00",
                                              "timezone": "Europe/Berlin"}))
    assert reply.status == 200, reply.body
    assert reply.body["next_fires"] == ["2026-12-01T08:00:00Z"]


async def test_compose_repository_that_is_not_git_is_422(api, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert_problem(await api.compose(api.raw(repository=str(plain))), 422, "validation_failed", "repository")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_problem(await api.compose(api.raw(repository=str(a_file))), 422, "validation_failed", "repository")


async def test_compose_source_ref_that_does_not_resolve_is_422(api):
    git(api.repo, "tag", "v1")
    assert (await api.compose(api.raw(source_ref="v1"))).status == 200
    head = git(api.repo, "rev-parse", "HEAD")
    assert (await api.compose(api.raw(source_ref=head))).status == 200
    for ref in ("v2", "0" * 40, "HEAD~5"):
        assert_problem(await api.compose(api.raw(source_ref=ref)), 422, "validation_failed", "source_ref")


async def test_compose_needs_no_idempotency_key_and_changes_nothing(api):
    for _ in range(2):
        reply = await api.post("/v1/outpost/schedules/compose", api.raw(), key=None)
        assert reply.status == 200
    assert (await api.get("/v1/outpost/schedules")).body == {"schedules": []}
    assert (await api.get("/v1/outpost/events")).body == {"events": [], "next_cursor": 0}


async def test_compose_for_an_edit_merges_changes_into_the_schedule(api):
    sched = await api.schedule()
    reply = await api.compose({"schedule_id": sched["id"], "brief": "@print changed"})
    assert reply.status == 200, reply.body
    expected = {k: sched[k] for k in outpost.DEFINITION_FIELDS if k in sched} | {"brief": "@print changed"}
    assert reply.body["definition"] == expected
    assert reply.body["confirmation"] == outpost.confirmation_of(expected)
    assert (await api.get(f"/v1/outpost/schedules/{sched['id']}")).body["brief"] == "@print hello"


async def test_compose_for_an_edit_of_an_unknown_schedule_is_404(api):
    assert_problem(await api.compose({"schedule_id": "sch_nope", "brief": "x"}), 404, "not_found")


async def test_compose_edit_of_a_once_schedule_whose_instant_passed_keeps_its_timing(api):
    at = z(T0 + timedelta(hours=1))
    sched = await api.schedule(timing={"kind": "once", "at": at, "timezone": "UTC"})
    api.clock.at = T0 + timedelta(hours=2)
    reply = await api.compose({"schedule_id": sched["id"], "brief": "@print later"})
    assert reply.status == 200, reply.body
    assert reply.body["next_fires"] == []
    same = await api.compose({"schedule_id": sched["id"], "timing": sched["timing"]})
    assert same.status == 200   # resending the stored timing is not a change
    past = await api.compose({"schedule_id": sched["id"],
                              "timing": {"kind": "once", "at": z(T0 + timedelta(minutes=90)), "timezone": "UTC"}})
    assert_problem(past, 422, "validation_failed", "timing.at")


# --- inputs that must not crash compose (docs/http-api.md: never a 500 for bad input) ----------------

@pytest.mark.parametrize("tz", ["Europe", "America", "a" * 300])
async def test_timezone_that_is_a_directory_or_too_long_is_422(api, tz):
    reply = await api.compose(api.raw(timing={"kind": "cron", "expression": "*/5 * * * *", "timezone": tz}))
    assert_problem(reply, 422, "validation_failed", "timing.timezone")


@pytest.mark.parametrize("overrides, field", [
    ({"timing": {"kind": [], "timezone": "UTC"}}, "timing.kind"),
    ({"timing": {"kind": {"a": 1}, "timezone": "UTC"}}, "timing.kind"),
    ({"agent": ["demo"]}, "agent"),
    ({"agent": {}}, "agent"),
])
async def test_unhashable_kind_or_agent_is_422(api, overrides, field):
    assert_problem(await api.compose(api.raw(**overrides)), 422, "validation_failed", field)


async def test_dispatch_with_unhashable_agent_is_422(api):
    reply = await api.post("/v1/outpost/dispatches", {"brief": "x", "repository": str(api.repo), "agent": ["demo"]})
    assert_problem(reply, 422, "validation_failed", "agent")


@pytest.mark.parametrize("field", ["name", "brief"])
async def test_lone_surrogate_in_text_is_422_not_500(api, field):
    body = json.dumps(api.raw(**{field: "x\ud800"})).encode()   # ensure_ascii: sent as the escape \ud800
    reply = await api.post("/v1/outpost/schedules/compose", raw=body)
    assert reply.status == 422, reply.body


async def test_once_at_the_end_of_time_is_not_500(api):
    reply = await api.compose(api.raw(timing={"kind": "once", "at": "9999-12-31T23:59:59",
                                              "timezone": "America/New_York"}))
    assert reply.status in (200, 422), reply.body


@pytest.mark.parametrize("overrides, field", [({"limits": 0}, "limits"), ({"limits": []}, "limits"),
                                              ({"catch_up": False}, "catch_up"), ({"catch_up": ""}, "catch_up")])
async def test_falsy_non_object_limits_or_catch_up_is_422(api, overrides, field):
    reply = await api.compose(api.raw(**overrides))
    assert_problem(reply, 422, "validation_failed")
    assert reply.body["errors"][0]["field"].startswith(field)


async def test_cron_with_random_field_is_refused(api):
    reply = await api.compose(api.raw(timing={"kind": "cron", "expression": "R R * * *", "timezone": "UTC"}))
    assert_problem(reply, 422, "validation_failed", "timing.expression")


@pytest.mark.parametrize(("expression", "instead"), [("0 23-3/2 * * *", "1,3,23"), ("0 0 20-5/5 * *", "4,20,25,30"),
                                                    ("* * * 9-8/3 *", "3,6,9,12"), ("0 9 * * sat-tue/2", "1,6")])
async def test_compose_refuses_a_reversed_cron_range_instead_of_showing_fires_it_does_not_mean(api, expression,
                                                                                            instead):
    """Defect 11: compose accepted a wrapping range without a warning and its review listed fires
    at 02:00 and 23:00 for ``23-3/2`` (meant: 23, 1, 3), on the 5th for ``20-5/5`` (meant: the 4th)."""
    reply = await api.compose(api.raw(timing={"kind": "cron", "expression": expression, "timezone": "UTC"}))
    assert_problem(reply, 422, "validation_failed", "timing.expression")
    message = reply.body["errors"][0]["message"]
    assert "is reversed" in message and f"write {instead} instead" in message
    assert "next_fires" not in reply.body


###############################################################################
# 4.2-4.3 Create and read.
###############################################################################

SCHEDULE_FIELDS = {"id", "revision", "enabled", "archived", "auto_paused", "failure_streak", "next_fire_at",
                   "last_fired_at", "active_run_id", "authority", "created_at", "updated_at", "pending_catch_up",
                   # skip_if_unchanged and mute are there only when set
                   *(f for f in outpost.DEFINITION_FIELDS if f not in ("skip_if_unchanged", "mute"))}


async def test_create_returns_201_with_etag_and_every_schedule_field(api):
    composed = await api.compose(api.raw())
    reply = await api.post("/v1/outpost/schedules", {"definition": composed.body["definition"],
                                                     "confirmation": composed.body["confirmation"]})
    assert reply.status == 201, reply.body
    assert reply.headers["ETag"] == '"1"'
    s = reply.body
    assert set(s) >= SCHEDULE_FIELDS
    assert re.fullmatch(r"sch_[0-9A-HJKMNP-TV-Z]{26}", s["id"])
    assert (s["revision"], s["enabled"], s["archived"], s["auto_paused"], s["failure_streak"]) == (1, True, False,
                                                                                                  False, 0)
    assert s["next_fire_at"] == z(T0 + timedelta(minutes=5))
    assert s["last_fired_at"] is None and s["active_run_id"] is None
    assert s["authority"] == {"confirmation": composed.body["confirmation"], "confirmed_at": z(T0),
                              "profile_digest": outpost.profile_digest(outpost.demo_profile())}
    assert s["created_at"] == s["updated_at"] == z(T0)
    assert {k: s[k] for k in outpost.DEFINITION_FIELDS if k in s} == composed.body["definition"]
    got = await api.get(f"/v1/outpost/schedules/{s['id']}")
    assert got.status == 200 and got.body == s
    assert got.headers["ETag"] == '"1"'
    assert (await api.get("/v1/outpost/schedules")).body == {"schedules": [s]}


async def test_create_accepts_a_raw_definition_that_normalizes_to_the_confirmation(api):
    raw = api.raw()
    composed = await api.compose(raw)
    reply = await api.post("/v1/outpost/schedules", {"definition": raw, "confirmation": composed.body["confirmation"]})
    assert reply.status == 201, reply.body


async def test_create_without_idempotency_key_is_428(api):
    composed = await api.compose(api.raw())
    reply = await api.post("/v1/outpost/schedules", {"definition": composed.body["definition"],
                                                     "confirmation": composed.body["confirmation"]}, key=None)
    assert_problem(reply, 428, "idempotency_key_required")
    assert (await api.get("/v1/outpost/schedules")).body == {"schedules": []}


@pytest.mark.parametrize("key", ["x" * 256, "tab\there", "caf\u00e9"])
async def test_create_with_an_invalid_idempotency_key_is_422(api, key):
    assert_problem(await api.create(key=key), 422, "validation_failed", "Idempotency-Key")
    assert (await api.get("/v1/outpost/schedules")).body == {"schedules": []}


async def test_create_with_an_empty_idempotency_key_is_refused(api):
    reply = await api.create(key="")
    assert reply.status in (422, 428) and reply.mimetype == PROBLEM, reply.body
    assert (await api.get("/v1/outpost/schedules")).body == {"schedules": []}


async def test_a_key_of_255_printable_characters_is_accepted(api):
    assert (await api.create(key="~" * 255)).status == 201


async def test_create_with_wrong_or_missing_confirmation_is_422_confirmation_mismatch(api):
    composed = await api.compose(api.raw())
    d = composed.body["definition"]
    for confirmation in ("sha256:" + "0" * 64, None, 42, outpost.confirmation_of({**d, "brief": "other"})):
        body = {"definition": d} if confirmation is None else {"definition": d, "confirmation": confirmation}
        assert_problem(await api.post("/v1/outpost/schedules", body), 422, "confirmation_mismatch")
    assert (await api.get("/v1/outpost/schedules")).body == {"schedules": []}


async def test_create_validates_the_definition(api):
    reply = await api.post("/v1/outpost/schedules", {"definition": api.raw(agent="nope"), "confirmation": "x"})
    assert_problem(reply, 422, "validation_failed", "agent")
    assert_problem(await api.post("/v1/outpost/schedules", {"confirmation": "x"}), 422, "validation_failed",
                   "definition")


async def test_create_duplicate_name_is_409_until_the_first_is_archived(api):
    first = await api.schedule()
    assert_problem(await api.create(), 409, "conflict")
    assert (await api.control(first["id"], "archive", 1)).status == 200
    assert (await api.create()).status == 201


async def test_get_unknown_schedule_is_404(api):
    assert_problem(await api.get("/v1/outpost/schedules/sch_nope"), 404, "not_found")


async def test_list_hides_archived_unless_asked(api):
    kept = await api.schedule(name="kept")
    gone = await api.schedule(name="gone")
    await api.control(gone["id"], "archive", 1)
    listed = (await api.get("/v1/outpost/schedules")).body["schedules"]
    assert [s["id"] for s in listed] == [kept["id"]]
    everything = (await api.get("/v1/outpost/schedules?include_archived=true")).body["schedules"]
    assert {s["id"] for s in everything} == {kept["id"], gone["id"]}


###############################################################################
# 3. Idempotency.
###############################################################################

async def test_same_key_same_body_replays_the_response_and_creates_one_schedule(api):
    composed = await api.compose(api.raw())
    body = {"definition": composed.body["definition"], "confirmation": composed.body["confirmation"]}
    first = await api.post("/v1/outpost/schedules", body, key="k-1")
    cursor = (await api.get("/v1/outpost/events")).body["next_cursor"]
    again = await api.post("/v1/outpost/schedules", body, key="k-1")
    assert first.status == again.status == 201
    assert again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["ETag"] == first.headers["ETag"] == '"1"'
    assert len((await api.get("/v1/outpost/schedules")).body["schedules"]) == 1
    assert (await api.get("/v1/outpost/events")).body["next_cursor"] == cursor


async def test_same_key_different_body_path_or_method_is_422_idempotency_key_reused(api):
    composed = await api.compose(api.raw())
    body = {"definition": composed.body["definition"], "confirmation": composed.body["confirmation"]}
    created = await api.post("/v1/outpost/schedules", body, key="k-2")
    other = await api.compose(api.raw(name="other"))
    reused = await api.post("/v1/outpost/schedules", {"definition": other.body["definition"],
                                                      "confirmation": other.body["confirmation"]}, key="k-2")
    assert_problem(reused, 422, "idempotency_key_reused")
    elsewhere = await api.post(f"/v1/outpost/schedules/{created.body['id']}/control", {"action": "pause"},
                               key="k-2", if_match=1)
    assert_problem(elsewhere, 422, "idempotency_key_reused")
    assert len((await api.get("/v1/outpost/schedules")).body["schedules"]) == 1
    assert (await api.revision(created.body["id"])) == 1


async def test_a_stored_error_is_replayed_with_the_same_key(api):
    await api.schedule()
    composed = await api.compose(api.raw())
    body = {"definition": composed.body["definition"], "confirmation": composed.body["confirmation"]}
    first = await api.post("/v1/outpost/schedules", body, key="k-dup")
    assert_problem(first, 409, "conflict")
    again = await api.post("/v1/outpost/schedules", body, key="k-dup")
    assert_problem(again, 409, "conflict")
    assert again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    bad = {"definition": composed.body["definition"], "confirmation": "sha256:nope"}
    first = await api.post("/v1/outpost/schedules", bad, key="k-bad")
    again = await api.post("/v1/outpost/schedules", bad, key="k-bad")
    assert_problem(again, 422, "confirmation_mismatch")
    assert again.body == first.body and again.headers["Idempotent-Replayed"] == "true"


async def test_a_stale_revision_leaves_the_key_usable_for_the_corrected_retry(api):
    # outpost.py deliberately does not store 412/428 (nothing happened; the fix is a header).
    sched = await api.schedule()
    stale = await api.control(sched["id"], "pause", 7, key="k-412")
    assert_problem(stale, 412, "revision_mismatch")
    assert "Idempotent-Replayed" not in stale.headers
    fixed = await api.control(sched["id"], "pause", 1, key="k-412")
    assert fixed.status == 200 and fixed.body["enabled"] is False
    replay = await api.control(sched["id"], "pause", 1, key="k-412")
    assert replay.status == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert await api.revision(sched["id"]) == 2


async def test_a_repeat_while_the_first_is_in_flight_is_409(api, monkeypatch):
    """Two real concurrent requests with one key: the first is held inside its handler (its
    git check waits), the repeat arrives meanwhile and gets 409; the first then completes once,
    and a later repeat replays it."""
    entered, release = trio.Event(), trio.Event()
    real_check = outpost.check_repository

    async def held_check(definition, deps):
        entered.set()
        await release.wait()
        return await real_check(definition, deps)
    monkeypatch.setattr(outpost, "check_repository", held_check)
    body = {"brief": "@print once", "repository": str(api.repo), "agent": "demo"}
    replies = {}

    async def first():
        replies["first"] = await api.post("/v1/outpost/dispatches", body, key="k-busy")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await entered.wait()
        replies["repeat"] = await api.post("/v1/outpost/dispatches", body, key="k-busy")
        release.set()
    assert_problem(replies["repeat"], 409, "conflict")
    assert replies["first"].status == 202, replies["first"].body
    later = await api.post("/v1/outpost/dispatches", body, key="k-busy")
    assert (later.status, later.body, later.headers["Idempotent-Replayed"]) == (202, replies["first"].body, "true")
    assert len((await api.get("/v1/outpost/runs")).body["runs"]) == 1


async def test_idempotency_keys_survive_a_restart(tmp_path, git_repo):
    deps = make_deps(tmp_path)
    api = Api(deps, git_repo)
    composed = await api.compose(api.raw())
    body = {"definition": composed.body["definition"], "confirmation": composed.body["confirmation"]}
    first = await api.post("/v1/outpost/schedules", body, key="k-restart")
    deps.store.close()
    deps = make_deps(tmp_path)
    api = Api(deps, git_repo)
    again = await api.post("/v1/outpost/schedules", body, key="k-restart")
    assert again.status == 201 and again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len((await api.get("/v1/outpost/schedules")).body["schedules"]) == 1
    deps.store.close()


async def test_a_key_expires_after_24_hours(api):
    sched = await api.schedule()
    assert (await api.control(sched["id"], "pause", 1, key="k-old")).status == 200
    api.clock.at = T0 + timedelta(hours=25)
    reply = await api.control(sched["id"], "pause", 1, key="k-old")
    assert_problem(reply, 412, "revision_mismatch")   # executed again, not replayed


###############################################################################
# 4.2 PATCH.
###############################################################################

async def test_patch_without_if_match_or_with_star_is_428(api):
    sched = await api.schedule()
    path = f"/v1/outpost/schedules/{sched['id']}"
    composed = await api.compose({"schedule_id": sched["id"], "brief": "x"})
    body = {"changes": {"brief": "x"}, "confirmation": composed.body["confirmation"]}
    assert_problem(await api.patch(path, body), 428, "precondition_required")
    assert_problem(await api.patch(path, body, if_match="*"), 428, "precondition_required")
    assert_problem(await api.patch(path, body, if_match='"one"'), 428, "precondition_required")
    assert await api.revision(sched["id"]) == 1


async def test_patch_without_idempotency_key_is_428(api):
    sched = await api.schedule()
    reply = await api.edit(sched["id"], {"brief": "x"}, '"1"', key=None)
    assert_problem(reply, 428, "idempotency_key_required")


async def test_compose_warns_when_a_once_fire_falls_in_a_dst_gap(api):
    raw = api.raw(timing={"kind": "once", "at": "2027-03-28T02:30", "timezone": "Europe/Berlin"})
    composed = await api.compose(raw)
    assert composed.status == 200, composed.body
    assert composed.body["next_fires"] == ["2027-03-28T01:00:00Z"]   # 03:00 CEST
    (warning,) = composed.body["warnings"]
    assert "2027-03-28 02:30 does not exist in Europe/Berlin" in warning and "03:00" in warning


async def test_patch_with_stale_revision_is_412_with_the_current_revision(api):
    """Defect 10: client B composes at revision 1, A renames the schedule (revision 2), then B's
    PATCH with If-Match 1 is 412 with the current revision, not 422 confirmation_mismatch, and
    B's key is not spent on it: the same key works once B has composed again."""
    sched = await api.schedule()
    path = f"/v1/outpost/schedules/{sched['id']}"
    composed_by_b = await api.compose({"schedule_id": sched["id"], "brief": "@print from b"})
    assert (await api.edit(sched["id"], {"name": "renamed-by-a"}, 1)).status == 200
    stale = await api.patch(path, {"changes": {"brief": "@print from b"},
                                   "confirmation": composed_by_b.body["confirmation"]}, if_match=1, key="b-key")
    assert_problem(stale, 412, "revision_mismatch")
    assert stale.body["current_revision"] == 2
    assert (await api.get(path)).body["brief"] == "@print hello"
    recomposed = await api.compose({"schedule_id": sched["id"], "brief": "@print from b"})
    retried = await api.patch(path, {"changes": {"brief": "@print from b"},
                                     "confirmation": recomposed.body["confirmation"]}, if_match=2, key="b-key")
    assert retried.status == 200, retried.body
    assert retried.body["name"] == "renamed-by-a" and retried.body["brief"] == "@print from b"


async def test_patch_bumps_revision_and_etag(api):
    sched = await api.schedule()
    reply = await api.edit(sched["id"], {"brief": "@print changed"}, '"1"')
    assert reply.status == 200, reply.body
    assert reply.body["revision"] == 2 and reply.headers["ETag"] == '"2"'
    assert reply.body["brief"] == "@print changed"
    assert reply.body["authority"]["confirmation"] == outpost.confirmation_of(
        {k: reply.body[k] for k in outpost.DEFINITION_FIELDS if k in reply.body})
    got = await api.get(f"/v1/outpost/schedules/{sched['id']}")
    assert got.body == reply.body and got.headers["ETag"] == '"2"'
    again = await api.edit(sched["id"], {"brief": "@print third"}, "2")   # quotes are optional
    assert again.status == 200 and again.body["revision"] == 3


async def test_patch_confirmation_must_match_the_merged_definition(api):
    sched = await api.schedule()
    path = f"/v1/outpost/schedules/{sched['id']}"
    old = sched["authority"]["confirmation"]
    assert_problem(await api.patch(path, {"changes": {"brief": "x"}, "confirmation": old}, if_match=1),
                   422, "confirmation_mismatch")
    assert_problem(await api.patch(path, {"changes": {"brief": "x"}}, if_match=1), 422, "confirmation_mismatch")
    assert await api.revision(sched["id"]) == 1


async def test_patch_validates_changes(api):
    sched = await api.schedule()
    path = f"/v1/outpost/schedules/{sched['id']}"
    assert_problem(await api.patch(path, {"changes": {"agent": "nope"}, "confirmation": "x"}, if_match=1),
                   422, "validation_failed", "agent")
    assert_problem(await api.patch(path, {"changes": [], "confirmation": "x"}, if_match=1),
                   422, "validation_failed", "changes")
    assert_problem(await api.patch(path, {"changes": {"id": "sch_x"}, "confirmation": "x"}, if_match=1),
                   422, "validation_failed", "id")


async def test_patch_changing_timing_recomputes_next_fire_at(api):
    sched = await api.schedule()
    assert sched["next_fire_at"] == "2026-11-30T08:05:00Z"
    api.clock.at = T0 + timedelta(minutes=1)
    reply = await api.edit(sched["id"], {"timing": {"kind": "cron", "expression": "0 9 * * *",
                                                    "timezone": "Europe/Berlin"}}, 1)
    assert reply.status == 200, reply.body
    assert reply.body["next_fire_at"] == "2026-12-01T08:00:00Z"
    assert reply.body["updated_at"] == z(T0 + timedelta(minutes=1))
    assert reply.body["authority"]["confirmed_at"] == z(T0 + timedelta(minutes=1))
    interval = await api.edit(sched["id"], {"timing": {"kind": "interval", "seconds": 600, "timezone": "UTC"}}, 2)
    assert interval.body["next_fire_at"] == z(T0 + timedelta(minutes=11))


async def test_patch_to_the_name_of_another_live_schedule_is_409(api):
    await api.schedule(name="a")
    b = await api.schedule(name="b")
    assert_problem(await api.edit(b["id"], {"name": "a"}, 1), 409, "conflict")


async def test_patch_unknown_schedule_is_404(api):
    reply = await api.patch("/v1/outpost/schedules/sch_nope", {"changes": {}, "confirmation": "x"}, if_match=1)
    assert_problem(reply, 404, "not_found")


###############################################################################
# 4.4 Control.
###############################################################################

async def test_pause_enable_resume_archive_each_bump_the_revision(api):
    sched = await api.schedule()
    sid = sched["id"]
    expected = [("pause", {"enabled": False}), ("enable", {"enabled": True}),
                ("resume", {"enabled": True, "auto_paused": False, "failure_streak": 0}),
                ("archive", {"archived": True})]
    for revision, (action, fields) in enumerate(expected, start=1):
        reply = await api.control(sid, action, f'"{revision}"')
        assert reply.status == 200, (action, reply.body)
        assert reply.body["revision"] == revision + 1
        assert reply.headers["ETag"] == f'"{revision + 1}"'
        assert {k: reply.body[k] for k in fields} == fields
    final = (await api.get(f"/v1/outpost/schedules/{sid}")).body
    assert final["archived"] is True and final["revision"] == 5
    assert final["next_fire_at"] is None


async def test_control_needs_if_match_and_idempotency_key(api):
    sched = await api.schedule()
    path = f"/v1/outpost/schedules/{sched['id']}/control"
    assert_problem(await api.post(path, {"action": "pause"}), 428, "precondition_required")
    assert_problem(await api.post(path, {"action": "pause"}, if_match="*"), 428, "precondition_required")
    assert_problem(await api.post(path, {"action": "pause"}, if_match=1, key=None), 428, "idempotency_key_required")
    assert_problem(await api.post(path, {"action": "pause"}, if_match=2), 412, "revision_mismatch")
    assert_problem(await api.post(path, {"action": "fire"}, if_match=2), 412, "revision_mismatch")
    assert await api.revision(sched["id"]) == 1


@pytest.mark.parametrize("body", [{"action": "explode"}, {"action": None}, {}, {"action": ["pause"]}])
async def test_invalid_control_action_is_422(api, body):
    sched = await api.schedule()
    reply = await api.post(f"/v1/outpost/schedules/{sched['id']}/control", body, if_match=1)
    assert_problem(reply, 422, "validation_failed", "action")


async def test_control_unknown_schedule_is_404(api):
    for action in ("pause", "fire"):
        assert_problem(await api.control("sch_nope", action, 1), 404, "not_found")


async def test_enable_on_an_auto_paused_schedule_is_409_until_resumed(api):
    sched = await api.auto_paused()
    assert (sched["enabled"], sched["auto_paused"], sched["failure_streak"]) == (False, True, 3)
    assert sched["revision"] == 2
    assert_problem(await api.control(sched["id"], "enable", 2), 409, "auto_paused")
    assert await api.revision(sched["id"]) == 2
    resumed = await api.control(sched["id"], "resume", 2)
    assert resumed.status == 200
    assert (resumed.body["enabled"], resumed.body["auto_paused"], resumed.body["failure_streak"]) == (True, False, 0)
    assert resumed.body["revision"] == 3


async def test_after_archive_patch_and_every_control_are_409_archived(api):
    sched = await api.schedule()
    sid = sched["id"]
    assert (await api.control(sid, "archive", 1)).status == 200
    for action in ("enable", "pause", "resume", "fire", "archive"):
        assert_problem(await api.control(sid, action, 2), 409, "archived")
    patch = await api.patch(f"/v1/outpost/schedules/{sid}", {"changes": {"brief": "x"}, "confirmation": "x"},
                            if_match=2)
    assert_problem(patch, 409, "archived")
    assert await api.revision(sid) == 2


async def test_fire_admits_a_manual_run_and_does_not_bump_the_revision(api):
    sched = await api.schedule()
    reply = await api.control(sched["id"], "fire", 1)
    assert reply.status == 200, reply.body
    assert set(reply.body) == {"occurrence_id", "outcome", "run_id"}
    assert reply.body["outcome"] == "admitted"
    assert reply.body["occurrence_id"].startswith("occ_") and reply.body["run_id"].startswith("out_")
    got = await api.get(f"/v1/outpost/schedules/{sched['id']}")
    assert got.body["revision"] == 1 and got.headers["ETag"] == '"1"'
    assert got.body["active_run_id"] == reply.body["run_id"]
    assert got.body["last_fired_at"] == z(T0)


async def test_second_fire_while_the_first_run_is_queued_is_skipped_overlap(api):
    sched = await api.schedule()
    first = await api.fire(sched["id"])
    api.clock.at += timedelta(seconds=1)
    second = await api.fire(sched["id"])
    assert second["outcome"] == "skipped_overlap"
    assert second["occurrence_id"].startswith("occ_") and second["occurrence_id"] != first["occurrence_id"]
    assert second["run_id"] == first["run_id"]   # the active run it did not queue behind
    runs = (await api.get(f"/v1/outpost/runs?schedule_id={sched['id']}")).body["runs"]
    assert [r["id"] for r in runs] == [first["run_id"]]
    skips = (await api.get(f"/v1/outpost/schedules/{sched['id']}/inspect")).body["checks"][1]["data"]["recent_skips"]
    assert [o["outcome"] for o in skips] == ["skipped_overlap"]


async def test_fire_replayed_with_the_same_key_fires_once(api):
    sched = await api.schedule()
    first = await api.control(sched["id"], "fire", 1, key="k-fire")
    again = await api.control(sched["id"], "fire", 1, key="k-fire")
    assert again.body == first.body and again.headers["Idempotent-Replayed"] == "true"
    assert len((await api.get("/v1/outpost/runs")).body["runs"]) == 1


async def test_second_fire_at_the_same_instant_records_its_skip(api):
    sched = await api.schedule()
    await api.fire(sched["id"])
    second = await api.fire(sched["id"])
    assert second["outcome"] == "skipped_overlap"
    assert second["occurrence_id"] is not None
    occurrences = (await api.get(f"/v1/outpost/schedules/{sched['id']}/occurrences")).body["occurrences"]
    assert len(occurrences) == 2


async def test_fire_again_at_the_same_instant_after_the_run_settled_is_admitted(api):
    sched = await api.schedule()
    first = await api.fire(sched["id"])
    await api.post(f"/v1/outpost/runs/{first['run_id']}/control", {"action": "cancel"})
    reply = await api.control(sched["id"], "fire", 1)
    assert reply.status == 200, reply.body
    assert reply.body["outcome"] == "admitted" and reply.body["run_id"].startswith("out_")


###############################################################################
# 5.4 Runs and dispatches.
###############################################################################

RUN_FIELDS = {"id", "schedule_id", "occurrence_id", "agent", "trigger", "due_at", "missed_count", "status", "owner",
              "resolved_commit", "result_branch", "changes", "exit_code", "error", "queued_at", "started_at",
              "finished_at", "result"}


async def test_run_detail_has_every_field(api):
    sched = await api.schedule(name="Nightly Deps!")
    fired = await api.fire(sched["id"])
    reply = await api.get(f"/v1/outpost/runs/{fired['run_id']}")
    assert reply.status == 200
    run = reply.body
    assert set(run) >= RUN_FIELDS
    assert re.fullmatch(r"out_[0-9A-HJKMNP-TV-Z]{26}", run["id"])
    assert run["id"] == fired["run_id"]
    assert (run["schedule_id"], run["occurrence_id"], run["agent"]) == (sched["id"], fired["occurrence_id"], "demo")
    assert (run["trigger"], run["status"], run["missed_count"], run["owner"]) == ("manual", "queued", 0, None)
    assert run["result_branch"] == f"outpost/nightly-deps/{run['id']}"
    assert run["resolved_commit"] == git(api.repo, "rev-parse", "HEAD")
    assert run["changes"] == {"commits": 0}
    assert (run["exit_code"], run["error"], run["started_at"], run["finished_at"], run["result"]) == (None,) * 5
    assert run["due_at"] == run["queued_at"] == z(T0)


async def test_unknown_run_is_404(api):
    for path in ("/v1/outpost/runs/out_nope", "/v1/outpost/runs/out_nope/log"):
        assert_problem(await api.get(path), 404, "not_found")
    for path, body in (("/v1/outpost/runs/out_nope/adopt", {"workspace": "w"}),
                       ("/v1/outpost/runs/out_nope/control", {"action": "cancel"}),
                       ("/v1/outpost/runs/out_nope/control", {"action": "pause"})):
        assert_problem(await api.post(path, body), 404, "not_found")


async def test_run_log_is_text_plain(api):
    sched = await api.schedule()
    fired = await api.fire(sched["id"])
    reply = await api.get(f"/v1/outpost/runs/{fired['run_id']}/log")
    assert reply.status == 200
    assert reply.mimetype == "text/plain"
    assert reply.body == ""
    api.deps.log_path("x").parent.mkdir(parents=True, exist_ok=True)
    api.deps.log_path(fired["run_id"]).write_text("hello\nworld\n")
    assert (await api.get(f"/v1/outpost/runs/{fired['run_id']}/log")).body == "hello\nworld\n"


async def dispatch_runs(api: Api, n: int) -> list[str]:
    ids = []
    for i in range(n):
        reply = await api.post("/v1/outpost/dispatches", {"brief": f"@print {i}", "repository": str(api.repo)})
        assert reply.status == 202, reply.body
        ids.append(reply.body["run_id"])
    return ids


async def test_runs_list_newest_first_with_paging(api):
    ids = await dispatch_runs(api, 5)
    newest_first = ids[::-1]
    page = (await api.get("/v1/outpost/runs?limit=2")).body
    assert [r["id"] for r in page["runs"]] == newest_first[:2]
    assert page["next"] == newest_first[1]
    page = (await api.get(f"/v1/outpost/runs?limit=2&before={page['next']}")).body
    assert [r["id"] for r in page["runs"]] == newest_first[2:4]
    page = (await api.get(f"/v1/outpost/runs?limit=2&before={page['next']}")).body
    assert [r["id"] for r in page["runs"]] == newest_first[4:]
    assert page["next"] is None
    full = (await api.get("/v1/outpost/runs")).body
    assert [r["id"] for r in full["runs"]] == newest_first and full["next"] is None
    exact = (await api.get("/v1/outpost/runs?limit=5")).body
    assert len(exact["runs"]) == 5 and exact["next"] is None


async def test_runs_filter_by_schedule_and_status(api):
    a = await api.schedule(name="a")
    b = await api.schedule(name="b")
    run_a = (await api.fire(a["id"]))["run_id"]
    run_b = (await api.fire(b["id"]))["run_id"]
    [dispatched] = await dispatch_runs(api, 1)
    await api.post(f"/v1/outpost/runs/{run_b}/control", {"action": "cancel"})
    by_a = (await api.get(f"/v1/outpost/runs?schedule_id={a['id']}")).body["runs"]
    assert [r["id"] for r in by_a] == [run_a]
    queued = (await api.get("/v1/outpost/runs?status=queued")).body["runs"]
    assert [r["id"] for r in queued] == [dispatched, run_a]
    cancelled = (await api.get(f"/v1/outpost/runs?status=cancelled&schedule_id={b['id']}")).body["runs"]
    assert [r["id"] for r in cancelled] == [run_b]
    assert (await api.get("/v1/outpost/runs?status=succeeded")).body == {"runs": [], "next": None}


@pytest.mark.parametrize("query, field", [("status=done", "status"), ("limit=0", "limit"), ("limit=x", "limit")])
async def test_runs_invalid_query_is_422(api, query, field):
    assert_problem(await api.get(f"/v1/outpost/runs?{query}"), 422, "validation_failed", field)


async def test_adopt_sets_owner_and_another_workspace_is_409(api):
    [run_id] = await dispatch_runs(api, 1)
    path = f"/v1/outpost/runs/{run_id}/adopt"
    assert_problem(await api.post(path, {"workspace": "ws-a"}, key=None), 428, "idempotency_key_required")
    adopted = await api.post(path, {"workspace": "ws-a"})
    assert adopted.status == 200 and adopted.body["owner"] == "ws-a"
    assert (await api.post(path, {"workspace": "ws-a"})).status == 200
    assert_problem(await api.post(path, {"workspace": "ws-b"}), 409, "conflict")
    assert (await api.get(f"/v1/outpost/runs/{run_id}")).body["owner"] == "ws-a"


@pytest.mark.parametrize("body", [{}, {"workspace": ""}, {"workspace": 3}, {"workspace": "x" * 201}])
async def test_adopt_needs_a_workspace(api, body):
    [run_id] = await dispatch_runs(api, 1)
    assert_problem(await api.post(f"/v1/outpost/runs/{run_id}/adopt", body), 422, "validation_failed", "workspace")


async def test_cancel_a_queued_run_then_every_control_is_409(api):
    sched = await api.schedule()
    fired = await api.fire(sched["id"])
    path = f"/v1/outpost/runs/{fired['run_id']}/control"
    cancelled = await api.post(path, {"action": "cancel"})
    assert cancelled.status == 200, cancelled.body
    assert cancelled.body["status"] == "cancelled"
    assert cancelled.body["finished_at"] == z(T0)
    assert (await api.get(f"/v1/outpost/runs/{fired['run_id']}")).body["status"] == "cancelled"
    for action in ("cancel", "pause", "resume"):
        assert_problem(await api.post(path, {"action": action}), 409, "conflict")
    assert (await api.get(f"/v1/outpost/schedules/{sched['id']}")).body["active_run_id"] is None
    api.clock.at += timedelta(seconds=1)
    assert (await api.fire(sched["id"]))["outcome"] == "admitted"


async def test_pause_or_resume_of_a_queued_run_is_409(api):
    [run_id] = await dispatch_runs(api, 1)
    path = f"/v1/outpost/runs/{run_id}/control"
    assert_problem(await api.post(path, {"action": "pause"}), 409, "conflict")
    assert_problem(await api.post(path, {"action": "resume"}), 409, "conflict")
    assert (await api.get(f"/v1/outpost/runs/{run_id}")).body["status"] == "queued"


@pytest.mark.parametrize("body", [{"action": "kill"}, {}, {"action": 1}])
async def test_invalid_run_control_action_is_422(api, body):
    [run_id] = await dispatch_runs(api, 1)
    reply = await api.post(f"/v1/outpost/runs/{run_id}/control", body)
    assert_problem(reply, 422, "validation_failed", "action")


async def test_dispatch_queues_a_one_shot_run(api):
    reply = await api.post("/v1/outpost/dispatches", {"brief": "@print hi", "repository": str(api.repo),
                                                      "workdir": "sub", "source_ref": "main", "agent": "demo",
                                                      "limits": {"timeout_seconds": 30}})
    assert reply.status == 202, reply.body
    assert set(reply.body) == {"run_id"} and reply.body["run_id"].startswith("out_")
    run = (await api.get(f"/v1/outpost/runs/{reply.body['run_id']}")).body
    assert (run["trigger"], run["status"], run["schedule_id"], run["agent"]) == ("dispatch", "queued", None, "demo")
    assert run["result_branch"].startswith("outpost/") and run["result_branch"].endswith("/" + run["id"])
    assert run["resolved_commit"] == git(api.repo, "rev-parse", "main")


async def test_dispatch_needs_an_idempotency_key_and_replays(api):
    body = {"brief": "@print hi", "repository": str(api.repo)}
    assert_problem(await api.post("/v1/outpost/dispatches", body, key=None), 428, "idempotency_key_required")
    first = await api.post("/v1/outpost/dispatches", body, key="k-d")
    again = await api.post("/v1/outpost/dispatches", body, key="k-d")
    assert again.status == 202 and again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len((await api.get("/v1/outpost/runs")).body["runs"]) == 1


@pytest.mark.parametrize("body, field", [
    ({"brief": "x", "repository": "relative"}, "repository"),
    ({"brief": "x", "repository": "/no/such/repository"}, "repository"),
    ({"brief": "x"}, "repository"),
    ({"repository": None}, "brief"),
    ({"brief": "x", "repository": None, "source_ref": "nope"}, "source_ref"),
    ({"brief": "x", "repository": None, "agent": "nope"}, "agent"),
    ({"brief": "x", "repository": None, "name": "n"}, "name"),
    ({"brief": "x", "repository": None, "timing": {}}, "timing"),
    ({"brief": "x", "repository": None, "colour": "blue"}, "colour"),
])
async def test_dispatch_validation_names_the_field(api, body, field):
    body = {k: (str(api.repo) if k == "repository" and v is None else v) for k, v in body.items()}
    assert_problem(await api.post("/v1/outpost/dispatches", body), 422, "validation_failed", field)
    assert (await api.get("/v1/outpost/runs")).body["runs"] == []


async def test_dispatch_to_a_directory_that_is_not_git_is_422(api, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    reply = await api.post("/v1/outpost/dispatches", {"brief": "x", "repository": str(plain)})
    assert_problem(reply, 422, "validation_failed", "repository")


###############################################################################
# 5.6 Attention.
###############################################################################

ATTENTION_FIELDS = {"id", "kind", "schedule_id", "run_id", "title", "detail", "created_at", "acknowledged_at"}


async def test_auto_pause_raises_one_item_and_failures_fold_into_one(api):
    sched = await api.auto_paused()
    items = (await api.get("/v1/outpost/attention")).body["attention"]
    assert sorted((i["kind"], i["count"]) for i in items) == [("auto_pause", 1), ("failed", 3)]
    assert all(set(i) >= ATTENTION_FIELDS for i in items)
    assert all(i["schedule_id"] == sched["id"] and i["id"].startswith("att_") for i in items)
    assert all(i["acknowledged_at"] is None and RFC3339_Z.match(i["created_at"]) for i in items)
    assert (await api.get("/v1/outpost/attention?state=open")).body["attention"] == items


async def test_ack_needs_a_key_sets_acknowledged_at_and_leaves_open(api):
    await api.auto_paused()
    items = (await api.get("/v1/outpost/attention?state=open")).body["attention"]
    target = next(i for i in items if i["kind"] == "auto_pause")
    path = f"/v1/outpost/attention/{target['id']}/ack"
    assert_problem(await api.post(path, key=None), 428, "idempotency_key_required")
    api.clock.at = T0 + timedelta(minutes=10)
    acked = await api.post(path)
    assert acked.status == 200, acked.body
    assert acked.body["id"] == target["id"]
    assert acked.body["acknowledged_at"] == z(T0 + timedelta(minutes=10))
    still_open = (await api.get("/v1/outpost/attention?state=open")).body["attention"]
    assert target["id"] not in {i["id"] for i in still_open} and len(still_open) == 1   # the three failures, folded
    everything = (await api.get("/v1/outpost/attention?state=all")).body["attention"]
    assert len(everything) == 2
    assert next(i for i in everything if i["id"] == target["id"])["acknowledged_at"] == acked.body["acknowledged_at"]
    inspect = (await api.get(f"/v1/outpost/schedules/{target['schedule_id']}/inspect")).body
    assert inspect["checks"][4]["data"]["acknowledged"] is True


async def test_ack_unknown_item_is_404(api):
    assert_problem(await api.post("/v1/outpost/attention/att_nope/ack"), 404, "not_found")


async def test_attention_invalid_state_is_422(api):
    assert_problem(await api.get("/v1/outpost/attention?state=closed"), 422, "validation_failed", "state")


async def test_notify_policies_decide_which_settlements_raise_items(api):
    quiet = await api.schedule(name="quiet", notify="failures_only")
    loud = await api.schedule(name="loud", notify="always")
    for sched in (quiet, loud):
        fired = await api.fire(sched["id"])
        await api.settle(fired["run_id"], outpost.RunStatus.SUCCEEDED, exit_code=0, commits=2)
    items = (await api.get("/v1/outpost/attention")).body["attention"]
    assert [(i["schedule_id"], i["kind"]) for i in items] == [(loud["id"], "changes_returned")]


###############################################################################
# 5.7 Events, snapshot, inspect.
###############################################################################

async def test_events_have_increasing_cursors_and_the_lifecycle_types(api):
    sched = await api.schedule()
    await api.control(sched["id"], "pause", 1)
    await api.fire(sched["id"])
    page = (await api.get("/v1/outpost/events")).body
    events = page["events"]
    cursors = [e["cursor"] for e in events]
    assert cursors == sorted(set(cursors)) and all(isinstance(c, int) for c in cursors)
    assert page["next_cursor"] == cursors[-1]
    types = [e["type"] for e in events]
    assert {"schedule.created", "schedule.controlled", "occurrence.claimed", "run.queued"} <= set(types)
    assert types.index("schedule.created") < types.index("schedule.controlled") < types.index("run.queued")
    assert all(set(e) == {"cursor", "type", "at", "data"} and RFC3339_Z.match(e["at"]) for e in events)
    created = next(e for e in events if e["type"] == "schedule.created")
    assert created["data"]["schedule_id"] == sched["id"]


async def test_events_after_returns_only_later_events(api):
    sched = await api.schedule()
    first = (await api.get("/v1/outpost/events")).body
    mark = first["next_cursor"]
    await api.control(sched["id"], "pause", 1)
    later = (await api.get(f"/v1/outpost/events?after={mark}")).body
    assert [e["type"] for e in later["events"]] == ["schedule.controlled"]
    assert all(e["cursor"] > mark for e in later["events"])
    assert later["next_cursor"] == later["events"][-1]["cursor"]
    empty = (await api.get(f"/v1/outpost/events?after={later['next_cursor']}")).body
    assert empty == {"events": [], "next_cursor": later["next_cursor"]}
    one = (await api.get("/v1/outpost/events?limit=1")).body
    assert len(one["events"]) == 1 and one["next_cursor"] == one["events"][0]["cursor"]
    assert_problem(await api.get("/v1/outpost/events?after=-1"), 422, "validation_failed", "after")


async def test_snapshot_agrees_with_the_other_endpoints(api):
    await api.auto_paused()
    other = await api.schedule(name="other")
    fired = await api.fire(other["id"])
    snap = (await api.get("/v1/outpost/snapshot")).body
    assert set(snap) == {"cursor", "schedules", "active_runs", "open_attention"}
    assert snap["cursor"] == (await api.get("/v1/outpost/events?limit=1000")).body["next_cursor"]
    assert snap["schedules"] == (await api.get("/v1/outpost/schedules")).body["schedules"]
    assert [r["id"] for r in snap["active_runs"]] == [fired["run_id"]]
    assert snap["active_runs"][0] == (await api.get(f"/v1/outpost/runs/{fired['run_id']}")).body
    assert snap["open_attention"] == (await api.get("/v1/outpost/attention?state=open")).body["attention"]
    assert (await api.get("/healthz", auth=False)).body["ok"] is True


async def test_inspect_gives_six_checks_in_order(api):
    sched = await api.schedule()
    fired = await api.fire(sched["id"])
    api.clock.at += timedelta(seconds=1)
    await api.fire(sched["id"])
    reply = await api.get(f"/v1/outpost/schedules/{sched['id']}/inspect")
    assert reply.status == 200
    checks = reply.body["checks"]
    assert [c["check"] for c in checks] == [1, 2, 3, 4, 5, 6]
    assert all(c["title"] for c in checks)
    one = checks[0]["data"]
    assert (one["revision"], one["enabled"], one["archived"]) == (1, True, False)
    assert one["timing"] == sched["timing"] and one["next_fire_at"] == sched["next_fire_at"]
    assert checks[1]["data"]["active_run_id"] == fired["run_id"]
    assert checks[1]["data"]["active_occurrence_id"] == fired["occurrence_id"]
    assert len(checks[1]["data"]["recent_skips"]) == 1
    assert checks[2]["data"]["runs"] == [{"run_id": fired["run_id"], "status": "queued", "due_at": z(T0),
                                          "resolved_commit": git(api.repo, "rev-parse", "HEAD")}]
    assert checks[3]["data"]["run_id"] == fired["run_id"] and "queued" in checks[3]["data"]["boundary"]
    assert checks[4]["data"]["failure_streak"] == 0 and checks[4]["data"]["auto_paused"] is False
    assert checks[5]["data"]["cursor"] == (await api.get("/v1/outpost/snapshot")).body["cursor"]


async def test_inspect_unknown_schedule_is_404(api):
    assert_problem(await api.get("/v1/outpost/schedules/sch_nope/inspect"), 404, "not_found")


###############################################################################
# Fuzz: compose never answers 500 (docs/http-api.md).
###############################################################################

@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    """A git repository and a store shared by every fuzz example (compose writes nothing)."""
    base = tmp_path_factory.mktemp("fuzz")
    repo = base / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "README").write_text("x\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    store = outpost.Store(base / "db.sqlite3")
    yield base, repo, store
    store.close()


def compose_once(env, payload: Any) -> tuple[int, Any]:
    """One compose request on a fresh app (its own trio run)."""
    base, _repo, store = env

    async def one_request():
        client = outpost.create_app(make_deps(base, store=store)).test_client()
        response = await client.post("/v1/outpost/schedules/compose", data=json.dumps(payload),
                                     headers={**AUTH, "Content-Type": "application/json"})
        return response.status_code, response.mimetype

    return trio.run(one_request)


#: 80 examples per fuzz test: the three of them stay under 25 s of the default run's 5 minutes.
FUZZ = settings(max_examples=80, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


def assert_no_crash(status: int, mimetype: str) -> None:
    assert status in (200, 413, 422), status
    assert mimetype == ("application/json" if status == 200 else PROBLEM)


@FUZZ
@given(payload=json_values)
def test_compose_fuzz_random_json_is_never_500(fuzz_env, payload):
    assert_no_crash(*compose_once(fuzz_env, payload))


def definition_values(repo: str, *, well_typed: bool):
    """A valid definition with some fields replaced by drawn values and some removed, so that
    examples reach every validator. ``well_typed`` keeps each value's JSON type right."""
    def either(plausible, typed):
        if well_typed:
            return plausible | typed
        return plausible | typed | json_values | st.lists(json_values, max_size=2) | st.dictionaries(
            st.text(max_size=5), json_values, max_size=2)

    def patched(base: dict, changes: dict, removed: set) -> dict:
        return {k: v for k, v in {**base, **changes}.items() if k not in removed}

    crons = st.sampled_from(["*/5 * * * *", "0 9 * * 1-5", "@daily", "@reboot", "* * * * * *", "30 2 * * *",
                             "0 0 31 2 *", "61 * * * *", "0 9 1 * 1", "0 0 L * *", ""])
    # Lower-case random zone names: tzdata's directories (Europe, Etc, ...) are a known 500, tested above.
    zones = either(st.sampled_from(["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Mars/Base",
                                    ""]), st.text(alphabet="abcdefghijklmnopqrstuvwxyz_/+-0123456789", max_size=12))
    instants = st.sampled_from(["2027-01-01T09:00:00", "2027-03-28T02:30:00", "2027-10-31T02:30:00",
                                "2020-01-01T00:00:00Z", "2027-01-01T09:00:00+02:00", "2027-02-30T00:00:00",
                                "not a time"])
    timing_fields = {
        "kind": either(st.sampled_from(["cron", "interval", "once", "weekly"]), st.text(max_size=8)),
        "expression": either(crons, st.text(max_size=20)),
        "seconds": either(st.sampled_from([5, 10, 60, 3600, 86400, 31622400, 31622401]), st.integers()),
        "at": either(instants, st.text(max_size=25)),
        "timezone": zones,
    }
    timing_bases = st.sampled_from([
        {"kind": "cron", "expression": "*/5 * * * *", "timezone": "UTC"},
        {"kind": "interval", "seconds": 3600, "timezone": "Europe/Berlin"},
        {"kind": "once", "at": "2027-01-01T09:00:00", "timezone": "America/New_York"}])
    timing = st.builds(patched, timing_bases, st.fixed_dictionaries({}, optional=timing_fields),
                       st.sets(st.sampled_from(sorted(timing_fields)), max_size=2))
    fields = {
        "name": either(st.sampled_from(["nightly", "", "  ", "x" * 101]), st.text(max_size=110)),
        "brief": either(st.sampled_from(["@print hi", "{{date}}", ""]), st.text(max_size=50)),
        "repository": either(st.sampled_from([repo, repo + "/", repo + "/sub", "relative", "/no/such", "/"]),
                             st.text(max_size=20)),
        "workdir": either(st.sampled_from([".", "sub", "a/./b", "../up", "/abs", ""]), st.text(max_size=20)),
        "source_ref": either(st.sampled_from(["HEAD", "main", "HEAD^{tree}", "-x", "nope", "main..HEAD", ""]),
                             st.text(max_size=20)),
        "agent": either(st.sampled_from(["demo", "nope"]), st.text(max_size=10)),
        "timing": timing if well_typed else timing | json_values,
        "limits": st.fixed_dictionaries({}, optional={
            "timeout_seconds": either(st.sampled_from([0, 1, 3600, 86401]), st.integers()),
            "model": either(st.sampled_from(["m", None, ""]), st.text(max_size=10))}),
        "notify": either(st.sampled_from(["attention", "failures_only", "always", "never"]), st.text(max_size=10)),
        "concurrency_policy": either(st.sampled_from(["skip_if_active", "coalesce_if_active", "always_enqueue"]),
                                     st.text(max_size=10)),
        "catch_up": st.fixed_dictionaries({}, optional={
            "policy": either(st.sampled_from(["enqueue_missed_with_cap", "skip_missed"]), st.text(max_size=10)),
            "max": either(st.sampled_from([0, 1, 25, 26]), st.integers())}),
    }
    valid = definition(repo)
    changes = st.dictionaries(st.sampled_from(sorted(fields)), st.none(), max_size=3).flatmap(
        lambda chosen: st.fixed_dictionaries({k: fields[k] for k in chosen}))
    return st.builds(patched, st.just(valid), changes, st.sets(st.sampled_from(sorted(valid)), max_size=1))


@FUZZ
@given(data=st.data())
def test_compose_fuzz_well_typed_definitions_are_never_500(fuzz_env, data):
    repo = str(fuzz_env[1])
    payload = data.draw(definition_values(repo, well_typed=True))
    assert_no_crash(*compose_once(fuzz_env, payload))


@settings(FUZZ, derandomize=True, phases=[Phase.generate])
@given(data=st.data())
def test_compose_fuzz_any_values_for_real_fields_are_never_500(fuzz_env, data):
    repo = str(fuzz_env[1])
    payload = data.draw(definition_values(repo, well_typed=False))
    assert_no_crash(*compose_once(fuzz_env, payload))

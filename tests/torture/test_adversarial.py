"""Torture, adversarial input (issue 6): hostile bodies, headers and query strings.

Every case expects a 4xx ``application/problem+json`` naming the field where one applies, never
a 500 and never a hang (each in-process request runs under ``trio.fail_after``; the real
server's client has a timeout). Most cases use the in-process app; the real server is used
where the issue needs a real process: the symlinked workdir (an agent really runs), chunked
uploads and the event stream."""

from __future__ import annotations

import json
import os
import string
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from conftest import Reply, Server, ended, make_repo, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outpost

TOKEN = "adversarial-token"
PROBLEM = "application/problem+json"
REQUEST_TIMEOUT_S = 10
#: Sentinel for ``Adv.request``: send a fresh Idempotency-Key / leave the header out.
FRESH, MISSING = "<fresh>", "<missing>"
YEARLY = {"kind": "cron", "expression": "0 0 1 1 *", "timezone": "UTC"}
SETTLED = ("succeeded", "failed", "needs_you", "cancelled")





class Adv:
    """The in-process app on a real store and a real git repository, driven synchronously
    (one ``trio.run`` per request, so hypothesis can drive it), with seeded objects."""

    def __init__(self, base: Path):
        self.repo = make_repo(base / "repo")
        config = outpost.Config(data_dir=base, agents=(outpost.demo_profile(),))
        self.deps = outpost.Deps(config=config, store=outpost.Store(base / "outpost.sqlite3"),
                                 clock=outpost.WallClock(), token=TOKEN)
        self.store = self.deps.store
        self.client = outpost.create_app(self.deps).test_client()

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                headers: dict[str, str] | None = None, key: str = FRESH, if_match: str = MISSING,
                content_type: str | None = "application/json", auth: bool = True) -> Reply:
        sent = {"Authorization": f"Bearer {TOKEN}"} if auth else {}
        if key == FRESH:
            key = uuid.uuid4().hex if method in ("POST", "PATCH") and not path.startswith(
                "/v1/outpost/schedules/compose") else MISSING
        if key != MISSING:
            sent["Idempotency-Key"] = key
        if if_match != MISSING:
            sent["If-Match"] = if_match
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if content_type is not None and data is not None:
            sent["Content-Type"] = content_type
        sent.update(headers or {})

        async def go():
            with trio.fail_after(REQUEST_TIMEOUT_S):   # never a hang
                response = await self.client.open(path, method=method, headers=sent, data=data)
                return response, await response.get_data(as_text=True)

        response, text = trio.run(go)
        return Reply(response.status_code, text, response.mimetype, response.headers)

    def db(self, fn, *args, **kwargs):
        return self.store.transaction(fn, *args, **kwargs)[0]

    def raw(self, **overrides) -> dict:
        d = {"name": f"adv-{uuid.uuid4().hex[:8]}", "brief": "@print hi", "repository": str(self.repo),
             "agent": "demo", "timing": dict(YEARLY)}
        d.update(overrides)
        return d

    def schedule(self, **overrides) -> dict:
        composed = self.request("POST", "/v1/outpost/schedules/compose", self.raw(**overrides))
        assert composed.status == 200, composed.text
        created = self.request("POST", "/v1/outpost/schedules", {"definition": composed.body["definition"],
                                                                 "confirmation": composed.body["confirmation"]})
        assert created.status == 201, created.text
        return created.body

    def fire(self, sid: str) -> str:
        revision = self.request("GET", f"/v1/outpost/schedules/{sid}").body["revision"]
        fired = self.request("POST", f"/v1/outpost/schedules/{sid}/control", {"action": "fire"},
                             if_match=f'"{revision}"')
        assert fired.status == 200 and fired.body["outcome"] == "admitted", fired.text
        return fired.body["run_id"]

    def failed_run_with_attention(self) -> tuple[str, str, str]:
        sid = self.schedule()["id"]
        rid = self.fire(sid)
        now = datetime.now(UTC)
        self.db(self.store.runs.settle_run, rid, ended(outpost.RunStatus.FAILED, error="boom"), now, exit_code=1)
        self.db(self.store.schedules.notify_run, rid, now)
        attention = [a for a in self.db(self.store.list_attention, True) if a["run_id"] == rid]
        return sid, rid, attention[0]["id"]


@pytest.fixture(scope="module")
def adv(tmp_path_factory):
    env = Adv(tmp_path_factory.mktemp("adversarial"))
    env.sid, env.rid, env.aid = env.failed_run_with_attention()
    env.live_rid = env.fire(env.schedule(concurrency_policy="always_enqueue")["id"])   # stays queued
    env.agent_id = env.request("POST", "/api/office/agents", {"name": "fuzzed", "executor": "demo"}).body["id"]
    env.task_id = env.request("POST", "/api/office/tasks", {"title": "t", "assignee_agent_id": env.agent_id}).body["id"]
    routine = env.request("POST", "/api/office/routines", {
        "name": "r", "assignee_agent_id": env.agent_id, "variables": [{"name": "n", "type": "number"}],
        "triggers": [{"kind": "webhook", "signing_mode": "hmac_sha256"}, {"kind": "webhook", "signing_mode": "none"},
                     {"kind": "schedule", "cron_expression": "0 9 * * *"}]}).body
    env.routine_id = routine["id"]
    env.webhooks = [t["public_id"] for t in routine["triggers"] if t["kind"] == "webhook"]
    yield env
    env.store.close()


def assert_problem(reply: Reply, status: int | tuple[int, ...], field: str | None = None,
                   code: str | None = None) -> None:
    statuses = (status,) if isinstance(status, int) else status
    assert reply.status in statuses, (reply.status, reply.text[:500])
    assert reply.mimetype == PROBLEM, (reply.mimetype, reply.text[:300])
    body = reply.body
    assert body["status"] == reply.status and body["code"] and body["title"], body
    if code is not None:
        assert body["code"] == code, body
    if field is not None:
        assert body["errors"][0]["field"] == field, body
        assert body["errors"][0]["message"], body


def assert_sane(reply: Reply) -> None:
    """No 500 (nor any 5xx), and every refusal a well-formed problem."""
    assert reply.status < 500, (reply.status, reply.text[:500])
    if reply.status >= 400:
        assert_problem(reply, reply.status)
    elif reply.status < 300:
        assert reply.mimetype in ("application/json", "text/plain"), reply.mimetype
        if reply.mimetype == "application/json":
            reply.body  # noqa: B018  (parses)


###############################################################################
# Hypothesis: every JSON endpoint and every GET endpoint, no 500, no hang.
###############################################################################

FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
PRINTABLE = st.characters(min_codepoint=32, max_codepoint=126)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=10), inner, max_size=4), max_leaves=10)
hostile_strings = st.sampled_from([
    "", " ", "\x00", "..", "../../etc/passwd", "/etc/passwd", "-x", "--upload-pack=touch /tmp/pwn", "٥ * * * *",
    "<script>alert(1)</script>", "\u202e", "%00", "{{date}}", "x" * 5000, "9" * 5000, "NaN", "null",
    "*/0 * * * *", "UTC\x00", "Europe", "main..HEAD", "HEAD\x00"]) | st.text(max_size=30)
any_value = hostile_strings | json_values


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def bodies(plausible):
    """Mostly plausible objects with hostile values, sometimes any JSON or any bytes."""
    return st.one_of(plausible.map(dumps), plausible.map(dumps), json_values.map(dumps),
                     st.binary(max_size=80),
                     st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"{}", b"\xff\xfe{}", b"NaN",
                                      b'{"a":1,"a":2}', b"[" * 500 + b"]" * 500]))


def patched(base: dict, fields: dict, extra=any_value) -> Any:
    """``base`` with some of ``fields`` replaced (by their strategy) and maybe an unknown key."""
    replaced = st.fixed_dictionaries({}, optional={k: v | extra for k, v in fields.items()})
    unknown = st.dictionaries(st.sampled_from(["bogus", "id", "revision", "__proto__"]), any_value, max_size=1)
    removed = st.sets(st.sampled_from(sorted(base)), max_size=1)
    return st.builds(lambda ch, un, rm: {k: v for k, v in {**base, **ch, **un}.items() if k not in rm},
                     replaced, unknown, removed)


def definition_fields(repo: str) -> dict:
    timing = st.fixed_dictionaries({"kind": st.sampled_from(["cron", "interval", "once", "weekly"]) | any_value},
                                   optional={"expression": st.sampled_from(["*/5 * * * *", "@daily", "@reboot", ""]),
                                             "seconds": st.sampled_from([9, 10, 3600, 31622401]) | st.integers(),
                                             "at": st.sampled_from(["2099-01-01T09:00", "2020-01-01T00:00Z",
                                                                    "9999-12-31T23:59"]),
                                             "timezone": st.sampled_from(["UTC", "Europe/Berlin", "Mars/Base"])})
    return {"name": hostile_strings, "brief": hostile_strings, "workdir": st.sampled_from([".", "sub", "nope"]),
            "repository": st.sampled_from([repo, repo + "/sub", "/nonexistent", "relative", "/"]),
            "source_ref": st.sampled_from(["HEAD", "main", "-x", "nope", "HEAD~5"]),
            "agent": st.sampled_from(["demo", "nope"]), "timing": timing,
            "limits": st.fixed_dictionaries({}, optional={"timeout_seconds": st.integers(),
                                                          "model": st.none() | st.text(max_size=5)}),
            "notify": st.sampled_from(["attention", "always", "never"]),
            "concurrency_policy": st.sampled_from(["skip_if_active", "always_enqueue", "nope"]),
            "catch_up": st.fixed_dictionaries({}, optional={
                "policy": st.sampled_from(["skip_missed", "enqueue_missed_with_cap", "x"]),
                "max": st.integers()})}


content_types = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data", None,
                                 "application/json; charset=utf-16", "*/*"])
idempotency_keys = st.one_of(st.just(FRESH), st.just(FRESH), st.just(MISSING), st.just("reused-key"),
                             st.just(""), st.just("k" * 256), st.text(alphabet=PRINTABLE, max_size=20))
if_matches = st.one_of(st.sampled_from(['"1"', '"2"', 'W/"1"', "*", "", '"abc"', "1", '"-1"', '"1", "2"',
                                        '"' + "9" * 30 + '"', MISSING]),
                       st.text(alphabet=PRINTABLE, max_size=20))


def path_ids(real: str):
    return st.one_of(st.just(real), st.just(real), st.sampled_from(["nope", "..", ".", "sch_" + "0" * 26, "%00"]),
                     st.text(alphabet=string.ascii_letters + string.digits + "_-.~%", min_size=1, max_size=30))


def quoted(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


@FUZZ
@given(data=st.data())
def test_fuzz_post_compose(adv, data):
    repo = str(adv.repo)
    plain = patched(adv.raw(), definition_fields(repo))
    edit = patched({"schedule_id": adv.sid, "brief": "@print edited"}, definition_fields(repo) | {
        "schedule_id": st.sampled_from([adv.sid, "nope", ""]) | any_value})
    body = data.draw(bodies(plain | edit))
    query = data.draw(st.sampled_from(["", "?count=3", "?count=0", "?count=101", "?count=x", "?from=2027-03-27T00:00Z",
                                       "?from=nope", "?from=", "?from=2027-03-27T00:00"]))
    assert_sane(adv.request("POST", "/v1/outpost/schedules/compose" + query, raw=body,
                            content_type=data.draw(content_types), key=MISSING))


@FUZZ
@given(data=st.data())
def test_fuzz_post_schedules(adv, data):
    composed = adv.request("POST", "/v1/outpost/schedules/compose", adv.raw()).body
    plausible = patched({"definition": composed["definition"], "confirmation": composed["confirmation"]},
                        {"definition": patched(composed["definition"], definition_fields(str(adv.repo))),
                         "confirmation": st.sampled_from([composed["confirmation"], "sha256:00", ""])})
    assert_sane(adv.request("POST", "/v1/outpost/schedules", raw=data.draw(bodies(plausible)),
                            content_type=data.draw(content_types), key=data.draw(idempotency_keys)))


@FUZZ
@given(data=st.data())
def test_fuzz_patch_schedule(adv, data):
    sid = data.draw(path_ids(adv.sid))
    changes = patched({"brief": "@print patched"}, definition_fields(str(adv.repo)))
    plausible = patched({"changes": {"brief": "@print patched"}, "confirmation": "sha256:00"},
                        {"changes": changes, "confirmation": st.sampled_from(["sha256:00", ""])})
    assert_sane(adv.request("PATCH", f"/v1/outpost/schedules/{quoted(sid)}", raw=data.draw(bodies(plausible)),
                            content_type=data.draw(content_types), key=data.draw(idempotency_keys),
                            if_match=data.draw(if_matches)))


@FUZZ
@given(data=st.data())
def test_fuzz_post_schedule_control(adv, data):
    sid = data.draw(path_ids(adv.sid))
    plausible = patched({"action": "pause"}, {"action": st.sampled_from(["enable", "pause", "resume", "fire",
                                                                         "archive", "cancel", "", "FIRE"])})
    assert_sane(adv.request("POST", f"/v1/outpost/schedules/{quoted(sid)}/control",
                            raw=data.draw(bodies(plausible)), content_type=data.draw(content_types),
                            key=data.draw(idempotency_keys), if_match=data.draw(if_matches)))


@FUZZ
@given(data=st.data())
def test_fuzz_post_run_adopt(adv, data):
    rid = data.draw(path_ids(adv.rid))
    plausible = patched({"workspace": "ws-1"}, {"workspace": st.sampled_from(["ws-1", "ws-2", "", "w" * 201])})
    assert_sane(adv.request("POST", f"/v1/outpost/runs/{quoted(rid)}/adopt", raw=data.draw(bodies(plausible)),
                            content_type=data.draw(content_types), key=data.draw(idempotency_keys)))


@FUZZ
@given(data=st.data())
def test_fuzz_post_run_control(adv, data):
    rid = data.draw(path_ids(data.draw(st.sampled_from([adv.rid, adv.live_rid]))))
    plausible = patched({"action": "pause"}, {"action": st.sampled_from(["cancel", "pause", "resume", "fire", ""])})
    assert_sane(adv.request("POST", f"/v1/outpost/runs/{quoted(rid)}/control", raw=data.draw(bodies(plausible)),
                            content_type=data.draw(content_types), key=data.draw(idempotency_keys)))


@FUZZ
@given(data=st.data())
def test_fuzz_post_dispatches(adv, data):
    fields = {k: v for k, v in definition_fields(str(adv.repo)).items() if k in outpost.DISPATCH_FIELDS}
    plausible = patched({"brief": "@print hi", "repository": str(adv.repo)}, fields)
    assert_sane(adv.request("POST", "/v1/outpost/dispatches", raw=data.draw(bodies(plausible)),
                            content_type=data.draw(content_types), key=data.draw(idempotency_keys)))


@FUZZ
@given(data=st.data())
def test_fuzz_post_attention_ack(adv, data):
    aid = data.draw(path_ids(adv.aid))
    assert_sane(adv.request("POST", f"/v1/outpost/attention/{quoted(aid)}/ack", raw=data.draw(bodies(json_values)),
                            content_type=data.draw(content_types), key=data.draw(idempotency_keys)))


GET_PATHS = ["/healthz", "/v1/outpost/schedules", "/v1/outpost/schedules/{sid}",
             "/v1/outpost/schedules/{sid}/occurrences", "/v1/outpost/schedules/{sid}/inspect", "/v1/outpost/runs",
             "/v1/outpost/runs/{rid}", "/v1/outpost/runs/{rid}/log", "/v1/outpost/attention", "/v1/outpost/events",
             "/v1/outpost/snapshot"]
QUERY_KEYS = ["limit", "before", "after", "offset", "status", "schedule_id", "state", "include_archived", "count",
              "from"]
query_values = st.one_of(st.text(max_size=30), st.integers().map(str), st.sampled_from(
    ["-1", "0", "1", "1e3", "0x10", "²", "٣", "１", "9" * 30, "9" * 5000, "\x00", "", "true", "queued", "open",
     "all", " 5", "5 ", "+5", "2**64", str(2**63), str(2**64)]))


@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_fuzz_get_query_strings(adv, data):
    """Random query strings on every GET endpoint of /v1/outpost (the event stream has its own test)."""
    path = data.draw(st.sampled_from(GET_PATHS)).format(sid=quoted(data.draw(path_ids(adv.sid))),
                                                         rid=quoted(data.draw(path_ids(adv.rid))))
    pairs = data.draw(st.lists(st.tuples(st.sampled_from(QUERY_KEYS) | st.text(max_size=8), query_values),
                               max_size=4))
    query = urllib.parse.urlencode(pairs)
    if data.draw(st.booleans()):
        query += "&" + urllib.parse.quote_from_bytes(data.draw(st.binary(max_size=20)))
    reply = adv.request("GET", f"{path}?{query}")
    assert_sane(reply)


###############################################################################
# Cron strings, timezones, workdirs, refs.
###############################################################################

HOSTILE_CRONS = {
    "empty": "", "blank": "   ", "four fields": "* * * *", "six fields": "* * * * * *", "step zero": "*/0 * * * *",
    "step zero in range": "0-59/0 * * * *", "double range": "1-5-7 * * * *", "arabic-indic digit": "٥ * * * *",
    "arabic-indic hour": "0 ٩ * * *", "arabic-indic step": "*/٢ * * * *", "fullwidth digit": "0 0 ３ * *",
    "devanagari digit": "० * * * *", "superscript digit": "² * * * *", "nul": "\x00 * * * *",
    "10 KB digits": "1" * 10240, "10 KB of fields": "* " * 5120,
    "reboot": "@reboot", "unknown alias": "@fortnightly", "hashed": "H * * * *", "random": "R * * * *",
    "last day": "0 0 L * *", "out of range": "61 * * * *", "never": "0 0 30 2 *",
}


TEN_KB_LIST = ",".join(["1"] * 5000) + " * * * *"


@pytest.mark.parametrize("expression", [*HOSTILE_CRONS.values(), pytest.param(TEN_KB_LIST, id="10 KB list")],
    ids=[*HOSTILE_CRONS, "10 KB list"])
def test_hostile_cron_is_422_timing_expression(adv, expression):
    started = time.monotonic()
    reply = adv.request("POST", "/v1/outpost/schedules/compose",
                        adv.raw(timing={"kind": "cron", "expression": expression, "timezone": "UTC"}))
    assert_problem(reply, 422, "timing.expression", "validation_failed")
    timing = {"kind": "cron", "expression": expression, "timezone": "UTC"}
    edit = adv.request("POST", "/v1/outpost/schedules/compose", {"schedule_id": adv.sid, "timing": timing})
    assert_problem(edit, 422, "timing.expression", "validation_failed")
    assert time.monotonic() - started < 5


HOSTILE_ZONES = ["../../etc/passwd", "/etc/localtime", "UTC\x00", "Europe/../../x", "Europe/Berlin/..", "./UTC",
                 "..", "Etc/../../../../../etc/passwd", "Europe", "Europe/", "Europe\\Berlin", "%2e%2e/etc/passwd",
                 "UTC\n", " UTC", "", "x" * 10000, "\u0000", "zone.tab", "tzdata.zi"]


@pytest.mark.parametrize("tz", HOSTILE_ZONES, ids=[repr(z[:20]) for z in HOSTILE_ZONES])
@pytest.mark.parametrize("kind", ["cron", "interval", "once"])
def test_hostile_timezone_is_422_timing_timezone(adv, tz, kind):
    timing = {"cron": {"kind": "cron", "expression": "0 9 * * *"}, "interval": {"kind": "interval", "seconds": 3600},
              "once": {"kind": "once", "at": "2099-01-05T09:00"}}[kind] | {"timezone": tz}
    assert_problem(adv.request("POST", "/v1/outpost/schedules/compose", adv.raw(timing=timing)), 422,
                   "timing.timezone", "validation_failed")


ESCAPING_WORKDIRS = ["..", "../", "../x", "sub/../..", "./../x", "sub/./../../x", "a/b/../../../c", "/tmp", "/",
                     "//etc", "/etc/passwd", str(Path("/tmp").resolve())]


@pytest.mark.parametrize("workdir", ESCAPING_WORKDIRS)
def test_escaping_workdir_is_refused_at_compose_and_dispatch(adv, workdir):
    assert_problem(adv.request("POST", "/v1/outpost/schedules/compose", adv.raw(workdir=workdir)), 422, "workdir")
    assert_problem(adv.request("POST", "/v1/outpost/schedules/compose", {"schedule_id": adv.sid, "workdir": workdir}),
                   422, "workdir")
    assert_problem(adv.request("POST", "/v1/outpost/dispatches",
                               {"brief": "@print hi", "repository": str(adv.repo), "workdir": workdir}), 422, "workdir")


HOSTILE_REFS = ["-x", "-", "--upload-pack=touch /tmp/outpost-pwned", "--output=/tmp/outpost-pwned", "main..HEAD",
                "HEAD..main", "..", "../main", "main...HEAD", "refs/heads/../main", "main\x00", "\x00", "HEAD\x00main",
                "HEAD\nmain", "ma in"]


@pytest.mark.parametrize("ref", HOSTILE_REFS, ids=[repr(r) for r in HOSTILE_REFS])
def test_hostile_ref_is_422_source_ref(adv, ref):
    assert_problem(adv.request("POST", "/v1/outpost/schedules/compose", adv.raw(source_ref=ref)), 422, "source_ref")
    assert_problem(adv.request("POST", "/v1/outpost/dispatches",
                               {"brief": "@print hi", "repository": str(adv.repo), "source_ref": ref}),
                   422, "source_ref")
    assert not Path("/tmp/outpost-pwned").exists()


###############################################################################
# Oversized, deeply nested and mislabelled bodies; lone surrogates; hostile headers.
###############################################################################

def json_endpoints(adv: Adv) -> list[tuple[str, str, dict[str, str]]]:
    """Every JSON endpoint of /v1/outpost with the headers that get a request to its body."""
    return [("POST", "/v1/outpost/schedules/compose", {}), ("POST", "/v1/outpost/schedules", {}),
            ("PATCH", f"/v1/outpost/schedules/{adv.sid}", {"If-Match": '"1"'}),
            ("POST", f"/v1/outpost/schedules/{adv.sid}/control", {"If-Match": '"1"'}),
            ("POST", f"/v1/outpost/runs/{adv.rid}/adopt", {}), ("POST", f"/v1/outpost/runs/{adv.rid}/control", {}),
            ("POST", "/v1/outpost/dispatches", {}), ("POST", f"/v1/outpost/attention/{adv.aid}/ack", {})]


ENDPOINT_IDS = ["compose", "schedules", "patch", "schedule-control", "adopt", "run-control", "dispatches", "ack"]


@pytest.mark.parametrize("which", range(8), ids=ENDPOINT_IDS)
def test_10_mb_prompt_is_413_payload_too_large(adv, which):
    method, path, headers = json_endpoints(adv)[which]
    body = {"name": "big", "brief": "@print " + "x" * (10 * 1024 * 1024), "repository": str(adv.repo),
            "timing": YEARLY, "changes": {}, "action": "pause", "workspace": "w"}
    assert_problem(adv.request(method, path, body, headers=headers), 413, code="payload_too_large")


def test_body_just_over_1_mib_is_413_and_a_long_brief_under_it_is_422_brief(adv):
    over = adv.raw(brief="x" * (outpost.MAX_BODY_BYTES + 1))
    assert_problem(adv.request("POST", "/v1/outpost/schedules/compose", over), 413, code="payload_too_large")
    under = adv.raw(brief="x" * 40000)
    assert_problem(adv.request("POST", "/v1/outpost/schedules/compose", under), 422, "brief")


@pytest.mark.parametrize("shape", ["array", "object"])
@pytest.mark.parametrize("which", range(8), ids=ENDPOINT_IDS)
def test_json_nested_10000_deep_is_422_body(adv, which, shape):
    method, path, headers = json_endpoints(adv)[which]
    raw = (b"[" * 10000 + b"]" * 10000) if shape == "array" else (b'{"a":' * 10000 + b"1" + b"}" * 10000)
    reply = adv.request(method, path, raw=raw, headers=headers)
    if path.endswith("/ack"):
        assert_sane(reply)   # ack takes no body: ignoring one is fine, crashing is not
    else:
        assert_problem(reply, 422, "body", "validation_failed")


@pytest.mark.parametrize("depth", [100, 500, 900, 990])
@pytest.mark.parametrize("which", range(8), ids=ENDPOINT_IDS)
def test_deep_nesting_inside_fields_is_never_500(adv, which, depth):
    method, path, headers = json_endpoints(adv)[which]
    deep = "[" * depth + "]" * depth
    raw = (f'{{"name": {deep}, "definition": {deep}, "changes": {{"timing": {deep}}}, "action": {deep}, '
           f'"workspace": {deep}, "brief": {deep}}}').encode()
    assert_sane(adv.request(method, path, raw=raw, headers=headers))


WRONG_TYPES = ["text/plain", "application/x-www-form-urlencoded", None, "multipart/form-data; boundary=x",
               "application/xml"]


@pytest.mark.parametrize("content_type", WRONG_TYPES, ids=[str(t) for t in WRONG_TYPES])
@pytest.mark.parametrize("which", range(7), ids=ENDPOINT_IDS[:7])
def test_wrong_content_type_with_a_non_json_body_is_422_body(adv, which, content_type):
    """README: bodies are JSON; a form (or text) body under any label is a 422 naming ``body``."""
    method, path, headers = json_endpoints(adv)[which]
    reply = adv.request(method, path, raw=b"name=x&brief=y&action=pause&workspace=w", headers=headers,
                        content_type=content_type)
    assert_problem(reply, 422, "body", "validation_failed")


@pytest.mark.parametrize("content_type", WRONG_TYPES, ids=[str(t) for t in WRONG_TYPES])
def test_wrong_content_type_with_a_json_body_is_read_as_json_never_500(adv, content_type):
    """The README requires no Content-Type: the bearer API reads the body as JSON whatever its label
    (cross-site requests cannot carry the bearer token; cookie requests are the hostile-web suite's)."""
    labelled = adv.request("POST", "/v1/outpost/schedules/compose", adv.raw(name="ct"))
    mislabelled = adv.request("POST", "/v1/outpost/schedules/compose", adv.raw(name="ct"), content_type=content_type)
    assert labelled.status == 200
    assert (mislabelled.status, mislabelled.body["confirmation"]) == (200, labelled.body["confirmation"])
    dispatched = adv.request("POST", "/v1/outpost/dispatches", {"brief": "@print hi", "repository": str(adv.repo),
                                                                "workdir": "../x"}, content_type=content_type)
    assert_problem(dispatched, 422, "workdir")


SURROGATE = "\ud800"
SURROGATE_CASES = {
    # name: (method, path template, body, headers, expected field or None for "any 4xx")
    "compose name": ("POST", "/v1/outpost/schedules/compose", {"name": SURROGATE}, {}, "name"),
    "compose brief": ("POST", "/v1/outpost/schedules/compose", {"brief": SURROGATE}, {}, "brief"),
    "compose timezone": ("POST", "/v1/outpost/schedules/compose", {"timing": {**YEARLY, "timezone": SURROGATE}}, {},
                         "timing.timezone"),
    "compose expression": ("POST", "/v1/outpost/schedules/compose",
                           {"timing": {**YEARLY, "expression": SURROGATE}}, {}, "timing.expression"),
    "compose key": ("POST", "/v1/outpost/schedules/compose", {SURROGATE: 1}, {}, None),
    "compose schedule_id": ("POST", "/v1/outpost/schedules/compose", {"schedule_id": SURROGATE}, {}, None),
    "create confirmation": ("POST", "/v1/outpost/schedules", {"confirmation": SURROGATE}, {}, None),
    "patch name": ("PATCH", "/v1/outpost/schedules/{sid}", {"changes": {"name": SURROGATE}}, {"If-Match": '"1"'},
                   "changes.name"),
    "patch confirmation": ("PATCH", "/v1/outpost/schedules/{sid}", {"changes": {}, "confirmation": SURROGATE},
                           {"If-Match": '"1"'}, None),
    "schedule control action": ("POST", "/v1/outpost/schedules/{sid}/control", {"action": SURROGATE},
                                {"If-Match": '"1"'}, "action"),
    "adopt workspace": ("POST", "/v1/outpost/runs/{rid}/adopt", {"workspace": SURROGATE}, {}, "workspace"),
    "run control action": ("POST", "/v1/outpost/runs/{rid}/control", {"action": SURROGATE}, {}, "action"),
    "dispatch brief": ("POST", "/v1/outpost/dispatches", {"brief": SURROGATE}, {}, "brief"),
    "dispatch workdir": ("POST", "/v1/outpost/dispatches", {"brief": "x", "workdir": SURROGATE}, {}, "workdir"),
}
@pytest.mark.parametrize("case", list(SURROGATE_CASES))
def test_lone_surrogate_in_any_string_is_422_never_500(adv, case):
    method, template, body, headers, field = SURROGATE_CASES[case]
    if template.endswith(("compose", "dispatches")):
        body = {**adv.raw(), **body} if template.endswith("compose") and "schedule_id" not in body else body
        if template.endswith("dispatches"):
            body = {"repository": str(adv.repo), **body}
    reply = adv.request(method, template.format(sid=adv.sid, rid=adv.rid), body, headers=headers)
    assert_problem(reply, (404, 409, 412, 422), field)


def test_lone_surrogate_in_path_ids_is_never_500(adv):
    encoded = "%ED%A0%80"   # UTF-8 bytes of a lone surrogate: not valid UTF-8
    for method, path, headers in [("GET", f"/v1/outpost/schedules/{encoded}", {}),
                                  ("GET", f"/v1/outpost/runs/{encoded}/log", {}),
                                  ("PATCH", f"/v1/outpost/schedules/{encoded}", {"If-Match": '"1"'}),
                                  ("POST", f"/v1/outpost/runs/{encoded}/adopt", {}),
                                  ("POST", f"/v1/outpost/attention/{encoded}/ack", {})]:
        reply = adv.request(method, path, {"workspace": "w", "changes": {}}, headers=headers)
        assert_problem(reply, (404, 422))


@pytest.mark.parametrize("if_match", [
    pytest.param('"' + "9" * 5000 + '"', id="5000 digits"),
    pytest.param('"' + "9" * 40 + '"', id="40 digits"), pytest.param('"-1"', id="negative"),
    pytest.param("*", id="star"), pytest.param("W/", id="weak nothing"), pytest.param('""', id="empty quotes"),
    pytest.param('"1", "2"', id="list"), pytest.param('"1' + "\t" * 3, id="tabs")])
def test_hostile_if_match_is_4xx(adv, if_match):
    for method, path, body in [("PATCH", f"/v1/outpost/schedules/{adv.sid}", {"changes": {}}),
                               ("POST", f"/v1/outpost/schedules/{adv.sid}/control", {"action": "pause"})]:
        reply = adv.request(method, path, body, if_match=if_match)
        assert_problem(reply, (412, 422, 428))


@pytest.mark.parametrize("key", ["", "k" * 256, "a\tb", "a\x7fb", "é", " ", " a"],
                         ids=["empty", "256 chars", "tab", "del", "latin-1", "space", "outer space"])
def test_hostile_idempotency_key_is_4xx(adv, key):
    """Outer spaces are refused too: " a" and "a" must not become one key."""
    reply = adv.request("POST", "/v1/outpost/dispatches", {"brief": "@print hi", "repository": str(adv.repo)}, key=key)
    assert_problem(reply, 422, "Idempotency-Key")


@pytest.mark.parametrize("where", ["create", "patch", "dashboard"])
def test_non_ascii_confirmation_is_422_confirmation_mismatch(adv, where):
    composed = adv.request("POST", "/v1/outpost/schedules/compose", adv.raw()).body
    forged = "sha256:" + "é" * 64
    if where == "create":
        reply = adv.request("POST", "/v1/outpost/schedules", {"definition": composed["definition"],
                                                             "confirmation": forged})
    elif where == "patch":
        reply = adv.request("PATCH", f"/v1/outpost/schedules/{adv.sid}",
                            {"changes": {"brief": "@print x"}, "confirmation": forged},
                            if_match=f'"{adv.request("GET", f"/v1/outpost/schedules/{adv.sid}").body["revision"]}"')
    else:
        cookie, csrf = adv.db(adv.store.access.create_session, datetime.now(UTC))
        form = urllib.parse.urlencode({"csrf": csrf, "definition": json.dumps(composed["definition"]),
                                       "confirmation": forged}).encode()
        reply = adv.request("POST", "/schedules", raw=form, auth=False, key=MISSING,
                            content_type="application/x-www-form-urlencoded",
                            headers={"Cookie": f"{outpost.SESSION_COOKIE}={cookie}", "Origin": "http://127.0.0.1",
                                     "Sec-Fetch-Site": "same-origin", "Host": "127.0.0.1"})
        assert reply.status == 422, (reply.status, reply.text[:300])
        return
    assert_problem(reply, 422, "confirmation", "confirmation_mismatch")


@pytest.mark.parametrize("instant", [
    pytest.param("9999-12-31T23:59:59-23:59"),
    pytest.param("0001-01-01T00:00:00+01:00"),
    "0001-01-01T00:00:00Z", "1969-12-31T23:59:59Z", "9001-01-01T00:00:00Z", "nope", "2027-01-01T00:00:00",
    "2027-02-30T00:00:00Z"])
def test_hostile_compose_from_is_422_from(adv, instant):
    reply = adv.request("POST", "/v1/outpost/schedules/compose?from=" + urllib.parse.quote(instant), adv.raw())
    assert_problem(reply, 422, "from")


###############################################################################
# The real server: a symlinked workdir, chunked uploads, the event stream.
###############################################################################

@dataclass
class Live:
    server: Server
    repo: Path
    outside: Path

    def fresh_client(self) -> httpx.Client:
        """A client of its own (a connection one test left in a bad state cannot hang the next)."""
        client = self.server.client()
        client.timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
        return client


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    base = tmp_path_factory.mktemp("adversarial-live")
    outside = base / "outside"
    outside.mkdir()
    repo = make_repo(base / "repo", {"escape": outside})   # a committed symlink pointing outside the repo
    server = Server(base / "data").start()
    yield Live(server, repo, outside)
    if server.proc.poll() is None:
        server.stop()


def test_symlinked_workdir_never_runs_the_agent_outside_the_worktree(live):
    brief = "@edit escaped.txt written outside the worktree\n@print ran"
    with live.fresh_client() as client:
        reply = client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": uuid.uuid4().hex},
                            json={"brief": brief, "repository": str(live.repo), "workdir": "escape"})
        if reply.status_code == 422:   # refused up front: fine, if it names the workdir
            assert reply.json()["errors"][0]["field"] == "workdir"
            return
        assert reply.status_code == 202, reply.text
        run_id = reply.json()["run_id"]
        run = wait_for(lambda: (r := client.get(f"/v1/outpost/runs/{run_id}").json())["status"] in SETTLED and r)
    escaped = sorted(os.listdir(live.outside))
    assert escaped == [], f"the agent wrote {escaped} outside the worktree; run {run['status']}: {run['error']}"
    assert run["status"] == "failed" and "workdir" in (run["error"] or ""), run


def ten_mb_chunks(repo: Path):
    """A 10 MB dispatch sent chunked (no Content-Length)."""
    yield b'{"brief": "'
    for _ in range(160):
        yield b"x" * 65536
    yield f'", "repository": {json.dumps(str(repo))}}}'.encode()


def post_chunked_10_mb(live: Live, client: httpx.Client) -> httpx.Response:
    try:
        return client.post("/v1/outpost/dispatches", content=ten_mb_chunks(live.repo),
                           headers={"Idempotency-Key": uuid.uuid4().hex, "Content-Type": "application/json"})
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError, httpx.TimeoutException) as exc:
        pytest.fail(f"no 413 for a chunked 10 MB body: {exc!r}")


def test_chunked_10_mb_body_without_content_length_is_413(live):
    with live.fresh_client() as client:
        reply = post_chunked_10_mb(live, client)
        assert reply.status_code == 413, reply.text[:300]
        assert reply.headers["content-type"] == PROBLEM and reply.json()["code"] == "payload_too_large"
    with live.fresh_client() as other:
        assert other.get("/healthz").status_code == 200


def post_10_mb(live: Live, client: httpx.Client, chunked: bool) -> httpx.Response:
    if chunked:
        return post_chunked_10_mb(live, client)
    body = json.dumps({"brief": "x" * (10 * 1024 * 1024), "repository": str(live.repo)}).encode()
    try:
        return client.post("/v1/outpost/dispatches", content=body,
                           headers={"Idempotency-Key": uuid.uuid4().hex, "Content-Type": "application/json"})
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        pytest.fail(f"the server dropped the connection instead of answering 413: {exc!r}")


def test_10_mb_body_with_content_length_is_413_on_the_real_server(live):
    with live.fresh_client() as client:
        reply = post_10_mb(live, client, chunked=False)
        assert reply.status_code == 413 and reply.json()["code"] == "payload_too_large", reply.text[:300]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_the_connection_after_a_413_answers_or_is_closed(live, chunked):
    for _ in range(5):   # the Content-Length case is timing-dependent: any hang in five tries fails
        with live.fresh_client() as client:
            assert post_10_mb(live, client, chunked).status_code == 413
            try:
                assert client.get("/healthz", timeout=2).status_code == 200
            except httpx.RemoteProtocolError:
                pass   # the server closed the connection: the client knows at once, fine
            except httpx.TimeoutException:
                pytest.fail("the next request on the keep-alive connection hung")


def stream_status(live: Live, query: str) -> tuple[int, str]:
    """The status of GET /v1/outpost/events/stream (599: a 200 whose stream then broke)."""
    with live.fresh_client() as client, client.stream("GET", "/v1/outpost/events/stream" + query,
                                                      timeout=5) as reply:
        if reply.status_code != 200:
            return reply.status_code, reply.read().decode()
        text = ""
        try:
            for chunk in reply.iter_text():
                text += chunk
                if "retry:" in text:
                    break
        except (httpx.RemoteProtocolError, httpx.ReadError):
            return 599, text
        return 200, text


@pytest.mark.parametrize("after", [
    pytest.param("²"),
    pytest.param("9" * 5000),
    pytest.param(str(2**64), id="2**64"),
], ids=["superscript two", "5000 digits", "2**64"])
def test_hostile_event_stream_cursor_is_4xx(live, after):
    status, text = stream_status(live, "?after=" + urllib.parse.quote(after))
    assert 400 <= status < 500, (status, text[:300])


@pytest.mark.parametrize("after", ["-1", "abc"])
def test_a_cursor_that_is_no_number_is_422(live, after):
    status, text = stream_status(live, "?after=" + after)
    assert status == 422 and '"field": "after"' in text, (status, text)


@pytest.mark.parametrize("after", ["", "0", "1"])
def test_an_empty_or_numeric_cursor_streams(live, after):
    status, text = stream_status(live, "?after=" + after)
    assert status == 200 and text.startswith("retry:"), (status, text)


@pytest.mark.parametrize("value", [
    pytest.param(b'"\xb2"', id="latin-1 superscript"),
    pytest.param(b'"\xef\xbc\x91"', id="utf-8 fullwidth one"), pytest.param(b'"1\xff"', id="byte ff")])
def test_non_ascii_if_match_bytes_are_4xx(live, value):
    """Header bytes outside ASCII reach parse_if_match decoded as latin-1 ('²'.isdigit() is True)."""
    with live.fresh_client() as client:
        raw = {"name": f"ifm-{uuid.uuid4().hex[:8]}", "brief": "@print hi", "repository": str(live.repo),
               "timing": YEARLY}
        composed = client.post("/v1/outpost/schedules/compose", json=raw).json()
        created = client.post("/v1/outpost/schedules", headers={"Idempotency-Key": uuid.uuid4().hex},
                              json={"definition": composed["definition"], "confirmation": composed["confirmation"]})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        for method, path, body in [("PATCH", f"/v1/outpost/schedules/{sid}", {"changes": {}}),
                                   ("POST", f"/v1/outpost/schedules/{sid}/control", {"action": "pause"})]:
            reply = client.request(method, path, json=body,
                                   headers={"Idempotency-Key": uuid.uuid4().hex, "If-Match": value})
            assert 400 <= reply.status_code < 500, (reply.status_code, reply.text[:300])
            assert reply.headers["content-type"] == PROBLEM
        client.post(f"/v1/outpost/schedules/{sid}/control", json={"action": "archive"},
                    headers={"Idempotency-Key": uuid.uuid4().hex, "If-Match": created.headers["ETag"]})


def test_real_server_is_still_healthy_after_the_abuse(live):
    with live.fresh_client() as client:
        assert client.get("/healthz").json()["ok"] is True


###############################################################################
# Hypothesis on the Office API (docs/office.md): every write, no 500, no hang.
###############################################################################

def office_writes(adv: Adv) -> dict[str, tuple[str, str, Any]]:
    """Each Office write: (method, path, plausible body strategy with hostile values)."""
    ids = st.sampled_from([adv.agent_id, adv.task_id, "nope", "", "agt_" + "0" * 26]) | any_value
    states = st.sampled_from(["TODO", "IN_PROGRESS", "IN_REVIEW", "DONE", "CANCELLED", "done", ""]) | any_value
    agent = {"name": hostile_strings, "role": st.sampled_from(["worker", "ceo", "coordinator", "boss"]),
             "status": st.sampled_from(["idle", "working", "paused", "stopped", "x"]),
             "executor": st.sampled_from(["demo", "nope", None]), "max_concurrent_sessions": st.integers(),
             "cooldown_sec": st.integers(), "skip_idle_wakeups": any_value, "budget_runs_per_day": st.integers(),
             "instructions": hostile_strings, "workspace_id": ids}
    task = {"title": hostile_strings, "description": hostile_strings, "state": states, "assignee_agent_id": ids,
            "parent_id": ids, "blocked_by": st.lists(ids, max_size=3) | any_value,
            "reviewers": st.lists(ids) | any_value,
            "requires_approval": any_value, "workflow": st.sampled_from(["office", "kanban", "routine"]),
            "executor": st.sampled_from(["demo", None, "x"]), "archived": any_value, "project_id": ids}
    routine = {"name": hostile_strings, "assignee_agent_id": ids, "status": st.sampled_from(["active", "paused", "x"]),
               "concurrency_policy": any_value, "catch_up_policy": any_value, "catch_up_max": st.integers(),
               "task_template": st.one_of(st.just({}), st.just(""), st.fixed_dictionaries(
                   {"title": hostile_strings}, optional={"description": hostile_strings})) | any_value,
               "variables": st.lists(st.fixed_dictionaries({"name": hostile_strings}, optional={
                   "type": st.sampled_from(["text", "number", "boolean", "select", "x"]), "default": any_value,
                   "required": any_value, "options": any_value}), max_size=3) | any_value,
               "triggers": st.lists(st.fixed_dictionaries({"kind": st.sampled_from(["schedule", "webhook", "x"])},
                                                          optional={"cron_expression": hostile_strings,
                                                                    "timezone": hostile_strings,
                                                                    "signing_mode": any_value}), max_size=2)}
    return {
        "create agent": ("POST", "/api/office/agents", patched({"name": "a"}, agent)),
        "edit agent": ("PATCH", f"/api/office/agents/{adv.agent_id}", patched({"cooldown_sec": 5}, agent)),
        "wake agent": ("POST", f"/api/office/agents/{adv.agent_id}/wake", patched({"context": "x"},
                                                                                  {"context": any_value})),
        "create task": ("POST", "/api/office/tasks", patched({"title": "t"}, task)),
        "edit task": ("PATCH", f"/api/office/tasks/{adv.task_id}", patched({"title": "t2"}, task)),
        "move task": ("POST", f"/api/office/tasks/{adv.task_id}/move", patched({"state": "TODO"}, {"state": states})),
        "comment": ("POST", f"/api/office/tasks/{adv.task_id}/comments", patched({"body": "hi"},
                                                                                 {"body": hostile_strings})),
        "resolve approval": ("POST", "/api/office/approvals/apr_nope/resolve", patched(
            {"status": "approved"}, {"status": any_value, "decision_note": any_value})),
        "settings": ("PATCH", "/api/office/settings", patched({"name": "Default"}, {
            "timezone": hostile_strings, "repository": hostile_strings, "source_ref": hostile_strings,
            "recovery_lookback_hours": st.integers() | st.floats(), "default_executor": any_value,
            "budget_runs_per_day": st.integers()})),
        "workspace": ("POST", "/api/office/workspaces", patched({"name": "w"}, {"name": hostile_strings})),
        "project": ("POST", "/api/office/projects", patched({"name": "p"}, {"repository": hostile_strings,
                                                                           "executor": any_value})),
        "create routine": ("POST", "/api/office/routines", patched({"name": "r", "assignee_agent_id": adv.agent_id},
                                                                   routine)),
        "edit routine": ("PATCH", f"/api/office/routines/{adv.routine_id}", patched({"name": "r"}, {
            k: v for k, v in routine.items() if k != "triggers"})),
        "fire routine": ("POST", f"/api/office/routines/{adv.routine_id}/fire", patched(
            {"variables": {"n": 1}},
            {"variables": st.dictionaries(st.sampled_from(["n", "x"]), any_value) | any_value})),
        "add trigger": ("POST", f"/api/office/routines/{adv.routine_id}/triggers", patched(
            {"kind": "webhook"}, {"kind": any_value, "cron_expression": hostile_strings, "signing_mode": any_value})),
    }


OFFICE_WRITES = ["create agent", "edit agent", "wake agent", "create task", "edit task", "move task", "comment",
                 "resolve approval", "settings", "workspace", "project", "create routine", "edit routine",
                 "fire routine", "add trigger"]


@pytest.mark.parametrize("which", OFFICE_WRITES)
@settings(max_examples=25, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_office_writes(adv, which, data):
    method, path, plausible = office_writes(adv)[which]
    query = data.draw(st.sampled_from(["", "", "?workspace_id=nope", "?workspace_id="]))
    assert_sane(adv.request(method, path + query, raw=data.draw(bodies(plausible)),
                            content_type=data.draw(content_types), key=data.draw(idempotency_keys)))


@FUZZ
@given(data=st.data())
def test_fuzz_webhook_fires(adv, data):
    """Anyone on the network can call a webhook: hostile bodies and signature headers."""
    public_id = data.draw(st.sampled_from(adv.webhooks) | path_ids("nope"))
    headers = data.draw(st.fixed_dictionaries({}, optional={
        "X-Outpost-Signature": st.sampled_from(["", "t=,v1=", "t=1,v1=00", "v1=zz", "t=99999999999999999999,v1=a",
                                                "t=-5,v1=00"]) | st.text(alphabet=PRINTABLE, max_size=40),
        "X-Hub-Signature-256": st.sampled_from(["sha256=", "sha256=00", "md5=x"]) | st.text(alphabet=PRINTABLE,
                                                                                             max_size=20),
        "X-GitHub-Delivery": st.text(alphabet=PRINTABLE, max_size=300),
        "Authorization": st.sampled_from(["Bearer ", "Bearer x", "Basic eA=="])}))
    body = data.draw(bodies(st.dictionaries(st.sampled_from(["n", "branch", "a.b"]), any_value, max_size=3)))
    reply = adv.request("POST", f"/api/routine-triggers/{quoted(public_id)}/fire", raw=body, headers=headers,
                        content_type=data.draw(content_types), key=MISSING, auth=False)
    assert_sane(reply)

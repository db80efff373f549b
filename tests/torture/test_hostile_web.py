"""Torture, hostile local web (issue 6): foreign Host headers, cross-site writes with a valid
session cookie, agents that dump their environment, a sentinel secret that must never leak,
markup in names and briefs, and the Content-Security-Policy on every response.

The in-process app covers the routing, CSRF and rendering cases (every route is enumerated from
the app's url_map, so a new route is covered without editing this file); one real
``outpost serve`` (token = a sentinel, ``--verbose``) covers agent environments, logs and run logs."""

from __future__ import annotations

import html
import json
import os
import re
import secrets
import socket
import sqlite3
import tempfile
import urllib.parse
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from conftest import Reply, Server, ended, make_repo, wait_for

import outpost

TOKEN = "hostile-web-token"
PROBLEM = "application/problem+json"
HOST = "127.0.0.1:8321"
SAME_ORIGIN = {"Host": HOST, "Origin": f"http://{HOST}", "Sec-Fetch-Site": "same-origin"}
XSS_SCRIPT = "<script>alert(1)</script>"
XSS_IMG = '"><img src=x onerror=alert(1)>'
XSS = XSS_SCRIPT + XSS_IMG
YEARLY = {"kind": "cron", "expression": "0 0 1 1 *", "timezone": "UTC"}
SETTLED = ("succeeded", "failed", "needs_you", "cancelled")
REQUEST_TIMEOUT_S = 10



def csp_ok(headers) -> bool:
    policy = headers.get("Content-Security-Policy", "")
    return "frame-ancestors 'none'" in policy and "default-src 'self'" in policy



class Web:
    """The in-process app with a store seeded with markup-laden names, runs and attention."""

    def __init__(self, base: Path):
        self.base = base
        self.repo = make_repo(base / "repo")
        # A Slack channel "demo" (the route fill's name), its task made for the Office agent below.
        self.channel = outpost.ChannelEntry("demo", "slack", "C1", "create", XSS, "xoxb-t", signing_secret="s")
        config = outpost.Config(data_dir=base, agents=(outpost.demo_profile(),), channels=(self.channel,))
        self.db_path = base / "outpost.sqlite3"
        self.deps = outpost.Deps(config=config, store=outpost.Store(self.db_path), clock=outpost.WallClock(),
                                 token=TOKEN)
        self.store = self.deps.store
        self.app = outpost.create_app(self.deps)
        self.client = self.app.test_client()
        self.cookie, self.csrf = self.db(self.store.access.create_session, datetime.now(UTC))

    def db(self, fn, *args, **kwargs):
        return self.store.transaction(fn, *args, **kwargs)[0]

    def request(self, method: str, path: str, *, data: bytes | None = None, headers: dict[str, str] | None = None,
                bearer: bool = False, cookie: bool = False) -> Reply:
        sent = {"Host": HOST}
        if bearer:
            sent["Authorization"] = f"Bearer {TOKEN}"
        if cookie:
            sent["Cookie"] = f"{outpost.SESSION_COOKIE}={self.cookie}"
        sent.update(headers or {})

        async def go():
            with trio.fail_after(REQUEST_TIMEOUT_S):
                response = await self.client.open(path, method=method, headers=sent, data=data)
                return response, await response.get_data(as_text=True)

        response, text = trio.run(go)
        return Reply(response.status_code, text, response.mimetype, response.headers)

    def api(self, method: str, path: str, body: Any = None, **headers: str) -> Reply:
        sent = {"Content-Type": "application/json", **headers}
        if method in ("POST", "PATCH") and not path.endswith("/compose"):
            sent.setdefault("Idempotency-Key", uuid.uuid4().hex)
        reply = self.request(method, path, data=json.dumps(body).encode() if body is not None else None,
                             headers=sent, bearer=True)
        return reply

    def page(self, path: str, form: dict[str, str] | None = None) -> Reply:
        """A dashboard page as a signed-in, same-origin browser gets it."""
        if form is None:
            return self.request("GET", path, cookie=True, headers={"Accept": "text/html"})
        data = urllib.parse.urlencode({"csrf": self.csrf, **form}).encode()
        return self.request("POST", path, data=data, cookie=True, headers={
            **SAME_ORIGIN, "Accept": "text/html", "Content-Type": "application/x-www-form-urlencoded"})

    def schedule(self, **overrides) -> dict:
        raw = {"name": f"web-{uuid.uuid4().hex[:8]}", "brief": "@print hi", "repository": str(self.repo),
               "agent": "demo", "timing": YEARLY} | overrides
        composed = self.api("POST", "/v1/outpost/schedules/compose", raw)
        assert composed.status == 200, composed.text
        created = self.api("POST", "/v1/outpost/schedules", {"definition": composed.body["definition"],
                                                             "confirmation": composed.body["confirmation"]})
        assert created.status == 201, created.text
        return created.body

    def fire(self, sid: str) -> str:
        revision = self.api("GET", f"/v1/outpost/schedules/{sid}").body["revision"]
        fired = self.api("POST", f"/v1/outpost/schedules/{sid}/control", {"action": "fire"},
                         **{"If-Match": f'"{revision}"'})
        assert fired.status == 200, fired.text
        return fired.body["run_id"]

    def state(self) -> dict[str, list]:
        """Every row of every table: what 'nothing changed in the store' compares."""
        db = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=5)
        try:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            return {t: sorted(map(repr, db.execute(f'SELECT * FROM "{t}"'))) for t in tables}
        finally:
            db.close()


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    env = Web(tmp_path_factory.mktemp("hostile-web"))
    # Markup everywhere a human-chosen or agent-produced string is shown.
    env.sid = env.schedule(name=XSS, brief=f"{XSS}\n@print hi")["id"]
    env.rid = env.fire(env.sid)
    now = datetime.now(UTC)
    env.db(env.store.runs.settle_run, env.rid, ended(outpost.RunStatus.FAILED, error=f"boom {XSS}",
                                                result={"status": "failed", "summary": XSS, "question": XSS}),
           now, exit_code=1)
    env.db(env.store.schedules.notify_run, env.rid, now)
    env.deps.log_path(env.rid).parent.mkdir(parents=True, exist_ok=True)
    env.deps.log_path(env.rid).write_text(f"agent said {XSS}\n")
    dispatched = env.api("POST", "/v1/outpost/dispatches", {"brief": f"{XSS}\n@print hi", "repository": str(env.repo)})
    assert dispatched.status == 202, dispatched.text
    env.dispatch_rid = dispatched.body["run_id"]
    env.aid = env.db(env.store.list_attention, True)[0]["id"]
    # Office: the same markup in an agent's name, a task, a comment, an approval and a routine.
    office = env.db(env.store.office.create_agent, None, outpost.normalize_agent({"name": XSS, "executor": "demo"},
                                                                          profiles=["demo"]), now)
    env.agent_id = office["id"]
    env.db(env.store.channels.sync, (env.channel,), now)
    task = env.db(env.store.office.create_task, None, outpost.normalize_task(
        {"title": XSS, "description": XSS, "assignee_agent_id": env.agent_id}, profiles=["demo"]), now)
    env.task_id = task["id"]
    env.db(env.store.office.add_comment, env.task_id, XSS, now)
    env.approval_id = env.db(env.store.office.request_approval, env.task_id, env.agent_id, XSS, now, "ws_default")["id"]
    routine = env.db(env.store.routines.create_routine, None, outpost.normalize_routine(
        {"name": XSS, "description": XSS, "assignee_agent_id": env.agent_id}),
        [{"kind": "webhook", "signing_mode": "hmac_sha256", "enabled": True}], now)
    env.routine_id, env.trigger_id = routine["id"], routine["triggers"][0]["id"]
    env.public_id = routine["triggers"][0]["public_id"]
    # A proposal of a person's agent: markup in its name, brief and the note it is declined with.
    definition = outpost.normalize_definition({"name": f"{XSS} proposed", "brief": XSS, "repository": str(env.repo),
                                               "agent": "demo", "timing": {"kind": "cron", "expression": "0 9 * * *",
                                                                           "timezone": "UTC"}}, now, agents=["demo"])
    env.proposal_id = env.db(env.store.access.create_proposal, "create", None, {"definition": definition}, None,
                             {**outpost.composed(definition, now, definition["timing"]), "name": definition["name"]},
                             XSS, now)["id"]
    yield env
    env.store.close()


def rule_paths(web: Web) -> list[tuple[str, set[str], str]]:
    """Every route of the app (from its url_map) with real ids filled in: (rule, methods, path)."""
    values = {"schedule_id": web.sid, "run_id": web.rid, "attention_id": web.aid, "code": "nope",
              "filename": "outpost.css", "agent_id": web.agent_id, "task_id": web.task_id,
              "approval_id": web.approval_id, "routine_id": web.routine_id, "trigger_id": web.trigger_id,
              "public_id": web.public_id, "name": "demo", "other_id": web.rid, "proposal_id": web.proposal_id,
              "entry_id": "ntf_none"}
    routes = []
    for rule in web.app.url_map.iter_rules():
        path = rule.rule
        for arg in rule.arguments:
            path = re.sub(rf"<(?:[a-z]+:)?{arg}>", values[arg], path)
        routes.append((rule.rule, set(rule.methods), path))
    return routes


###############################################################################
# A foreign Host header on every route.
###############################################################################

FOREIGN_HOSTS = ["evil.example", "evil.example:8321", "127.0.0.1.evil.example", "localhost:80@evil",
                 "localhost@evil.example", "127.0.0.1:8321@evil.example", "localhost.evil.example:8321",
                 "127.0.0.1:8321 evil.example", "evil.example#127.0.0.1", "10.0.0.5:8321", "0.0.0.0:8321",
                 "[::ffff:7f00:1]:8321", "127.0.0.1:99999999"]


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
def test_foreign_host_is_403_forbidden_host_on_every_route(web, host):
    """With a valid token, session and CSRF token: only the Host is wrong, so only it can refuse."""
    before = web.state()
    credentials = {"Authorization": f"Bearer {TOKEN}", "Cookie": f"{outpost.SESSION_COOKIE}={web.cookie}",
                   "X-CSRF-Token": web.csrf, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin",
                   "Content-Type": "application/json", "Idempotency-Key": uuid.uuid4().hex, "If-Match": '"1"'}
    wrong = []
    targets = [(rule, method, path) for rule, methods, path in rule_paths(web) for method in sorted(methods)]
    targets += [("(no route)", "GET", "/no/such/page"), ("(no route)", "DELETE", "/v1/outpost/schedules")]
    for rule, method, path in targets:
        reply = web.request(method, path, data=b'{"action": "archive"}' if method not in ("GET", "HEAD") else None,
                            headers={**credentials, "Host": host})
        ok = reply.status == 403 and (method == "HEAD" or (
            reply.mimetype == PROBLEM and reply.body["code"] == "forbidden_host"))
        if not ok:
            wrong.append(f"{method} {rule}: {reply.status} {reply.text[:120]!r}")
    assert not wrong, "\n".join(wrong)
    assert web.state() == before


def test_local_hosts_are_answered(web):
    """The control: the same credentials on 127.0.0.1, localhost and [::1] (any port) get through."""
    for host in ["127.0.0.1", "127.0.0.1:8321", "localhost:1", "LOCALHOST", "[::1]:8321"]:
        reply = web.request("GET", "/healthz", headers={"Host": host})
        assert reply.status == 200, (host, reply.text)


###############################################################################
# Cross-site unsafe requests with a valid session cookie.
###############################################################################

CROSS_SITE = {
    "origin evil": {"Origin": "http://evil.example"},
    "sec-fetch-site cross-site": {"Sec-Fetch-Site": "cross-site"},
    "both": {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
    "local page on another port": {"Origin": "http://127.0.0.1:1", "Sec-Fetch-Site": "same-site"},
    "origin null": {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
    "origin with the host as userinfo": {"Origin": f"http://{HOST}@evil.example"},
    "no origin, no csrf header": {},
}


#: Routes that never take the session cookie: a webhook fire (its own signature) and the agent
#: API (a run token). A cookie alone gets 401 there; see the test right after this one.
COOKIELESS = ("/api/routine-triggers/", "/api/agent/", "/api/channels/")


@pytest.mark.parametrize("variant", list(CROSS_SITE))
def test_cross_site_unsafe_requests_with_a_session_are_403_and_change_nothing(web, variant):
    before = web.state()
    wrong = []
    for rule, methods, path in rule_paths(web):
        if rule.startswith(COOKIELESS):
            continue
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            for body, ctype in [(b'{"action": "archive", "workspace": "evil"}', "text/plain"),
                                (f"action=archive&revision=1&csrf={web.csrf}&token=guess".encode(),
                                 "application/x-www-form-urlencoded")]:
                if variant == "no origin, no csrf header" and b"csrf=" in body:
                    continue   # a same-origin form with the right CSRF token is the legitimate case
                reply = web.request(method, path, data=body, cookie=True, headers={
                    "Content-Type": ctype, "Idempotency-Key": uuid.uuid4().hex, "If-Match": '"1"',
                    **CROSS_SITE[variant]})
                allowed = {403} if method in methods else {403, 405}
                if rule == "/signin" and method == "POST":
                    allowed |= {401}   # no Origin and no Sec-Fetch-Site: the sign-in is judged by its token
                if reply.status not in allowed:
                    wrong.append(f"{method} {rule} ({ctype}): {reply.status} {reply.text[:120]!r}")
    assert not wrong, "\n".join(wrong)
    assert web.state() == before, "a refused cross-site request changed the store"


def test_a_session_cookie_does_not_open_webhooks_or_the_agent_api(web):
    """Cross-site with a valid cookie: the agent API refuses (no run token) and changes
    nothing; a webhook without a signature is refused, fires nothing, and only its refusal
    is recorded (the audit trail of docs/office.md)."""
    runs_before = web.db(web.store.routines.get_routine, web.routine_id)["runs"]
    visited = set()
    for rule, methods, path in rule_paths(web):
        if not rule.startswith(COOKIELESS):
            continue
        for method in methods - {"GET", "HEAD", "OPTIONS"}:
            visited.add(rule)
            reply = web.request(method, path, data=b'{"body": "x", "state": "DONE"}', cookie=True, headers={
                "Content-Type": "application/json", "X-CSRF-Token": web.csrf, **CROSS_SITE["both"]})
            # no Telegram channel is named "demo" here: 404, cookie or not
            expected = 404 if rule == "/api/channels/telegram/<name>" else 401
            assert reply.status == expected, (rule, reply.status, reply.text)
    assert {"/api/agent/comments", "/api/routine-triggers/<public_id>/fire", "/api/channels/slack/<name>"} <= visited
    detail = web.db(web.store.routines.get_routine, web.routine_id)
    assert detail["runs"] == runs_before
    assert detail["triggers"][0]["refused_deliveries"][0]["reason"].startswith("missing X-Outpost-Signature")


def test_cross_site_sign_in_post_is_403(web):
    before = web.state()
    for token in ("guess", TOKEN):
        reply = web.request("POST", "/signin", data=urllib.parse.urlencode({"token": token}).encode(),
                            headers={**CROSS_SITE["both"], "Content-Type": "application/x-www-form-urlencoded"})
        assert reply.status == 403, (token == TOKEN, reply.status)
    assert web.state() == before


def test_cross_site_with_a_leaked_csrf_header_is_still_403(web):
    """Even holding the CSRF token, a request from another origin is refused (defence in depth)."""
    before = web.state()
    for origin in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        reply = web.request("POST", "/attention/ack-all", data=b"", cookie=True,
                            headers={"X-CSRF-Token": web.csrf, "Content-Type": "text/plain", **origin})
        assert reply.status == 403, reply.text
        reply = web.request("POST", f"/v1/outpost/attention/{web.aid}/ack", data=b"{}", cookie=True,
                            headers={"X-CSRF-Token": web.csrf, "Content-Type": "application/json",
                                     "Idempotency-Key": uuid.uuid4().hex, **origin})
        assert reply.status == 403 and reply.body["code"] == "forbidden", reply.text
    assert web.state() == before


def test_same_origin_request_with_the_session_works(web):
    """The control for the cross-site tests: the cookie is valid and the same request from the
    dashboard itself is accepted (run after them: it changes the store)."""
    reply = web.request("GET", "/v1/outpost/snapshot", cookie=True)
    assert reply.status == 200, reply.text
    fresh = web.schedule()
    reply = web.request("POST", f"/schedules/{fresh['id']}/control", cookie=True, data=urllib.parse.urlencode(
        {"csrf": web.csrf, "action": "pause", "revision": "1"}).encode(),
        headers={**SAME_ORIGIN, "Content-Type": "application/x-www-form-urlencoded"})
    assert reply.status == 303, reply.text   # POST/redirect/GET
    assert web.api("GET", f"/v1/outpost/schedules/{fresh['id']}").body["enabled"] is False


###############################################################################
# Markup in names, briefs, errors and logs renders escaped on every page.
###############################################################################

def pages(web: Web) -> dict[str, Reply]:
    review_form = {"name": XSS, "brief": XSS, "repository": str(web.repo), "timing_kind": "cron",
                   "expression": "0 9 * * *", "timezone": "UTC", "agent": "demo", "workdir": ".",
                   "source_ref": "HEAD", "timeout_seconds": "3600", "notify": "attention",
                   "concurrency_policy": "skip_if_active", "catch_up_policy": "enqueue_missed_with_cap",
                   "catch_up_max": "1"}
    return {
        "schedules list": web.page("/schedules"),
        "schedule detail": web.page(f"/schedules/{web.sid}"),
        "schedule edit": web.page(f"/schedules/{web.sid}/edit"),
        "review": web.page("/schedules/review", review_form),
        "review refused": web.page("/schedules/review", review_form | {"expression": XSS, "timezone": XSS,
                                                                       "workdir": "../" + XSS}),
        "runs": web.page("/runs"),
        "runs of the schedule": web.page(f"/runs?schedule_id={web.sid}"),
        "run detail": web.page(f"/runs/{web.rid}"),
        "dispatch run detail": web.page(f"/runs/{web.dispatch_rid}"),
        "attention": web.page("/attention"),
        "error page": web.page("/schedules/" + urllib.parse.quote(XSS_IMG, safe="")),   # 404 page echoes the id
        "office agents": web.page("/office/agents"),
        "office agent": web.page(f"/office/agents/{web.agent_id}"),
        "office board": web.page("/office/board"),
        "office task": web.page(f"/office/tasks/{web.task_id}"),
        "office wakeups": web.page("/office/wakeups"),
        "office routines": web.page("/office/routines"),
        "office routine": web.page(f"/office/routines/{web.routine_id}"),
    }


#: Pages that must show the markup (escaped): a test that never rendered it would prove nothing.
SHOWN = {"schedules list", "schedule detail", "schedule edit", "review", "runs", "runs of the schedule", "run detail",
         "attention", "office agents", "office agent", "office board", "office task", "office wakeups",
         "office routines", "office routine"}


def test_markup_in_names_and_briefs_renders_escaped_on_every_page(web):
    escaped = {html.escape(XSS_SCRIPT, quote=False), html.escape(XSS_SCRIPT)}
    wrong = []
    for name, reply in pages(web).items():
        if reply.status >= 500 or "text/html" not in reply.headers.get("Content-Type", ""):
            wrong.append(f"{name}: {reply.status} {reply.headers.get('Content-Type')}")
            continue
        for raw in (XSS_SCRIPT, "<img src=x", "onerror=alert(1)>"):
            if raw in reply.text and not (raw == "onerror=alert(1)>" and "onerror=alert(1)&gt;" in reply.text):
                wrong.append(f"{name}: raw {raw!r} in the page")
        if name in SHOWN and not any(e in reply.text for e in escaped):
            wrong.append(f"{name}: the name/brief is not shown at all (status {reply.status})")
    assert not wrong, "\n".join(wrong)


###############################################################################
# Content-Security-Policy with frame-ancestors 'none' on every page and API response.
###############################################################################

def test_csp_with_frame_ancestors_none_on_every_page_and_api_response(web):
    missing = []
    for rule, methods, path in rule_paths(web):
        if "GET" not in methods or rule == "/v1/outpost/events/stream":   # the stream: the real-server test
            continue
        for label, reply in [("bearer", web.request("GET", path, bearer=True)),
                             ("session", web.request("GET", path, cookie=True, headers={"Accept": "text/html"})),
                             ("anonymous", web.request("GET", path))]:
            if not csp_ok(reply.headers):
                missing.append(f"GET {rule} ({label}): {reply.status}")
    extra = {
        "403 forbidden_host": web.request("GET", "/healthz", headers={"Host": "evil.example"}),
        "404": web.request("GET", "/v1/outpost/nope", bearer=True),
        "405": web.request("PUT", "/healthz", bearer=True),
        "413": web.api("POST", "/v1/outpost/dispatches", {"brief": "x" * (outpost.MAX_BODY_BYTES + 1)}),
        "422": web.api("POST", "/v1/outpost/schedules/compose", {"name": ""}),
        "428": web.request("POST", "/v1/outpost/dispatches", data=b"{}", bearer=True),
        "403 cross-site": web.request("POST", "/attention/ack-all", cookie=True, headers=CROSS_SITE["both"]),
        "compose 200": web.api("POST", "/v1/outpost/schedules/compose", {
            "name": "csp", "brief": "x", "repository": str(web.repo), "timing": YEARLY}),
        "html 404": web.page("/schedules/nope"),
        "signin 401": web.request("POST", "/signin", data=b"token=wrong", headers={
            "Content-Type": "application/x-www-form-urlencoded"}),
    }
    missing += [f"{label}: {reply.status}" for label, reply in extra.items() if not csp_ok(reply.headers)]
    assert not missing, "no Content-Security-Policy with frame-ancestors 'none' on:\n" + "\n".join(missing)


###############################################################################
# The real server: an agent that dumps its environment, and a sentinel secret.
###############################################################################

SECRET_NAMES = ("OUTPOST_API_TOKEN", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "WATCHDOG_EXTRA")
ENV_PROFILE = """
[agents.envdump]
command = ["sh", "-c", "env; echo envdump-done"]
pass_env = ["PATH", "HOME", "HOSTILE_MARK", "OUTPOST_API_TOKEN", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
            "WATCHDOG_EXTRA"]

[agents.envdump.env]
HARMLESS = "visible"
OUTPOST_API_TOKEN = "from-the-profile"
NOTIFY_SOCKET = "/from/the/profile"
WATCHDOG_USEC = "1"
WATCHDOG_FROM_PROFILE = "1"

[agents.tokenarg]
command = ["sh", "-c", "echo argv: \\"$0\\" \\"$@\\"; env", "{run_id}", "{model}"]
pass_env = ["PATH"]
"""


@dataclass
class Live:
    server: Server
    sentinel: str
    repo: Path
    cookie: str = ""
    run_ids: list[str] = field(default_factory=list)
    responses: list[tuple[str, httpx.Response]] = field(default_factory=list)

    def client(self, **kw) -> httpx.Client:
        client = self.server.client()
        client.timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
        for k, v in kw.items():
            setattr(client, k, v)
        return client

    def keep(self, label: str, response: httpx.Response) -> httpx.Response:
        self.responses.append((label, response))
        return response


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One real daemon whose API token is a sentinel, with systemd-like secrets in its environment;
    the fixture drives it through a day's worth of traffic and keeps every response."""
    base = tmp_path_factory.mktemp("hostile-live")
    sentinel = "SENTINEL" + secrets.token_hex(16)
    sock_dir = tempfile.mkdtemp(prefix="opn", dir="/tmp")   # AF_UNIX paths are short
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(os.path.join(sock_dir, "n"))
    data = base / "data"
    data.mkdir()
    (data / "outpost.toml").write_text(ENV_PROFILE)
    env = {"OUTPOST_API_TOKEN": sentinel, "NOTIFY_SOCKET": os.path.join(sock_dir, "n"), "WATCHDOG_USEC": "600000000",
           "WATCHDOG_EXTRA": "systemd-only", "HOSTILE_MARK": "passed-through"}
    server = Server(data, ("--verbose",), env).start()
    state = Live(server, sentinel, make_repo(base / "repo"))
    try:
        drive(state)
        yield state
    finally:
        if server.proc.poll() is None:
            server.stop()
        notify.close()
        os.unlink(os.path.join(sock_dir, "n"))
        os.rmdir(sock_dir)


def drive(live: Live) -> None:
    """Traffic that exercises every surface the sentinel could leak through."""
    keep = live.keep
    key = lambda: {"Idempotency-Key": uuid.uuid4().hex}  # noqa: E731
    with live.client() as c:
        run_ids = []
        for agent, brief in [("envdump", "dump the environment"), ("tokenarg", "argv"),
                             ("demo", "@print hello\n@commit notes.txt hi"), ("demo", "@fail boom")]:
            raw = {"name": f"{agent}-{uuid.uuid4().hex[:6]}", "brief": brief, "repository": str(live.repo),
                   "agent": agent, "timing": YEARLY}
            composed = keep("compose", c.post("/v1/outpost/schedules/compose", json=raw)).json()
            created = keep("create", c.post("/v1/outpost/schedules", headers=key(), json={
                "definition": composed["definition"], "confirmation": composed["confirmation"]}))
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            fired = keep("fire", c.post(f"/v1/outpost/schedules/{sid}/control", json={"action": "fire"},
                                        headers={**key(), "If-Match": created.headers["ETag"]}))
            run_ids.append(fired.json()["run_id"])
        dispatched = keep("dispatch", c.post("/v1/outpost/dispatches", headers=key(), json={
            "brief": "@print dispatched", "repository": str(live.repo)}))
        run_ids.append(dispatched.json()["run_id"])
        for rid in run_ids:
            wait_for(lambda rid=rid: c.get(f"/v1/outpost/runs/{rid}").json()["status"] in SETTLED, 30)
        live.run_ids = run_ids
        keep("adopt", c.post(f"/v1/outpost/runs/{run_ids[-1]}/adopt", headers=key(), json={"workspace": "ws"}))
        keep("cancel settled", c.post(f"/v1/outpost/runs/{run_ids[-1]}/control", headers=key(),
                                      json={"action": "cancel"}))
        for item in c.get("/v1/outpost/attention").json()["attention"][:1]:
            keep("ack", c.post(f"/v1/outpost/attention/{item['id']}/ack", headers=key()))
    # Refusals that hold (part of) the secret in the request.
    base = live.server.url
    for label, headers in [("near-token", {"Authorization": f"Bearer {live.sentinel}x"}),
                           ("token prefix", {"Authorization": f"Bearer {live.sentinel[:-1]}"}),
                           ("basic", {"Authorization": f"Basic {live.sentinel}"}),
                           ("raw", {"Authorization": live.sentinel}),
                           ("foreign host", {"Authorization": f"Bearer {live.sentinel}", "Host": "evil.example"})]:
        keep(label, httpx.get(f"{base}/v1/outpost/schedules", headers=headers, timeout=REQUEST_TIMEOUT_S))
    with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S) as browser:
        keep("signin refused", browser.post("/signin", data={"token": live.sentinel + "x"}))
        keep("signin page", browser.get("/signin?next=/runs"))
        signed_in = keep("signin", browser.post("/signin", data={"token": live.sentinel}))
        assert signed_in.status_code == 303, signed_in.text   # POST/redirect/GET
        live.cookie = signed_in.cookies[outpost.SESSION_COOKIE]
        keep("signin link", browser.get(live.server.signin_link.replace(live.server.url, "")))


def every_get(live: Live) -> list[tuple[str, httpx.Response]]:
    """Every API resource and every dashboard page of the daemon, as the API and as a browser."""
    got = []
    with live.client() as api, httpx.Client(base_url=live.server.url, timeout=REQUEST_TIMEOUT_S,
                                            cookies={outpost.SESSION_COOKIE: live.cookie},
                                            headers={"Accept": "text/html"}) as browser:
        schedules = api.get("/v1/outpost/schedules?include_archived=true").json()["schedules"]
        paths = ["/healthz", "/v1/outpost/schedules", "/v1/outpost/runs?limit=500", "/v1/outpost/attention?state=all",
                 "/v1/outpost/events?after=0&limit=1000", "/v1/outpost/snapshot"]
        for s in schedules:
            paths += [f"/v1/outpost/schedules/{s['id']}", f"/v1/outpost/schedules/{s['id']}/occurrences",
                      f"/v1/outpost/schedules/{s['id']}/inspect"]
        for rid in live.run_ids:
            paths += [f"/v1/outpost/runs/{rid}", f"/v1/outpost/runs/{rid}/log"]
        got += [(f"API {p}", api.get(p)) for p in paths]
        pages = ["/", "/schedules", "/schedules?archived=1", "/schedules/new", "/runs", "/attention", "/signin",
                 "/static/outpost.js", "/no/such/page"]
        pages += [f"/schedules/{s['id']}" for s in schedules] + [f"/schedules/{s['id']}/edit" for s in schedules]
        pages += [f"/runs/{rid}" for rid in live.run_ids]
        got += [(f"page {p}", browser.get(p)) for p in pages]
        with api.stream("GET", "/v1/outpost/events/stream?after=0", timeout=5) as stream:
            text = ""
            for chunk in stream.iter_text():
                text += chunk
                if text.count("\n\n") > 3:
                    break
            got.append(("event stream", httpx.Response(stream.status_code, headers=stream.headers, text=text)))
    return got


def test_agent_that_runs_env_sees_no_token_socket_or_watchdog(live):
    envdump = live.run_ids[0]
    with live.client() as c:
        run = c.get(f"/v1/outpost/runs/{envdump}").json()
        log = c.get(f"/v1/outpost/runs/{envdump}/log").text
    assert run["status"] == "succeeded", run
    assert "envdump-done" in log, log
    names = {line.split("=", 1)[0] for line in log.splitlines() if "=" in line}
    assert "HARMLESS" in names and "HOSTILE_MARK" in names and "OUTPOST_RUN_ID" in names, sorted(names)
    leaked = sorted(n for n in names if n in SECRET_NAMES or n.startswith("WATCHDOG_") or n == "NOTIFY_SOCKET")
    assert leaked == [], f"the agent's environment holds {leaked}"
    assert live.sentinel not in log and "from-the-profile" not in log and "systemd-only" not in log
    assert "/from/the/profile" not in log
    assert (live.server.data_dir / "runs" / f"{envdump}.log").read_text() == log


def test_command_placeholders_never_carry_the_token(live):
    with live.client() as c:
        log = c.get(f"/v1/outpost/runs/{live.run_ids[1]}/log").text
    assert "argv:" in log and live.run_ids[1] in log, log
    assert live.sentinel not in log


def test_real_server_responses_carry_csp_frame_ancestors_none(live):
    collected = live.responses + every_get(live)
    missing = [f"{label}: {r.status_code}" for label, r in collected if not csp_ok(r.headers)]
    assert not missing, "no Content-Security-Policy with frame-ancestors 'none' on:\n" + "\n".join(missing)


def test_sentinel_secret_never_appears_in_logs_responses_pages_or_run_logs(live):
    """Runs last in the module: it stops the daemon to read the complete log."""
    collected = live.responses + every_get(live)
    assert any(label.startswith("page /runs/") and r.status_code == 200 for label, r in collected)
    leaks = []
    for label, response in collected:
        headers = "\n".join(f"{k}: {v}" for k, v in response.headers.items())
        if live.sentinel in response.text or live.sentinel in headers:
            leaks.append(f"response of {label} ({response.status_code})")
    for log in sorted((live.server.data_dir / "runs").glob("*.log")):
        if live.sentinel in log.read_text(errors="replace"):
            leaks.append(f"run log {log.name}")
    assert live.server.stop() == 0
    stdout_rest = live.server.proc.stdout.read()
    if live.sentinel in live.server.logs() or live.sentinel in stdout_rest or live.sentinel in live.server.signin_link:
        leaks.append("the daemon's log output (stderr/stdout)")
    for path in live.server.data_dir.rglob("*"):
        if path.is_file() and path.name != "outpost.toml" and live.sentinel.encode() in path.read_bytes():
            leaks.append(f"data dir file {path.relative_to(live.server.data_dir)}")
    assert not leaks, "the sentinel API token leaked into:\n" + "\n".join(leaks)
    assert "sign-in refused" in live.server.logs()   # the refusals really happened and were logged

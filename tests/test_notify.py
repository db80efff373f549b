"""Notifications (docs/operations.md): ``[[notify]]`` entries deliver attention items through Apprise
from a durable outbox, to REAL receivers started here: an HTTP server taking ``json://`` posts
and an SMTP server (aiosmtpd) taking ``mailto://`` mail with a login."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import trio
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult
from conftest import OUTPOST_PY, SETTLED, T0, call, make_repo, new_store, wait_for

import outpost

SMTP_PASSWORD = "s3cret-pw"


class HttpReceiver:
    """``json://`` posts on 127.0.0.1: each body by its path. ``down()`` makes the port refuse
    connections (bound, not listening) until ``up()`` serves on that same port."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []
        self.refuser = socket.socket()
        self.refuser.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.refuser.bind(("127.0.0.1", 0))
        self.port = self.refuser.getsockname()[1]
        self.server: ThreadingHTTPServer | None = None

    def up(self) -> HttpReceiver:
        self.refuser.close()
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                posts.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def url(self, path: str) -> str:
        return f"json://127.0.0.1:{self.port}/{path}"

    def at(self, path: str) -> list[dict]:
        return [body for p, body in self.posts if p == f"/{path}"]

    def close(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()
        self.refuser.close()


class SmtpReceiver:
    """A plain SMTP server on 127.0.0.1 (no TLS) that wants the login user / SMTP_PASSWORD."""

    def __init__(self) -> None:
        self.mails: list = []
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        mails = self.mails

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                mails.append(envelope)
                return "250 OK"

        def login(server, session, envelope, mechanism, data):
            return AuthResult(success=(data.login, data.password) == (b"user", SMTP_PASSWORD.encode()))

        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port, authenticator=login,
                                     auth_require_tls=False)
        self.controller.start()

    def url(self) -> str:
        # Apprise's custom-server mail URL: mailto:// is plain SMTP (mailtos:// is TLS), the
        # host:port is the server, from= and to= the envelope (apprise/plugins/email/base.py).
        return (f"mailto://user:{SMTP_PASSWORD}@127.0.0.1:{self.port}"
                "?from=outpost@example.com&to=me@example.com")

    def subjects(self) -> list[str]:
        return [m.original_content.decode().split("Subject: ", 1)[1].split("\r\n", 1)[0] for m in self.mails]

    def close(self) -> None:
        self.controller.stop()


@pytest.fixture
def http_receiver():
    receiver = HttpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def smtp_receiver():
    receiver = SmtpReceiver()
    yield receiver
    receiver.close()


def toml_entries(*entries: dict) -> str:
    lines = []
    for entry in entries:
        lines.append("[[notify]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def entries_of(tmp_path: Path, *entries: dict) -> tuple[outpost.NotifyEntry, ...]:
    data = tmp_path / "cfg"
    data.mkdir(exist_ok=True)
    (data / "outpost.toml").write_text(toml_entries(*entries))
    return outpost.load_config(data).notify


# --- end to end: a real daemon, real receivers ---------------------------------------------------

def test_a_needs_you_run_reaches_each_entry_once_across_a_restart(tmp_path, server_factory, http_receiver,
                                                                   smtp_receiver):
    http_receiver.up()
    data = tmp_path / "data"
    data.mkdir()
    in_three_hours = datetime.now(timezone.utc) + timedelta(hours=3)
    (data / "outpost.toml").write_text(toml_entries(
        # a digest due in 3 h: its last one was 21 h ago, too late to send now (any time of day the test runs)
        {"url": http_receiver.url("hook")}, {"url": smtp_receiver.url(), "digest": f"{in_three_hours:%H}:00 UTC"},
        {"url": http_receiver.url("failures"), "kinds": ["failed"]}))
    repo = make_repo(tmp_path / "repo")
    server = server_factory(data_dir=data)
    with server.client() as client:
        run = client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": "k1"},
                          json={"brief": "@needs-you Which branch should I rebase onto?", "repository": str(repo),
                                "agent": "demo"}).json()
        wait_for(lambda: client.get(f"/v1/outpost/runs/{run['run_id']}").json()["status"] in SETTLED)
        wait_for(lambda: http_receiver.at("hook") and smtp_receiver.mails)
        (post,) = http_receiver.at("hook")
        assert post["title"].endswith("needs you") and "Which branch should I rebase onto?" in post["message"]
        assert f"/runs/{run['run_id']}" in post["message"]
        assert smtp_receiver.subjects() == [post["title"]]
        assert http_receiver.at("failures") == []   # kinds = ["failed"]: a question is not for it
        def delivered() -> list[bool]:   # a message is marked delivered just after its receiver took it
            listed = client.get("/v1/outpost/notify")
            assert listed.status_code == 200, listed.text
            return [e["last_delivered_at"] is not None for e in listed.json()["entries"]]
        wait_for(lambda: delivered() == [True, True, False])
        entries = client.get("/v1/outpost/notify").json()["entries"]
        assert SMTP_PASSWORD not in json.dumps(entries) and "user:****@" in entries[1]["url"]
    assert server.stop() == 0

    server = server_factory(data_dir=data)   # a restart: nothing is sent again
    with server.client() as client:
        queued = client.post("/v1/outpost/notify/test", headers={"Idempotency-Key": "t1"}, json={})
        assert queued.status_code == 202, queued.text
        assert [q["entry"] for q in queued.json()["queued"]] == [0, 1, 2]
        # the outbox sends in order: had the item been due again, it would have gone first
        wait_for(lambda: len(http_receiver.at("hook")) == 2 and len(smtp_receiver.mails) == 2
                 and http_receiver.at("failures"))
        assert [p["title"] for p in http_receiver.at("hook")] == [post["title"], "Outpost test notification"]
        assert smtp_receiver.subjects() == [post["title"], "Outpost test notification"]
        one = client.post("/v1/outpost/notify/test", headers={"Idempotency-Key": "t2"}, json={"entry": 7})
        assert one.status_code == 422 and one.json()["errors"][0]["field"] == "entry"
    assert server.stop() == 0
    assert SMTP_PASSWORD not in server.logs()


def test_settings_lists_each_entry_and_its_send_test_button_delivers(tmp_path, server_factory, http_receiver):
    http_receiver.up()
    data = tmp_path / "data"
    data.mkdir()
    (data / "outpost.toml").write_text(toml_entries({"url": http_receiver.url("hook") + "?token=abc"}))
    server = server_factory(data_dir=data)
    with httpx.Client(base_url=server.url, follow_redirects=True, timeout=30) as browser:
        browser.get(server.signin_link)
        page = browser.get("/settings")
        assert page.status_code == 200 and 'href="/settings"' in page.text
        # the webhook's path may be its secret: masked like the token
        assert f"json://127.0.0.1:{http_receiver.port}/****" in page.text and "/hook" not in page.text
        assert "never" in page.text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)[1]
        assert browser.post("/settings/notify/test", data={"entry": "0"}).status_code == 403   # no CSRF token
        sent = browser.post("/settings/notify/test", data={"entry": "0", "csrf": csrf})
        assert sent.status_code == 200 and "Test message queued" in sent.text
        wait_for(lambda: http_receiver.at("hook"))
        assert "never" not in browser.get("/settings").text
    assert [p["title"] for p in http_receiver.at("hook")] == ["Outpost test notification"]


@pytest.mark.parametrize(("entry", "words"), [
    ({"url": "bogus://user:hunter2@example.com/x"}, "notify[0].url is not a URL Apprise can send to"),
    ({"url": "json://example.com/x", "kinds": ["needs_you", "nope"]}, "notify[0].kinds names 'nope'"),
    ({"url": "json://example.com/x", "digest": "8 am"}, "notify[0].digest must be a time of day"),
    ({"url": "json://example.com/x", "digest": "08:00 Mars/Olympus"}, "notify[0].digest must be an IANA"),
    ({"url": "json://example.com/x", "to": "me"}, "notify[0].to is not a setting"),
])
def test_a_bad_notify_entry_stops_serve_with_one_line(tmp_path, entry, words):
    data = tmp_path / "data"
    data.mkdir()
    (data / "outpost.toml").write_text(toml_entries(entry))
    done = subprocess.run([sys.executable, str(OUTPOST_PY), "serve", "--data-dir", str(data), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert words in line and "hunter2" not in line, line


# --- the outbox actor under MockClock: retries, restarts, giving up ------------------------------

def actor_deps(tmp_path: Path, store: outpost.Store, entries, clock: outpost.Clock) -> outpost.Deps:
    store.notify.configure(entries)
    config = outpost.Config(data_dir=tmp_path, agents=(outpost.demo_profile(),), notify=entries)
    return outpost.Deps(config=config, store=store, clock=clock, token="t", inline_db=True,
                        api_url="http://127.0.0.1:8321")


def raise_needs_you(store: outpost.Store, now) -> None:
    call(store, store.raise_attention, "needs_you", "Run of 'nightly' needs you", "Merge it?", now,
         schedule_id=None, run_id="run_1")


def rows(store: outpost.Store) -> list[dict]:
    return call(store, store.notify.notifications)


async def until_real(predicate, timeout_s: float = 30):
    """Wait for ``predicate()`` in a thread: no trio deadline while a send's thread runs, so
    MockClock jumps only to the actor's own next retry (a thread's wait is idle to it)."""
    return await trio.to_thread.run_sync(lambda: wait_for(predicate, timeout_s))


def sqlite_store(tmp_path: Path) -> outpost.Store:
    return outpost.Store(tmp_path / "outpost.sqlite3")


async def test_a_receiver_that_is_down_gets_the_item_once_late_across_a_restart(tmp_path, autojump_clock,
                                                                                http_receiver):
    autojump_clock.autojump_threshold = math.inf   # time moves here only when the test says
    entries = entries_of(tmp_path, {"url": http_receiver.url("hook")})
    store, watcher = sqlite_store(tmp_path), sqlite_store(tmp_path)   # the watcher reads from the test's thread
    clock = outpost.TrioClock(T0)
    raise_needs_you(actor_deps(tmp_path, store, entries, clock).store, T0)
    async with trio.open_nursery() as nursery:
        deps = actor_deps(tmp_path, store, entries, clock)
        nursery.start_soon(outpost.outbox_actor, deps)
        (failed,) = await until_real(lambda: [r for r in rows(watcher) if r["last_error"]])
        assert failed["status"] == "queued" and failed["attempts"] == 1 and http_receiver.posts == []
        assert outpost.parse_instant(failed["next_at"]) == T0 + timedelta(seconds=60)
        nursery.cancel_scope.cancel()   # the daemon stops while the receiver is down
    store.close()

    store = sqlite_store(tmp_path)   # ... and starts again: the row is the truth
    http_receiver.up()
    async with trio.open_nursery() as nursery:
        deps = actor_deps(tmp_path, store, entries, clock)
        nursery.start_soon(outpost.outbox_actor, deps)
        await trio.sleep(0)
        assert http_receiver.posts == [] and rows(watcher)[0]["status"] == "queued"   # not before its retry
        autojump_clock.jump(60)
        await until_real(lambda: rows(watcher)[0]["status"] == "delivered")
        for _ in range(5):   # hours pass: nothing is sent again
            autojump_clock.jump(3600)
            await trio.sleep(0)
        nursery.cancel_scope.cancel()
    (post,) = http_receiver.at("hook")
    assert post["title"] == "Run of 'nightly' needs you" and "http://127.0.0.1:8321/runs/run_1" in post["message"]
    (row,) = rows(store)
    assert row["status"] == "delivered" and row["attempts"] == 2
    assert outpost.parse_instant(row["delivered_at"]) == T0 + timedelta(seconds=60)   # late: at its retry
    store.close()
    watcher.close()


async def test_a_receiver_down_for_a_day_is_retried_with_backoff_then_given_up(tmp_path, autojump_clock,
                                                                               http_receiver):
    entries = entries_of(tmp_path, {"url": http_receiver.url("hook")})
    store, watcher = sqlite_store(tmp_path), sqlite_store(tmp_path)
    deps = actor_deps(tmp_path, store, entries, outpost.TrioClock(T0))
    raise_needs_you(store, T0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.outbox_actor, deps)
        await until_real(lambda: rows(watcher)[0]["status"] == "given_up")
        nursery.cancel_scope.cancel()
    (row,) = rows(store)
    # after 1, 2, 4, 8, 16, 32 min, then hourly: the 30th attempt, 24 h 3 min in, fails past the day
    assert row["attempts"] == 30 and "Connection error" in row["last_error"]
    assert outpost.parse_instant(row["last_attempt_at"]) == T0 + timedelta(days=1, minutes=3)
    assert call(store, store.notify.entry_states)[0]["given_up"] == 1
    store.close()
    watcher.close()


# --- the outbox in the store ---------------------------------------------------------------------

def test_an_item_is_queued_with_it_for_each_entry_that_wants_its_kind(tmp_path):
    entries = entries_of(tmp_path, {"url": "json://127.0.0.1:9/all"},
                         {"url": "json://127.0.0.1:9/failures", "kinds": ["failed"]})
    store = new_store(tmp_path)
    store.notify.configure(entries)
    raise_needs_you(store, T0)
    call(store, store.raise_attention, "failed", "Run failed", None, T0, schedule_id=None, run_id=None)
    call(store, store.raise_attention, "succeeded", "Run succeeded", None, T0, schedule_id=None, run_id=None)
    assert sorted((r["entry"], r["kind"]) for r in rows(store)) == [(0, "failed"), (0, "needs_you"), (1, "failed")]
    with pytest.raises(ValueError):   # rolled back with the item: no row without its item, nor the reverse
        def raise_then_fail():
            store.raise_attention("failed", "x", None, T0, schedule_id=None, run_id=None)
            raise ValueError("the transaction fails")
        store.transaction(raise_then_fail)
    assert len(rows(store)) == 3
    store.close()


def test_backoff_doubles_from_a_minute_to_an_hour():
    assert [outpost.notify_backoff_s(n) for n in (1, 2, 3, 6, 7, 8, 50)] == [60, 120, 240, 1920, 3600, 3600, 3600]


def test_a_digest_is_queued_once_a_day_with_runs_and_open_items(tmp_path):
    (entry,) = entries_of(tmp_path, {"url": "json://127.0.0.1:9/d", "digest": "08:00 Europe/Berlin"})
    now = T0.replace(hour=12)   # 13:00 in Berlin: today's 08:00 (07:00 UTC) was due
    due = entry.digest_due(now)
    assert due == T0.replace(hour=7) and entry.digest_due(due - timedelta(seconds=1)) == due - timedelta(days=1)
    store = new_store(tmp_path)
    store.notify.configure((entry,))
    raise_needs_you(store, T0)
    assert call(store, store.notify.queue_digest, entry, due, now) is True
    assert call(store, store.notify.queue_digest, entry, due, now) is False
    digest = next(r for r in rows(store) if r["kind"] == "digest")
    assert digest["item"] == "digest:2026-11-30"
    text = call(store, lambda: store.db.Notification[digest["id"]].body)
    assert "Runs: 0" in text and "Open items: 1" in text and "needs you: Run of 'nightly' needs you" in text
    store.close()

"""Shared fixtures and helpers: a temp git repository, a temp store, definitions, Deps, the
in-process API client, the Office store helpers, and the real server.

Test modules import from here, never from each other."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import outpost  # noqa: E402

OUTPOST_PY = Path(outpost.__file__).resolve()
#: A fixed wall-clock origin for tests that drive time with MockClock.
T0 = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
MINUTE = 60
HOUR = 3600
#: The agent profiles of the Office tests (the demo agent only).
PROFILES = {"demo": outpost.demo_profile()}
#: The in-process app's API token (``make_deps``).
TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROBLEM = "application/problem+json"
RFC3339_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")
#: A timing that never fires by itself while a test runs: runs come from manual fires.
YEARLY = {"kind": "cron", "expression": "0 0 1 1 *", "timezone": "UTC"}
SETTLED = ("succeeded", "failed", "needs_you", "cancelled")
#: Marker for ``Api.request``: send a fresh Idempotency-Key.
FRESH = object()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def make_repo(path: Path, symlinks: dict[str, Path] | None = None) -> Path:
    """A real git repository at ``path``: one commit on ``main`` with ``README``, ``sub/keep``
    and the given symlinks (name -> target)."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README").write_text("hello\n")
    (path / "sub").mkdir()
    (path / "sub" / "keep").write_text("x\n")
    for name, target in (symlinks or {}).items():
        os.symlink(target, path / name)
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return path


@pytest.fixture
def git_repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


@dataclasses.dataclass
class Reply:
    """An HTTP answer reduced to what assertions look at (in-process or real server)."""
    status: int
    text: str
    mimetype: str
    headers: Any

    @property
    def body(self) -> Any:
        if self.mimetype in ("application/json", "application/problem+json"):
            return json.loads(self.text)
        return self.text


def definition(repo: Path | str, **overrides) -> dict:
    """A raw schedule definition on ``repo`` (demo agent, every 5 minutes, UTC)."""
    raw = {"name": "nightly", "brief": "@print hello", "repository": str(repo), "agent": "demo",
           "timing": {"kind": "cron", "expression": "*/5 * * * *", "timezone": "UTC"}}
    raw.update(overrides)
    return raw


#: A throwaway PostgreSQL cluster's admin URL (``.ci/run`` starts one). With
#: ``OUTPOST_TEST_STORE=postgres`` the store fixtures below use a fresh database of it per test.
POSTGRES_ADMIN = os.environ.get("OUTPOST_TEST_POSTGRES_URL")
ON_POSTGRES = os.environ.get("OUTPOST_TEST_STORE") == "postgres"
needs_postgres = pytest.mark.skipif(not POSTGRES_ADMIN, reason="no PostgreSQL: .ci/run starts one and sets "
                                                               "$OUTPOST_TEST_POSTGRES_URL")


#: The test databases made on the cluster, by the path a SQLite store would have: a test that
#: opens "the same file" again (a restart) gets the same database. Dropped at the session's end.
POSTGRES_DATABASES: dict[Path, str] = {}


def postgres_admin(sql: str) -> None:
    import psycopg2

    connection = psycopg2.connect(POSTGRES_ADMIN)
    connection.autocommit = True
    connection.cursor().execute(sql)
    connection.close()


def postgres_database(*, migrated: bool = False) -> str:
    """A new database on the test cluster: its URL. Empty, or ``migrated``: a copy of one that
    Outpost's migrations made once per session (a file copy, instead of every table anew)."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    template = f' TEMPLATE "{migrated_template()}"' if migrated else ""
    postgres_admin(f'CREATE DATABASE "{name}"{template}')
    return f"{POSTGRES_ADMIN.rsplit('/', 1)[0]}/{name}"


@functools.cache
def migrated_template() -> str:
    url = postgres_database()
    POSTGRES_DATABASES[Path("template")] = url
    outpost.Store(url).close()
    name = url.rsplit("/", 1)[1]
    postgres_admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
    return name


@pytest.fixture(scope="session", autouse=True)
def drop_postgres_databases():
    yield
    for url in POSTGRES_DATABASES.values():
        postgres_admin(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def new_store(tmp_path: Path, name: str = "outpost.sqlite3") -> outpost.Store:
    """A store of its own: SQLite in ``tmp_path``, or (OUTPOST_TEST_STORE=postgres) a
    PostgreSQL database for that path."""
    if ON_POSTGRES:
        url = POSTGRES_DATABASES.get(tmp_path / name) or POSTGRES_DATABASES.setdefault(
            tmp_path / name, postgres_database(migrated=True))
        return outpost.Store(url, data_dir=tmp_path)
    return outpost.Store(tmp_path / name)


@pytest.fixture
def store(tmp_path: Path):
    s = new_store(tmp_path)
    yield s
    s.close()


def normalized(repo: Path | str, now: datetime = T0, **overrides) -> dict:
    return outpost.normalize_definition(definition(repo, **overrides), now, agents=["demo"])


class SteppedClock(outpost.TrioClock):
    """Trio time plus steps of the wall clock (an NTP correction, a suspend)."""

    def __init__(self, origin):
        super().__init__(origin)
        self.offset = timedelta()

    def now(self):
        return super().now() + self.offset


class FixedClock(outpost.Clock):
    """Wall time that moves only when a test sets ``at``."""

    def __init__(self, at=T0):
        self.at = at

    def now(self):
        return self.at


def make_deps(tmp_path: Path, *, allowed_hosts: tuple[str, ...] = (), store: outpost.Store | None = None,
              clock: outpost.Clock | None = None, token: str = TOKEN,
              agents: tuple[outpost.AgentProfile, ...] = (outpost.demo_profile(),), **deps) -> outpost.Deps:
    """Deps on ``tmp_path`` with ``agents`` (the demo agent): by default a store of their own
    (``db.sqlite3``), a FixedClock at T0 and the API token ``TOKEN``; ``deps`` are more Deps fields."""
    config = outpost.Config(data_dir=tmp_path, agents=agents, allowed_hosts=allowed_hosts)
    return outpost.Deps(config=config, store=store if store is not None else new_store(tmp_path, "db.sqlite3"),
                        clock=clock if clock is not None else FixedClock(), token=token, **deps)


def mock_deps_at(tmp_path: Path, store: outpost.Store, origin: datetime = T0, *,
                 clock: outpost.Clock | None = None) -> outpost.Deps:
    """Deps for actor tests: MockClock time from ``origin`` (or the given clock), store calls
    inline (no worker thread).

    The demo agent's time limit is a day here, not 600 s: under autojump, mock time runs while a
    test polls for what a real agent process does, as fast as the loop spins, and on a loaded
    machine 600 mock seconds pass before a slow process start writes its first file."""
    demo = dataclasses.replace(outpost.demo_profile(), timeout_seconds=outpost.DAY_S)
    return make_deps(tmp_path, store=store, clock=clock if clock is not None else outpost.TrioClock(origin),
                     token="t", inline_db=True, agents=(demo,))


@pytest.fixture
async def mock_deps(tmp_path: Path, store, autojump_clock):
    """Deps for actor tests: MockClock time from T0, store calls inline (no worker thread).

    The test itself must also request ``autojump_clock``: pytest-trio installs the
    MockClock only for a clock fixture the test function names directly."""
    return mock_deps_at(tmp_path, store, T0)


class Server:
    """A real ``outpost serve`` process on 127.0.0.1 with its own data dir."""

    def __init__(self, data_dir: Path, extra_args: tuple[str, ...] = (), env: dict | None = None,
                 runner: tuple[str, ...] = ()):
        self.data_dir = data_dir
        self.extra_args = extra_args
        self.runner = runner   # e.g. setpriv ... --: serve as another user
        self.env = {k: v for k, v in os.environ.items() if k != "OUTPOST_API_TOKEN"} | (env or {})
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.token = ""
        self.signin_link = ""

    def start(self, timeout_s: float = 20) -> Server:
        self.log_path = self.data_dir.parent / f"serve-{time.time_ns()}.log"
        self.log_file = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*self.runner, sys.executable, str(OUTPOST_PY), "serve", "--data-dir", str(self.data_dir), "--port", "0",
             *self.extra_args], stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"outpost serve exited: {self.log_path.read_text()}")
            m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
            if m:
                self.url = f"http://127.0.0.1:{m[1]}"
                self.signin_link = self.proc.stdout.readline().split()[-1]   # printed right after
                break
        self.token = self.env.get("OUTPOST_API_TOKEN") or (self.data_dir / "api-token").read_text().strip()
        return self

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.log_file.close()

    def logs(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def server_factory(tmp_path: Path):
    servers: list[Server] = []

    def make(*extra_args: str, data_dir: Path | None = None, env: dict | None = None) -> Server:
        server = Server(data_dir or tmp_path / "data", extra_args, env)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        if server.proc and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def wait_for(predicate, timeout_s: float = 20, interval_s: float = 0.05):
    """Poll a real server until ``predicate()`` is truthy (end-to-end tests only)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


__all__ = ["T0", "Reply", "definition", "make_repo", "normalized", "git", "wait_for", "trio"]


def call(store: outpost.Store, fn, *args, **kwargs):
    """One store function in its own transaction (test set-up and assertions); its result."""
    return store.transaction(fn, *args, **kwargs)[0]


def instant(text: str | None) -> datetime | None:
    """An RFC 3339 instant of a view, as an aware datetime (None stays None)."""
    return outpost.parse_instant(text) if text else None


def sign_in_client(client, store: outpost.Store, now: datetime) -> str:
    """Give an in-process test client a signed-in dashboard session (created at ``now``): its CSRF token."""
    cookie, csrf = call(store, store.access.create_session, now)
    client.set_cookie("127.0.0.1", outpost.SESSION_COOKIE, cookie)
    return csrf


async def until(predicate, poll_s: float = 0.05):
    """Poll (in trio time, mock or real) until ``predicate()`` is truthy; returns its value."""
    while not (value := predicate()):
        await trio.sleep(poll_s)
    return value


# --- the HTTP API in process (Quart's test client) -------------------------------------------------------

class Api:
    """A test client plus the few habits every request of the contract shares."""

    def __init__(self, deps: outpost.Deps, repo: Path):
        self.deps = deps
        self.store = deps.store
        self.clock = deps.clock
        self.repo = repo
        self.client = outpost.create_app(deps).test_client()

    async def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                      headers: dict[str, str] | None = None, auth: bool = True, key: Any = FRESH,
                      if_match: Any = None) -> Reply:
        sent = dict(AUTH) if auth else {}
        if key is FRESH:
            key = uuid.uuid4().hex if method in ("POST", "PATCH") and not path.endswith("/compose") else None
        if key is not None:
            sent["Idempotency-Key"] = key
        if if_match is not None:
            sent["If-Match"] = str(if_match)
        sent.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            sent.setdefault("Content-Type", "application/json")
        response = await self.client.open(path, method=method, headers=sent, data=data)
        return Reply(response.status_code, await response.get_data(as_text=True), response.mimetype,
                     response.headers)

    async def get(self, path: str, **kw) -> Reply:
        return await self.request("GET", path, **kw)

    async def post(self, path: str, body: Any = None, **kw) -> Reply:
        return await self.request("POST", path, body, **kw)

    async def patch(self, path: str, body: Any = None, **kw) -> Reply:
        return await self.request("PATCH", path, body, **kw)

    async def delete(self, path: str, **kw) -> Reply:
        return await self.request("DELETE", path, **kw)

    # --- the usual conversations ----------------------------------------------------

    def raw(self, **overrides) -> dict:
        return definition(self.repo, **overrides)

    async def compose(self, raw: dict, query: str = "") -> Reply:
        return await self.post("/v1/outpost/schedules/compose" + query, raw)

    async def create(self, raw: dict | None = None, **kw) -> Reply:
        composed = await self.compose(raw or self.raw())
        assert composed.status == 200, composed.body
        return await self.post("/v1/outpost/schedules", {"definition": composed.body["definition"],
                                                         "confirmation": composed.body["confirmation"]}, **kw)

    async def schedule(self, **overrides) -> dict:
        created = await self.create(self.raw(**overrides))
        assert created.status == 201, created.body
        return created.body

    async def control(self, sid: str, action: str, revision: Any, **kw) -> Reply:
        return await self.post(f"/v1/outpost/schedules/{sid}/control", {"action": action}, if_match=revision, **kw)

    async def revision(self, sid: str) -> int:
        return (await self.get(f"/v1/outpost/schedules/{sid}")).body["revision"]

    async def fire(self, sid: str) -> dict:
        fired = await self.control(sid, "fire", await self.revision(sid))
        assert fired.status == 200, fired.body
        return fired.body

    async def edit(self, sid: str, changes: dict, revision: Any, **kw) -> Reply:
        composed = await self.compose({"schedule_id": sid, **changes})
        assert composed.status == 200, composed.body
        return await self.patch(f"/v1/outpost/schedules/{sid}",
                                {"changes": changes, "confirmation": composed.body["confirmation"]},
                                if_match=revision, **kw)

    async def settle(self, run_id: str, status: outpost.RunStatus, **kw) -> None:
        """What the claim and notification actors would record for a finished run."""
        await self.deps.transaction(self.store.runs.settle_run, run_id, *ended_with(status, kw, self.clock.now()),
                                    self.clock.now(), **kw)
        await self.deps.transaction(self.store.schedules.notify_run, run_id, self.clock.now())

    async def auto_paused(self) -> dict:
        """A schedule whose three manual runs failed: auto-paused (docs/schedules.md)."""
        sched = await self.schedule()
        for _ in range(outpost.AUTO_PAUSE_STREAK):
            self.clock.at += timedelta(minutes=1)   # one manual fire per instant
            fired = await self.fire(sched["id"])
            assert fired["outcome"] == "admitted"
            await self.settle(fired["run_id"], outpost.RunStatus.FAILED, exit_code=1, error="boom")
        return (await self.get(f"/v1/outpost/schedules/{sched['id']}")).body


class OfficeApi(Api):
    """The in-process client, with no Idempotency-Key unless a test sends one (it is optional
    on /api/), and the few conversations the Office tests share."""

    async def request(self, method: str, path: str, body: Any = None, **kw):
        kw.setdefault("key", None)
        return await super().request(method, path, body, **kw)

    async def as_run(self, token: str, method: str, path: str, body: Any = None):
        """A call of an agent with its run token (never the API token)."""
        return await self.request(method, path, body, auth=False, headers={"Authorization": f"Bearer {token}"})

    async def agent(self, name: str = "worker", **fields) -> dict:
        reply = await self.post("/api/office/agents", {"name": name, "executor": "demo", "cooldown_sec": 0, **fields})
        assert reply.status == 201, reply.body
        return reply.body

    async def task(self, title: str = "a task", **fields) -> dict:
        reply = await self.post("/api/office/tasks", {"title": title, **fields})
        assert reply.status == 201, reply.body
        return reply.body

    async def workspace(self, name: str, repository: Path | None = None) -> dict:
        reply = await self.post("/api/office/workspaces", {"name": name})
        assert reply.status == 201, reply.body
        if repository is not None:
            patched = await self.patch(f"/api/office/settings?workspace_id={reply.body['id']}",
                                       {"repository": str(repository)})
            assert patched.status == 200, patched.body
        return reply.body

    async def wakeups(self, query: str = "") -> list[dict]:
        reply = await self.get("/api/office/wakeups" + query)
        assert reply.status == 200, reply.body
        return reply.body["wakeups"]

    def dispatch(self) -> list[str]:
        """One pass of the dispatcher: the runs it queued."""
        (queued, _processed), _ = self.store.transaction(self.store.pipeline.dispatch_wakeups, self.clock.now(),
                                                         self.deps.profiles)
        return queued

    def admit_all(self) -> list[str]:
        started = []
        while (admitted := self.store.transaction(self.store.runs.admit_next, 100, self.clock.now())[0]) is not None:
            started.append(admitted[0])
        return started

    def settle(self, run_id: str, status=outpost.RunStatus.SUCCEEDED, **kw) -> None:
        self.store.transaction(self.store.runs.settle_run, run_id, *ended_with(status, kw, self.clock.now()),
                               self.clock.now(), **kw)

    def token(self, run_id: str) -> str:
        return outpost.run_token(self.deps.run_token_key, run_id)

    async def running(self, agent: dict | None = None, **task_fields) -> tuple[dict, dict, str, str]:
        """An agent with a task whose Office run is ``running``: (agent, task, run id, run token)."""
        agent = agent or await self.agent(f"runner-{uuid.uuid4().hex[:6]}")
        task = await self.task(assignee_agent_id=agent["id"], **task_fields)
        queued = self.dispatch()
        assert len(queued) == 1, queued
        assert self.admit_all() == queued
        assert (await self.get(f"/v1/outpost/runs/{queued[0]}")).body["status"] == "running"
        return agent, task, queued[0], self.token(queued[0])


def assert_problem(reply: Reply, status: int, code: str, field: str | None = None) -> None:
    assert reply.status == status, reply.body
    assert reply.mimetype == PROBLEM, reply.mimetype
    assert reply.body["status"] == status
    assert reply.body["code"] == code, reply.body
    assert reply.body["title"] and isinstance(reply.body["detail"], str)
    if field is not None:
        assert reply.body["errors"][0]["field"] == field, reply.body
        assert reply.body["errors"][0]["message"]


# --- Office in the store (one transaction per call, explicit ``now``) ---------------------------------------

def at(seconds: float = 0, base: datetime = T0) -> datetime:
    return base + timedelta(seconds=seconds)


def set_settings(store: outpost.Store, workspace_id: str | None = None, **raw) -> dict:
    current = call(store, store.office.office_settings, workspace_id)
    return call(store, store.office.update_office_settings, workspace_id,
                outpost.normalize_settings(raw, profiles=list(PROFILES), current=current))


def new_agent(store: outpost.Store, name: str, now: datetime = T0, workspace_id: str | None = None,
              profiles=("demo",), **fields) -> str:
    raw = {"name": name, "executor": "demo", **fields}
    if raw["executor"] is None:
        del raw["executor"]
    return call(store, store.office.create_agent, workspace_id, outpost.normalize_agent(raw, profiles=profiles),
                now)["id"]


def new_task(store: outpost.Store, title: str = "task", now: datetime = T0, workspace_id: str | None = None,
             profiles=("demo",), **fields) -> str:
    fields = outpost.normalize_task({"title": title, **fields}, profiles=profiles)
    return call(store, store.office.create_task, workspace_id, fields, now)["id"]


def wakeups(store: outpost.Store, agent_id: str | None = None, *, source: str | None = None,
            status: str | None = None, workspace_id: str | None = None) -> list[dict]:
    """Wakeups oldest first."""
    rows = call(store, store.office.list_wakeups, workspace_id, agent_id, status, source, 10_000)
    return sorted(rows, key=lambda w: (w["requested_at"], w["id"]))


def wakeup(store: outpost.Store, wakeup_id: str, workspace_id: str | None = None) -> dict:
    (w,) = [w for w in wakeups(store, workspace_id=workspace_id) if w["id"] == wakeup_id]
    return w


def only(rows: list[dict]) -> dict:
    assert len(rows) == 1, rows
    return rows[0]


def dispatch(store: outpost.Store, now: datetime, profiles=None) -> list[str]:
    """The dispatcher at ``now`` as the claim actor runs it (batches until nothing more can
    be claimed): the runs it queued."""
    queued = []
    while True:
        runs, processed = call(store, store.pipeline.dispatch_wakeups, now, profiles or PROFILES)
        queued += runs
        if not processed:
            return queued


def start(store: outpost.Store, run_id: str, now: datetime) -> None:
    """Admit queued runs (FIFO) until ``run_id`` is running."""
    while True:
        admitted = call(store, store.runs.admit_next, 100, now)
        assert admitted is not None, f"run {run_id} was never admitted"
        if admitted[0] == run_id:
            return


def ended(status: outpost.RunStatus, error: str | None = None, result: dict | None = None,
          failure_kind: str | None = None, limit: outpost.Limit | None = None,
          now: datetime | None = None) -> outpost.Outcome:
    """How a run ended, as the run supervisor would have read it (a generic agent's result):
    at ``now``, a failure whose text names a login problem or a limit is one."""
    if failure_kind is None and status == outpost.RunStatus.FAILED:
        found = outpost.find_limit(error or "", now, ZoneInfo("UTC")) if now else None
        failure_kind = ("interrupted" if error == outpost.INTERRUPTED else
                        "auth" if outpost.is_auth_failure(error or "") else "limit" if found else "agent")
        limit = limit or found
    result = result or {}
    reading = outpost.Reading("generic", result=result or None, session_id=result.get("session_id"),
                              question=result.get("question"))
    return outpost.Outcome(status, error, failure_kind, limit, question=reading.question, reading=reading)


def ended_with(status: outpost.RunStatus, kw: dict, now: datetime | None = None) -> tuple[outpost.Outcome]:
    """``ended`` from the outcome keywords of ``kw`` (taken out of it)."""
    fields = {k: kw.pop(k) for k in ("error", "result", "failure_kind", "limit") if k in kw}
    return (ended(status, **fields, now=now),)


def settle(store: outpost.Store, run_id: str, status: str, now: datetime, **kw) -> None:
    """Admit (FIFO) until ``run_id`` runs, then settle it as the run supervisor would."""
    if call(store, store.runs.get_run, run_id)["status"] == "queued":
        start(store, run_id, now)
    assert call(store, store.runs.settle_run, run_id, *ended_with(outpost.RunStatus(status), kw, now), now, **kw)


def activity(store: outpost.Store, code: str, workspace_id: str | None = None) -> list[dict]:
    return call(store, store.office.list_activity, workspace_id, code, 1000)[::-1]


def office_run(store: outpost.Store, run_id: str) -> dict:
    return call(store, store.office.office_run, run_id)


def task(store: outpost.Store, task_id: str) -> dict:
    return call(store, store.office.get_task, task_id)


@pytest.fixture
def office(store: outpost.Store, tmp_path: Path) -> outpost.Store:
    """The store with the default workspace's repository set (Office runs need one). Nothing
    here launches a process, so the path need not be a git repository (the actor tests use one)."""
    set_settings(store, repository=str(tmp_path / "repo"))
    return store

"""Crash torture against the real server: kill -9 at random moments while requests flow, and
SIGTERM under load. Quick by default (3 kills, CI); the long run is

    OUTPOST_TORTURE_KILLS=20 .venv/bin/pytest tests/torture/test_crash.py
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import psycopg2
from conftest import POSTGRES_DATABASES, Server, definition, needs_postgres, postgres_database, wait_for

import outpost

KILLS = int(os.environ.get("OUTPOST_TORTURE_KILLS", "3"))
SEED = int(os.environ.get("OUTPOST_TORTURE_SEED", str(time.time_ns() % 10_000)))


def marker_profile(data_dir: Path, marker: Path, work_s: float) -> None:
    """An agent that appends its run id to ``marker`` when it starts: a run started twice shows twice."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "outpost.toml").write_text(
        "[agents.mark]\n"
        f'command = ["sh", "-c", "echo $OUTPOST_RUN_ID >> {marker}; sleep {work_s}; '
        f'echo torture-agent-{marker.name}"]\n')


def agents_alive(marker: Path) -> list[str]:
    """The agents' own processes (bubblewrap, the leader of an isolated agent, not counted)."""
    out = subprocess.run(["pgrep", "-f", f"torture-agent-{marker.name}"], capture_output=True, text=True).stdout
    alive = []
    for pid in out.split():
        with contextlib.suppress(OSError):   # it may end while we look
            if Path(f"/proc/{pid}/comm").read_text().strip() != "bwrap":
                alive.append(pid)
    return alive


def create_schedule(api: httpx.Client, repo: Path, name: str) -> str | None:
    raw = definition(repo, name=name, agent="mark", concurrency_policy="always_enqueue",
                     timing={"kind": "interval", "seconds": 10, "timezone": "UTC"})
    composed = api.post("/v1/outpost/schedules/compose", json=raw)
    if composed.status_code != 200:
        return None
    body = {"definition": composed.json()["definition"], "confirmation": composed.json()["confirmation"]}
    reply = api.post("/v1/outpost/schedules", headers={"Idempotency-Key": f"create-{name}"}, json=body)
    return reply.json()["id"] if reply.status_code == 201 else None


class Ledger:
    """What the servers acknowledged, from a random mix of requests; then what the database
    holds must account for every acknowledgement, and nothing may have started twice."""

    def __init__(self, rng: random.Random, repo: Path, marker: Path):
        self.rng, self.repo, self.marker = rng, repo, marker
        self.schedules: set[str] = set()
        self.runs: set[str] = set()
        self.routine_runs: set[str] = set()
        self.counter = 0

    def set_up_office(self, api: httpx.Client) -> None:
        """A routine whose webhook wakes an agent on the marker profile (set up before the kills)."""
        api.patch("/api/office/settings", json={"repository": str(self.repo)}).raise_for_status()
        agent = api.post("/api/office/agents", json={"name": "torture", "executor": "mark", "cooldown_sec": 0,
                                                     "max_concurrent_sessions": 2}).json()
        routine = api.post("/api/office/routines", json={
            "name": "hook", "assignee_agent_id": agent["id"], "concurrency_policy": "always_enqueue",
            "triggers": [{"kind": "webhook", "signing_mode": "none"}]}).json()
        self.hook = routine["triggers"][0]["fire_path"]

    def drive(self, apis: list[httpx.Client], seconds: float) -> None:
        """Requests for ``seconds``, each to one of ``apis``, until a server stops answering."""
        until = time.monotonic() + seconds
        with contextlib.suppress(httpx.TransportError):
            while time.monotonic() < until:
                self.request(self.rng.choice(apis))

    def request(self, api: httpx.Client) -> None:
        self.counter += 1
        counter, op = self.counter, self.rng.random()
        if op < 0.15 or not self.schedules:
            sid = create_schedule(api, self.repo, f"s{counter}")
            if sid:
                self.schedules.add(sid)
        elif op < 0.55:
            reply = api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": f"d{counter}"},
                             json={"brief": f"job {counter}", "repository": str(self.repo), "agent": "mark"})
            if reply.status_code == 202:
                self.runs.add(reply.json()["run_id"])
        elif op < 0.75:
            reply = api.post(self.hook, json={"n": counter})   # a webhook fire: 202 only after its commit
            if reply.status_code == 202:
                self.routine_runs.add(reply.json()["routine_run_id"])
        else:
            sid = self.rng.choice(sorted(self.schedules))
            revision = api.get(f"/v1/outpost/schedules/{sid}").json()["revision"]
            reply = api.post(f"/v1/outpost/schedules/{sid}/control", json={"action": "fire"},
                             headers={"Idempotency-Key": f"f{counter}", "If-Match": f'"{revision}"'})
            if reply.status_code == 200 and reply.json()["outcome"] == "admitted":
                self.runs.add(reply.json()["run_id"])

    def check(self, query, kills: int) -> str:
        """``query(sql)``: the rows of a statement on the database the servers shared. The summary."""
        schedules = {row[0] for row in query('SELECT id FROM "Schedule"')}
        runs = dict(query('SELECT id, status FROM "Run"'))
        routine_runs = dict(query('SELECT id, wakeup_id FROM "RoutineRun"'))
        lost = (self.schedules - schedules) | (self.runs - set(runs)) | (self.routine_runs - set(routine_runs))
        assert not lost, f"acknowledged but missing (seed {SEED}): {lost}"
        wakeups = dict(query('SELECT id, status FROM "Wakeup"'))
        assert all(routine_runs[r] in wakeups for r in self.routine_runs), "a webhook fire without its wakeup"
        assert set(wakeups.values()) <= {"queued", "claimed", "finished", "coalesced"}, Counter(wakeups.values())
        for wakeup_id, run_id in query('SELECT id, run_id FROM "Wakeup" WHERE status = \'claimed\''):
            assert runs[run_id] == "queued", (wakeup_id, runs[run_id])   # claimed: its run waits for admission
        doubled = query('SELECT occurrence_id, COUNT(*) FROM "Run" WHERE occurrence_id IS NOT NULL '
                        "GROUP BY occurrence_id HAVING COUNT(*) > 1")
        assert not doubled, f"occurrences with two runs: {doubled}"
        started = Counter(self.marker.read_text().split()) if self.marker.exists() else Counter()
        assert not [r for r, n in started.items() if n > 1], f"runs started twice (seed {SEED}): {started}"
        assert set(runs.values()) <= {"queued", *map(str, outpost.SETTLED_RUN_STATUSES)}, Counter(runs.values())
        for run_id in started:   # every run that started is settled, never queued again
            assert runs[run_id] in map(str, outpost.SETTLED_RUN_STATUSES), (run_id, runs[run_id])
        assert not agents_alive(self.marker), "orphaned agent processes survived the restarts"
        assert len(self.runs) >= kills and self.routine_runs, "the driver acknowledged too little to prove anything"
        return (f"{kills} kills; acknowledged {len(self.schedules)} schedules, {len(self.runs)} runs, "
                f"{len(self.routine_runs)} webhook fires; lost 0, started twice 0; {len(started)} runs started, "
                f"runs by status {dict(Counter(runs.values()))}")


def kill9(server: Server) -> None:
    server.proc.kill()                     # SIGKILL: no cleanup of any kind
    server.proc.wait()
    server.log_file.close()


def test_kill9_ledger_loses_nothing_and_does_nothing_twice(tmp_path, git_repo):
    data_dir, marker = tmp_path / "data", tmp_path / "started.log"
    marker_profile(data_dir, marker, work_s=0.4)
    ledger = Ledger(random.Random(SEED), git_repo, marker)
    server = Server(data_dir).start()
    with server.client() as api:
        ledger.set_up_office(api)
    assert server.stop() == 0
    for _ in range(KILLS):
        server = Server(data_dir).start()
        api = server.client()
        api.timeout = 5
        ledger.drive([api], ledger.rng.uniform(0.8, 2.5))
        kill9(server)

    # Restart once more, let the queue move, then stop cleanly.
    server = Server(data_dir).start()
    time.sleep(2)
    assert server.stop(signal.SIGTERM) == 0
    assert "Traceback" not in server.logs()

    db = sqlite3.connect(data_dir / "outpost.sqlite3")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    summary = ledger.check(lambda sql: db.execute(sql).fetchall(), KILLS)
    print(f"\nkill -9 ledger (seed {SEED}): {summary}")


@needs_postgres
def test_kill9_ledger_on_two_postgresql_nodes(tmp_path, git_repo):
    """The same ledger against a fleet: two nodes on one PostgreSQL, requests to both, and at
    each round one of them killed -9 while the other serves on; it comes back before the next."""
    database, marker = postgres_database(), tmp_path / "started.log"
    POSTGRES_DATABASES[tmp_path / "fleet"] = database
    dirs = [tmp_path / name for name in ("a", "b")]
    for data_dir, name in zip(dirs, ("a", "b"), strict=True):
        marker_profile(data_dir, marker, work_s=0.4)
        with (data_dir / "outpost.toml").open("a") as toml:
            toml.write(f'[settings]\nnode_name = "{name}"\n')
    ledger = Ledger(random.Random(SEED), git_repo, marker)
    nodes = [Server(d, ("--database", database)).start() for d in dirs]
    with nodes[0].client() as api:
        ledger.set_up_office(api)
    for _ in range(KILLS):
        apis = [node.client() for node in nodes]
        for api in apis:
            api.timeout = 5
        ledger.drive(apis, ledger.rng.uniform(0.8, 2.5))
        victim = ledger.rng.randrange(2)
        kill9(nodes[victim])
        ledger.drive([apis[1 - victim]], ledger.rng.uniform(0.3, 1.0))   # the survivor serves on
        nodes[victim] = Server(dirs[victim], ("--database", database)).start()

    time.sleep(2)   # let the queue move, then stop both cleanly
    for node in nodes:
        assert node.stop(signal.SIGTERM) == 0
        assert "Traceback" not in node.logs()
    connection = psycopg2.connect(database)

    def query(sql: str) -> list[tuple]:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            return cursor.fetchall()
    try:
        summary = ledger.check(query, KILLS)
    finally:
        connection.close()
    print(f"\nkill -9 ledger on two PostgreSQL nodes (seed {SEED}): {summary}")


def test_sigterm_under_load_exits_cleanly(tmp_path, git_repo):
    data_dir, marker = tmp_path / "data", tmp_path / "started.log"
    marker_profile(data_dir, marker, work_s=60)
    server = Server(data_dir, ("--max-running", "2")).start()
    api = server.client()
    for i in range(5):
        api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": f"long{i}"},
                 json={"brief": "long", "repository": str(git_repo), "agent": "mark"}).raise_for_status()
    wait_for(lambda: len(agents_alive(marker)) == 2)
    sent = 0
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    while server.proc.poll() is None and time.monotonic() - started < 30:   # keep the intake busy meanwhile
        try:
            api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": f"late{sent}"}, timeout=2,
                     json={"brief": "late", "repository": str(git_repo), "agent": "mark"})
            sent += 1
        except httpx.TransportError:
            time.sleep(0.02)
    code = server.proc.wait(30)
    took = time.monotonic() - started
    server.log_file.close()
    logs = server.logs()
    assert code == 0, logs
    assert took < outpost.GRACE_S + 5, f"shutdown took {took:.1f} s"
    assert "Traceback" not in logs and "database is closed" not in logs.lower(), logs
    assert not agents_alive(marker)
    db = sqlite3.connect(data_dir / "outpost.sqlite3")
    statuses = Counter(status for (status,) in db.execute('SELECT status FROM "Run"'))
    assert statuses["running"] == 0 and statuses["failed"] == 2, statuses   # the two live runs: interrupted
    errors = {e for (e,) in db.execute("SELECT error FROM \"Run\" WHERE status = 'failed'")}
    assert errors == {"interrupted"}


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
from conftest import Server, definition, wait_for

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


def test_kill9_ledger_loses_nothing_and_does_nothing_twice(tmp_path, git_repo):
    rng = random.Random(SEED)
    data_dir, marker = tmp_path / "data", tmp_path / "started.log"
    marker_profile(data_dir, marker, work_s=0.4)
    acked_schedules: set[str] = set()
    acked_runs: set[str] = set()
    acked_routine_runs: set[str] = set()
    # Office: a routine whose webhook wakes an agent on the marker profile (set up before the kills).
    server = Server(data_dir).start()
    with server.client() as api:
        api.patch("/api/office/settings", json={"repository": str(git_repo)}).raise_for_status()
        agent = api.post("/api/office/agents", json={"name": "torture", "executor": "mark", "cooldown_sec": 0,
                                                     "max_concurrent_sessions": 2}).json()
        routine = api.post("/api/office/routines", json={
            "name": "hook", "assignee_agent_id": agent["id"], "concurrency_policy": "always_enqueue",
            "triggers": [{"kind": "webhook", "signing_mode": "none"}]}).json()
    hook = routine["triggers"][0]["fire_path"]
    assert server.stop() == 0
    counter = 0
    for _ in range(KILLS):
        server = Server(data_dir).start()
        api = server.client()
        api.timeout = 5
        until = time.monotonic() + rng.uniform(0.8, 2.5)
        try:
            while time.monotonic() < until:
                counter += 1
                op = rng.random()
                if op < 0.15 or not acked_schedules:
                    sid = create_schedule(api, git_repo, f"s{counter}")
                    if sid:
                        acked_schedules.add(sid)
                elif op < 0.55:
                    reply = api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": f"d{counter}"},
                                     json={"brief": f"job {counter}", "repository": str(git_repo), "agent": "mark"})
                    if reply.status_code == 202:
                        acked_runs.add(reply.json()["run_id"])
                elif op < 0.75:
                    reply = api.post(hook, json={"n": counter})   # a webhook fire: 202 only after its commit
                    if reply.status_code == 202:
                        acked_routine_runs.add(reply.json()["routine_run_id"])
                else:
                    sid = rng.choice(sorted(acked_schedules))
                    revision = api.get(f"/v1/outpost/schedules/{sid}").json()["revision"]
                    reply = api.post(f"/v1/outpost/schedules/{sid}/control", json={"action": "fire"},
                                     headers={"Idempotency-Key": f"f{counter}", "If-Match": f'"{revision}"'})
                    if reply.status_code == 200 and reply.json()["outcome"] == "admitted":
                        acked_runs.add(reply.json()["run_id"])
        except httpx.TransportError:
            pass
        server.proc.kill()                     # SIGKILL: no cleanup of any kind
        server.proc.wait()
        server.log_file.close()

    # Restart once more, let the queue move, then stop cleanly.
    server = Server(data_dir).start()
    time.sleep(2)
    assert server.stop(signal.SIGTERM) == 0
    assert "Traceback" not in server.logs()

    db = sqlite3.connect(data_dir / "outpost.sqlite3")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    schedules = {row[0] for row in db.execute('SELECT id FROM "Schedule"')}
    runs = dict(db.execute('SELECT id, status FROM "Run"').fetchall())
    routine_runs = dict(db.execute('SELECT id, wakeup_id FROM "RoutineRun"').fetchall())
    lost = (acked_schedules - schedules) | (acked_runs - set(runs)) | (acked_routine_runs - set(routine_runs))
    assert not lost, f"acknowledged but missing (seed {SEED}): {lost}"
    wakeups = dict(db.execute('SELECT id, status FROM "Wakeup"').fetchall())
    assert all(routine_runs[r] in wakeups for r in acked_routine_runs), "a webhook fire without its wakeup"
    assert set(wakeups.values()) <= {"queued", "claimed", "finished", "coalesced"}, Counter(wakeups.values())
    for wakeup_id, run_id in db.execute('SELECT id, run_id FROM "Wakeup" WHERE status = \'claimed\''):
        assert runs[run_id] == "queued", (wakeup_id, runs[run_id])   # claimed: its run waits for admission
    doubled = db.execute('SELECT occurrence_id, COUNT(*) FROM "Run" WHERE occurrence_id IS NOT NULL '
                         "GROUP BY occurrence_id HAVING COUNT(*) > 1").fetchall()
    assert not doubled, f"occurrences with two runs: {doubled}"
    started = Counter(marker.read_text().split()) if marker.exists() else Counter()
    assert not [r for r, n in started.items() if n > 1], f"runs started twice (seed {SEED}): {started}"
    assert set(runs.values()) <= {"queued", *map(str, outpost.SETTLED_RUN_STATUSES)}, Counter(runs.values())
    for run_id in started:   # every run that started is settled, never queued again
        assert runs[run_id] in map(str, outpost.SETTLED_RUN_STATUSES), (run_id, runs[run_id])
    assert not agents_alive(marker), "orphaned agent processes survived the restarts"
    assert len(acked_runs) >= KILLS and acked_routine_runs, "the driver acknowledged too little to prove anything"
    print(f"\nkill -9 ledger (seed {SEED}): {KILLS} kills; acknowledged {len(acked_schedules)} schedules, "
          f"{len(acked_runs)} runs, {len(acked_routine_runs)} webhook fires; lost 0, started twice 0; "
          f"{len(started)} runs started, runs by status {dict(Counter(runs.values()))}")


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


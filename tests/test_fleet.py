"""A fleet (docs/fleet.md): several nodes on one PostgreSQL. Store-level rules with two Store
objects as two nodes, then real `outpost serve --database` processes. Needs the throwaway
cluster `.ci/run` starts ($OUTPOST_TEST_POSTGRES_URL); skipped without it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import trio
from conftest import (
    POSTGRES_DATABASES,
    call,
    make_deps,
    make_repo,
    needs_postgres,
    postgres_database,
    wait_for,
)

import outpost

pytestmark = needs_postgres
NOW = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
PASSWORD = "fleet-password-never-printed"
BEAT = outpost.NODE_HEARTBEAT_S   # a survivor's time since its own previous beat, beating steadily


@pytest.fixture
def database(tmp_path: Path) -> str:
    url = postgres_database()
    POSTGRES_DATABASES[tmp_path / "fleet"] = url
    return url


@pytest.fixture
def nodes(database: str, tmp_path: Path):
    """Two nodes, a and b, on one database (two Store objects: two connections)."""
    pair = [outpost.Store(database, data_dir=tmp_path, node=name) for name in ("a", "b")]
    for store in pair:
        call(store, store.nodes.register_node, 2)
    yield pair
    for store in pair:
        store.close()


def queue(store: outpost.Store, repo: Path, n: int) -> list[str]:
    payload = outpost.normalize_dispatch({"brief": "fleet", "repository": str(repo), "agent": "demo"}, NOW,
                                         agents=["demo"])
    return [call(store, store.schedules.create_dispatch, payload, NOW, "0" * 40)["run_id"] for _ in range(n)]


def silence(store: outpost.Store, node: str, seconds: int) -> None:
    """Make ``node``'s last heartbeat ``seconds`` old on the database's clock."""
    call(store, lambda: store.db.execute(
        f'UPDATE "Node" SET heartbeat_at = {store.dialect.db_now(-seconds)} WHERE name = $n', {"n": node}))


def run_row(store: outpost.Store, run_id: str) -> dict:
    return call(store, store.runs.get_run, run_id)


def test_each_node_admits_into_its_own_slots_and_the_fleet_cap(nodes, tmp_path, git_repo):
    a, b = nodes
    runs = queue(a, git_repo, 6)
    admitted_a = [r for r, _ in call(a, a.runs.admit_ready, 2, NOW)]
    admitted_b = [r for r, _ in call(b, b.runs.admit_ready, 2, NOW, fleet_max=3)]
    assert admitted_a == runs[:2] and admitted_b == runs[2:3]   # the fleet's third slot is the last
    assert call(a, a.runs.admit_ready, 2, NOW) == []                 # a's own two slots are full
    assert [run_row(a, r)["node"] for r in runs[:3]] == ["a", "a", "b"]
    nodes_view = {n["name"]: n for n in call(b, b.nodes.list_nodes)}
    assert (nodes_view["a"]["running"], nodes_view["b"]["running"]) == (2, 1)
    assert {n["status"] for n in nodes_view.values()} == {"up"}


def test_a_lost_node_s_runs_are_settled_or_requeued_and_its_writes_are_fenced(nodes, git_repo):
    a, b = nodes
    started, unstarted = queue(a, git_repo, 2)
    assert [r for r, _ in call(b, b.runs.admit_ready, 2, NOW)] == [started, unstarted]
    assert call(b, b.runs.mark_spawned, started, 4242, "1", ("b", 1))
    silence(a, "b", outpost.NODE_LOST_S - 3)
    assert call(a, a.nodes.settle_lost_nodes, NOW, BEAT) == []        # not lost yet
    assert 2.5 < call(a, a.nodes.next_loss_in) <= 3                   # a looks again when it will be
    silence(a, "b", outpost.NODE_LOST_S + 1)
    assert call(a, a.nodes.settle_lost_nodes, NOW, BEAT) == [started]
    settled = run_row(a, started)
    assert (settled["status"], settled["error"], settled["failure_kind"]) == ("failed", "interrupted", "interrupted")
    assert (run_row(a, unstarted)["status"], run_row(a, unstarted)["node"]) == ("queued", None)
    assert {n["name"]: n["status"] for n in call(a, a.nodes.list_nodes)} == {"a": "up", "b": "lost"}
    assert call(a, a.nodes.next_loss_in) is None                       # no other node up: nothing to look for
    # b comes back: it learns it was lost, cannot start or settle what it admitted before
    assert call(b, b.nodes.node_heartbeat) is None
    assert call(b, b.runs.mark_spawned, unstarted, 4343, "1", ("b", 1)) is False
    done = outpost.Outcome(outpost.RunStatus.SUCCEEDED, None)
    assert call(b, b.runs.settle_run, started, done, NOW, fence=("b", 1)) is False
    assert run_row(a, started)["status"] == "failed"
    # the unstarted run is admitted again, by a, as its second attempt; b's stale fence stays shut
    assert [r for r, _ in call(a, a.runs.admit_ready, 2, NOW)] == [unstarted]
    assert call(b, b.runs.settle_run, unstarted, done, NOW, fence=("b", 1)) is False
    assert call(a, a.runs.settle_run, unstarted, done, NOW, fence=("a", 2)) is True
    # b's restart: up again, and the agent it left behind is named for ending
    assert call(b, b.nodes.register_node, 2) == [(started, 4242, "1")]
    assert call(b, b.nodes.node_heartbeat) is not None


def test_after_the_database_was_out_of_every_node_s_reach_the_first_node_back_declares_none_lost(nodes, git_repo):
    a, b = nodes
    started = queue(a, git_repo, 1)[0]
    assert [r for r, _ in call(b, b.runs.admit_ready, 1, NOW)] == [started]
    assert call(b, b.runs.mark_spawned, started, 4242, "1", ("b", 1))
    for node in ("a", "b"):   # neither could beat for 20 s
        silence(a, node, 20)
    gap = call(a, a.nodes.node_heartbeat)
    assert 19 < gap < 21                                               # a is back first, after its own 20 s
    assert call(a, a.nodes.settle_lost_nodes, NOW, gap) == []          # b's silence proves nothing yet
    assert call(b, b.nodes.node_heartbeat) is not None                 # b is alive: it beats too
    silence(a, "a", BEAT)
    assert call(a, a.nodes.settle_lost_nodes, NOW, call(a, a.nodes.node_heartbeat)) == []
    assert {n["name"]: n["status"] for n in call(a, a.nodes.list_nodes)} == {"a": "up", "b": "up"}
    assert run_row(a, started)["status"] == "running"
    silence(a, "b", outpost.NODE_LOST_S + 1)                           # now b is silent while a beats
    assert call(a, a.nodes.settle_lost_nodes, NOW, BEAT) == [started]


def test_two_nodes_claim_a_due_slot_once(nodes, git_repo):
    a, b = nodes
    raw = {"name": "every-minute", "brief": "@print hi", "repository": str(git_repo), "agent": "demo",
           "timing": {"kind": "interval", "seconds": 60, "timezone": "UTC"}}
    schedule = call(a, a.schedules.create_schedule, outpost.normalize_definition(raw, NOW, agents=["demo"]), NOW)
    for minute in range(1, 6):
        at = NOW + timedelta(minutes=minute, seconds=1)
        claimed = [call(s, s.schedules.claim_due, at, digests={}, heads={}, up_since=NOW) for s in (b, a)]
        assert claimed[1] == []   # b claimed the slot (a run, or a skip while the last one is active)
    occurrences = call(a, a.schedules.occurrences, schedule["id"])
    assert len(occurrences) == len({o["due_at"] for o in occurrences}) == 5



def test_two_nodes_admitting_at_once_keep_the_fleet_cap(nodes, tmp_path, git_repo):
    """Both admissions count the fleet's running runs before either commits: PostgreSQL rolls the
    later one back (SERIALIZABLE) and it runs again, whole group and all, on what is there now."""
    a, b = nodes
    here, there = queue(a, git_repo, 1)[0], queue(a, make_repo(tmp_path / "other"), 1)[0]
    repo_here, repo_there = run_row(a, here)["repository"], run_row(a, there)["repository"]
    a_counted, b_committed = threading.Event(), threading.Event()

    def admit_and_hold():
        admitted = a.runs.admit_ready(2, NOW, fleet_max=1, unreachable=[repo_there])
        if not a_counted.is_set():   # the first attempt only: b admits and commits meanwhile
            a_counted.set()
            assert b_committed.wait(30)
        return admitted

    attention = lambda: a.raise_attention("probe", "in the same group", None, NOW, schedule_id=None, run_id=None)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        group = pool.submit(a.transactions, [admit_and_hold, attention])
        assert a_counted.wait(30)
        assert [r for r, _ in call(b, b.runs.admit_ready, 2, NOW, fleet_max=1, unreachable=[repo_here])] == [there]
        b_committed.set()
        admitted, raised = group.result(30)
    assert (admitted.error, admitted.result, raised.error) == (None, [], None)   # a found the one slot taken
    assert a.serialization_retries == 1
    assert [run_row(a, r)["status"] for r in (here, there)] == ["queued", "running"]
    assert [i["title"] for i in call(a, a.list_attention, True)] == ["in the same group"]   # written once


def test_event_cursors_follow_commit_order_across_nodes(nodes):
    """Two nodes write events at once while a reader follows the cursor: it misses none (a
    number taken by a transaction that commits later never falls behind the reader)."""
    a, b = nodes
    writing, seen = 2, []

    def write(store: outpost.Store, node: str) -> None:
        nonlocal writing
        for i in range(150):
            call(store, store.raise_attention, "probe", f"{node} {i}", None, NOW, schedule_id=None, run_id=None)
        writing -= 1

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        writers = [pool.submit(write, a, "a"), pool.submit(write, b, "b")]
        reader = outpost.Store(a.database, node="reader")
        cursor = 0
        while True:
            last_pass = writing == 0
            page = call(reader, reader.events_after, cursor, 1000)
            seen += [e["data"]["title"] for e in page["events"]]
            cursor = page["next_cursor"]
            if last_pass:
                break
        for w in writers:
            w.result()
    every = [e["data"]["title"] for e in call(reader, reader.events_after, 0, 10_000)["events"]]
    reader.close()
    assert len(every) == 300 and seen == every


def test_an_upgraded_fleet_database_numbers_events_after_its_last_cursor(database):
    """Schema 9 numbered events by the EventSequence row; from 10 PostgreSQL's sequence goes on from it."""
    store = outpost.Store(database, node="a")
    call(store, store.raise_attention, "probe", "before", None, NOW, schedule_id=None, run_id=None)
    call(store, lambda: store.db.execute(
        'DROP SEQUENCE event_cursor; UPDATE schema_version SET version = 9; UPDATE "EventSequence" SET value = 41'))
    store.close()
    store = outpost.Store(database, node="a")
    call(store, store.raise_attention, "probe", "after", None, NOW, schedule_id=None, run_id=None)
    assert [e["cursor"] for e in call(store, store.events_after, 0, 10)["events"]] == [1, 42]
    assert call(store, store.latest_cursor) == 42
    store.close()


def test_a_node_name_is_one_process_s_at_a_time(database):
    first = outpost.Store(database, node="same", process="host-a pid 1")
    second = outpost.Store(database, node="same", process="host-b pid 2")
    assert call(first, first.nodes.claim_node_name) is None
    call(first, first.nodes.register_node, 2)
    assert call(second, second.nodes.claim_node_name) == "host-a pid 1"        # its heartbeat is fresh
    assert call(second, second.nodes.claim_node_name, "host-a pid 1") is None  # one the caller saw end
    assert call(first, first.nodes.claim_node_name) == "host-b pid 2"
    silence(first, "same", outpost.NODE_LOST_S + 1)
    assert call(first, first.nodes.claim_node_name) is None                    # silent for NODE_LOST_S: free
    call(first, first.nodes.release_node_name)
    assert call(second, second.nodes.claim_node_name) is None                  # released by a clean stop: free at once
    for store in (first, second):
        store.close()


async def test_a_node_whose_name_was_taken_while_it_was_silent_stops(database, tmp_path):
    stalled = outpost.Store(database, data_dir=tmp_path, node="same", process="host-a pid 1")
    call(stalled, stalled.nodes.register_node, 2)
    silence(stalled, "same", outpost.NODE_LOST_S + 1)                   # a long stall: another process takes over
    newcomer = outpost.Store(database, data_dir=tmp_path, node="same", process="host-b pid 2")
    assert call(newcomer, newcomer.nodes.claim_node_name) is None
    call(newcomer, newcomer.nodes.register_node, 2)
    assert call(stalled, stalled.nodes.node_heartbeat) is None              # the name is another process's now
    with pytest.raises(outpost.NodeNameTaken):
        call(stalled, stalled.nodes.register_node, 2)
    shutdown = trio.Event()
    deps = make_deps(tmp_path / "stalled", store=stalled, clock=outpost.WallClock(), inline_db=True)
    with trio.fail_after(30):
        await outpost.node_actor(deps, shutdown)                        # it stops instead of coming back up
    assert shutdown.is_set()
    assert call(newcomer, newcomer.nodes.node_heartbeat) is not None
    for store in (stalled, newcomer):
        store.close()

# --- real nodes: `outpost serve --database` processes -------------------------------------------

PROBE = """import os, sys, time
ledger = os.environ["FLEET_LEDGER"]
def note(word):
    with open(ledger, "a") as f:
        f.write(f"{word} {os.environ['OUTPOST_RUN_ID']} {time.time():.6f}\\n")
note("start")
print(f"probe started {os.environ['OUTPOST_RUN_ID']}", flush=True)
sys.stdin.read()
time.sleep(float(os.environ.get("FLEET_SLEEP", "0.4")))
note("end")
"""


class Node:
    """One `outpost serve --database URL` process with a data dir of its own."""

    def __init__(self, tmp_path: Path, name: str, database: str, ledger: Path, *, max_running: int = 2,
                 fleet_max: int | None = None, sleep_s: float = 0.4):
        self.name, self.database = name, database
        self.data_dir = tmp_path / name
        self.data_dir.mkdir(exist_ok=True)
        (tmp_path / "probe.py").write_text(PROBE)
        settings = f'node_name = "{name}"\nmax_running = {max_running}\nisolate_agents = "never"\n' + (
            f"fleet_max_running = {fleet_max}\n" if fleet_max else "")
        command = json.dumps([sys.executable, str(tmp_path / "probe.py")])
        (self.data_dir / "outpost.toml").write_text(
            f"[settings]\n{settings}\n[agents.probe]\ncommand = {command}\n"
            'pass_env = ["FLEET_LEDGER", "FLEET_SLEEP"]\n[agents.missing]\ncommand = ["/nonexistent/agent"]\n')
        self.env = {"FLEET_LEDGER": str(ledger), "FLEET_SLEEP": str(sleep_s),
                    "OUTPOST_DATABASE_PASSWORD": PASSWORD}   # the test cluster trusts; never printed either way

    def start(self, server_factory):
        self.server = server_factory("--database", self.database, data_dir=self.data_dir, env=self.env)
        return self

    def client(self) -> httpx.Client:
        return self.server.client()


def dispatch(client: httpx.Client, repo: Path, brief: str = "fleet", agent: str = "probe") -> str:
    reply = client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": uuid.uuid4().hex},
                        json={"brief": brief, "repository": str(repo), "agent": agent})
    assert reply.status_code == 202, reply.text
    return reply.json()["run_id"]


def ledger_lines(ledger: Path) -> list[tuple[str, str, float]]:
    if not ledger.exists():
        return []
    return [(w, r, float(t)) for w, r, t in (line.split() for line in ledger.read_text().splitlines())]


def settled(client: httpx.Client, run_ids: list[str]) -> list[dict]:
    runs = [client.get(f"/v1/outpost/runs/{r}").json() for r in run_ids]
    return runs if all(r["status"] in ("succeeded", "failed", "cancelled", "needs_you") for r in runs) else []


def test_two_nodes_share_one_queue_within_the_fleet_limit(tmp_path, database, git_repo, server_factory):
    ledger = tmp_path / "ledger"
    a = Node(tmp_path, "a", database, ledger, max_running=2, fleet_max=3).start(server_factory)
    b = Node(tmp_path, "b", database, ledger, max_running=2, fleet_max=3).start(server_factory)
    with a.client() as ca, b.client() as cb:
        broken = dispatch(ca, git_repo, agent="missing")   # a launch failure settles its run, nothing more
        run_ids = [dispatch(c, git_repo) for _ in range(12) for c in (ca, cb)]
        runs = wait_for(lambda: settled(ca, run_ids), timeout_s=90, interval_s=0.3)
        assert {r["status"] for r in runs} == {"succeeded"}, [(r["id"], r["status"], r["error"]) for r in runs]
        assert {r["node"] for r in runs} == {"a", "b"}                    # both nodes worked
        failed = wait_for(lambda: settled(ca, [broken]), timeout_s=30)[0]
        assert failed["status"] == "failed" and "could not start agent command" in failed["error"]
        assert cb.get(f"/v1/outpost/runs/{run_ids[0]}").json()["node"] in ("a", "b")
        for run in runs[:4]:   # any node serves any run's log
            other = cb if run["node"] == "a" else ca
            assert f"probe started {run['id']}" in other.get(f"/v1/outpost/runs/{run['id']}/log").text
        nodes = {n["name"]: n for n in ca.get("/v1/outpost/nodes").json()["nodes"]}
        assert {name: n["status"] for name, n in nodes.items()} == {"a": "up", "b": "up"}
    lines = ledger_lines(ledger)
    starts = [r for w, r, _ in lines if w == "start"]
    assert sorted(starts) == sorted(run_ids)                             # every run started exactly once
    running, most = 0, 0
    for word, _, _ in sorted(lines, key=lambda line: (line[2], line[0] == "start")):   # an end before a start
        running += 1 if word == "start" else -1
        most = max(most, running)
    assert most <= 3                                                     # the fleet's limit, by the agents' clocks
    for node in (a, b):
        assert "Traceback" not in node.server.logs() and PASSWORD not in node.server.logs()


def test_kill_9_of_a_node_the_survivor_settles_its_runs_and_the_restart_leaves_them(
        tmp_path, database, git_repo, server_factory):
    ledger = tmp_path / "ledger"
    a = Node(tmp_path, "a", database, ledger, max_running=1, sleep_s=60)
    b = Node(tmp_path, "b", database, ledger, max_running=1, sleep_s=60).start(server_factory)
    with b.client() as cb:
        long_run = dispatch(cb, git_repo)
        wait_for(lambda: any(w == "start" and r == long_run for w, r, _ in ledger_lines(ledger)), timeout_s=30)
        waiting = dispatch(cb, git_repo)   # b's only slot is taken: it waits in the shared queue
    a.env["FLEET_SLEEP"] = "0.2"
    a.start(server_factory)
    with a.client() as ca:   # b's live log, through a
        wait_for(lambda: f"probe started {long_run}" in ca.get(f"/v1/outpost/runs/{long_run}/log").text,
                 timeout_s=10)
    b.server.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    with a.client() as ca:
        run = wait_for(lambda: (r := ca.get(f"/v1/outpost/runs/{long_run}").json())["status"] == "failed" and r,
                       timeout_s=outpost.NODE_LOST_S + 10, interval_s=0.2)
        assert (run["error"], run["node"]) == ("interrupted", "b")
        assert time.monotonic() - killed_at <= outpost.NODE_LOST_S + 2 * outpost.NODE_HEARTBEAT_S + 2
        after = wait_for(lambda: settled(ca, [waiting]), timeout_s=30, interval_s=0.2)[0]
        assert (after["status"], after["node"]) == ("succeeded", "a")
        assert {n["name"]: n["status"] for n in ca.get("/v1/outpost/nodes").json()["nodes"]}["b"] == "lost"
        b.start(server_factory)   # the dead node comes back: it ends its orphaned agent, settles nothing
        with b.client() as cb:
            wait_for(lambda: {n["name"]: n["status"] for n in cb.get("/v1/outpost/nodes").json()["nodes"]}["b"]
                     == "up", timeout_s=10)
            assert cb.get(f"/v1/outpost/runs/{long_run}").json()["finished_at"] == run["finished_at"]
    starts = [r for w, r, _ in ledger_lines(ledger) if w == "start"]
    assert sorted(starts) == sorted([long_run, waiting])                # nothing started twice
    assert not any(w == "end" and r == long_run for w, r, _ in ledger_lines(ledger))
    assert "ending its surviving processes" in b.server.logs()



def test_every_node_s_event_stream_sees_another_node_s_events(tmp_path, database, git_repo, server_factory):
    ledger = tmp_path / "ledger"
    a = Node(tmp_path, "a", database, ledger).start(server_factory)
    b = Node(tmp_path, "b", database, ledger).start(server_factory)
    seen: list[dict] = []
    # a read timeout under the 15 s keep-alive: only the fleet's poll can bring a's events in time
    with a.client() as ca, b.client() as cb, cb.stream("GET", "/v1/outpost/events/stream", timeout=8) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("retry:")   # b streams from its latest cursor on
        run_id = dispatch(ca, git_repo)           # a request to a; nothing pokes b
        for line in lines:
            if line.startswith("data:"):
                seen.append(json.loads(line[5:]))
                if seen[-1]["type"] == "run.settled" and seen[-1]["data"]["run_id"] == run_id:
                    break
    mine = [e["type"] for e in seen if e["data"].get("run_id") == run_id]
    assert mine[0] == "run.queued" and mine[-1] == "run.settled", mine
    assert [e["cursor"] for e in seen] == sorted(e["cursor"] for e in seen)   # one fleet-wide order


# --- outpost migrate ------------------------------------------------------------------------------

def table_counts(query) -> dict[str, int]:
    tables = [e._table_ for e in outpost.Store(":memory:").db.entities.values() if e.__name__ != "Node"]
    return {t: query(f'SELECT COUNT(*) FROM "{t}"')[0][0] for t in tables}


def test_migrate_copies_an_appliance_into_postgresql_which_then_serves_it(tmp_path, git_repo, server_factory):
    import sqlite3

    import psycopg2

    data = tmp_path / "appliance"
    appliance = server_factory(data_dir=data)   # SQLite: some history of every kind
    with appliance.client() as api:
        raw = {"name": "nightly", "brief": "@print hello", "repository": str(git_repo), "agent": "demo",
               "timing": {"kind": "cron", "expression": "0 0 1 1 *", "timezone": "UTC"}}
        composed = api.post("/v1/outpost/schedules/compose", json=raw).json()
        schedule = api.post("/v1/outpost/schedules", headers={"Idempotency-Key": "create"}, json={
            "definition": composed["definition"], "confirmation": composed["confirmation"]}).json()
        fired = api.post(f"/v1/outpost/schedules/{schedule['id']}/control", json={"action": "fire"},
                         headers={"Idempotency-Key": "fire", "If-Match": '"1"'}).json()
        failing = api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": "fail"}, json={
            "brief": "@print x", "repository": str(tmp_path / "nowhere"), "agent": "demo"})
        api.patch("/api/office/settings", json={"repository": str(git_repo)}).raise_for_status()
        agent = api.post("/api/office/agents", json={"name": "worker", "executor": "demo"}).json()
        api.post("/api/office/tasks", json={"title": "write it", "assignee_agent_id": agent["id"]}).raise_for_status()
        wait_for(lambda: api.get(f"/v1/outpost/runs/{fired['run_id']}").json()["status"] == "succeeded", 30)
        assert failing.status_code in (202, 422), failing.text
    assert appliance.stop() == 0
    before = table_counts(lambda sql: sqlite3.connect(data / "outpost.sqlite3").execute(sql).fetchall())
    assert before["Run"] >= 2 and before["Event"] > 5 and before["Wakeup"] >= 1 and before["Task"] == 1
    assert before["IdempotencyRecord"] >= 3 and before["Occurrence"] == 1
    logs = sorted((data / "runs").glob("*.log"))   # on SQLite a run's log is a file of the data dir
    assert before["LogChunk"] == 0 and f"{fired['run_id']}.log" in [p.name for p in logs]

    url = postgres_database()
    POSTGRES_DATABASES[tmp_path / "migrated"] = url
    migrate = [sys.executable, str(Path(outpost.__file__)), "migrate", "--data-dir", str(data), "--to", url]
    done = subprocess.run(migrate, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = dict(line.split() for line in done.stdout.splitlines()[:-1])
    connection = psycopg2.connect(url)
    try:
        def query(sql):
            with connection.cursor() as cursor:
                cursor.execute(sql)
                return cursor.fetchall()
        copied = before | {"LogChunk": len(logs)}   # each log became one chunk in the database
        assert table_counts(query) == copied == {t: int(n) for t, n in printed.items()}
    finally:
        connection.close()
    again = subprocess.run(migrate, capture_output=True, text=True, timeout=120)
    assert (again.returncode, again.stdout) == (1, "") and "is not empty" in again.stderr

    served = server_factory("--database", url, data_dir=tmp_path / "node")   # the appliance, now on PostgreSQL
    with served.client() as api:
        assert [s["name"] for s in api.get("/v1/outpost/schedules").json()["schedules"]] == ["nightly"]
        assert api.get(f"/v1/outpost/runs/{fired['run_id']}").json()["status"] == "succeeded"
        old_log = api.get(f"/v1/outpost/runs/{fired['run_id']}/log").text   # served from another data dir
        assert "hello" in old_log and old_log == (data / "runs" / f"{fired['run_id']}.log").read_text()
        fired_again = api.post(f"/v1/outpost/schedules/{schedule['id']}/control", json={"action": "fire"},
                               headers={"Idempotency-Key": "fire-2", "If-Match": '"1"'}).json()
        assert fired_again["outcome"] == "admitted", fired_again
        wait_for(lambda: api.get(f"/v1/outpost/runs/{fired_again['run_id']}").json()["status"] == "succeeded", 30)
        replay = api.post(f"/v1/outpost/schedules/{schedule['id']}/control", json={"action": "fire"},
                          headers={"Idempotency-Key": "fire", "If-Match": '"1"'})
        assert replay.headers.get("Idempotent-Replayed") == "true"   # its keys came along
        assert replay.json()["run_id"] == fired["run_id"]
    assert "Traceback" not in served.logs()
    inspect = [sys.executable, str(Path(outpost.__file__)), "inspect", "--data-dir", str(tmp_path / "node"),
               "nightly", "--json"]   # the fleet's database, named by the environment as under systemd
    inspected = subprocess.run(inspect, capture_output=True, text=True, timeout=60,
                               env={**os.environ, "OUTPOST_DATABASE_URL": url})
    assert inspected.returncode == 0, inspected.stderr
    assert [c["check"] for c in json.loads(inspected.stdout)["checks"]] == [1, 2, 3, 4, 5, 6]


async def test_the_nodes_panel_shows_a_lost_node_and_a_run_its_node(nodes, tmp_path, git_repo):
    from conftest import make_deps, sign_in_client

    a, b = nodes
    run_id = queue(b, git_repo, 1)[0]
    call(b, b.runs.admit_ready, 1, NOW)
    assert call(b, b.runs.mark_spawned, run_id, 999_999, "1", ("b", 1))   # started on b: settled, not requeued
    silence(a, "b", 11)
    call(a, a.nodes.settle_lost_nodes, NOW, BEAT)
    deps = make_deps(tmp_path, store=a)
    client = outpost.create_app(deps).test_client()
    sign_in_client(client, a, NOW)
    page = await (await client.get("/agents")).get_data(as_text=True)
    rows = dict(re.findall(r'<tr data-node="([^"]+)">.*?class="badge \w+">(\w+)</span>', page, re.S))
    assert rows == {"a": "up", "b": "lost"}
    assert 'id="nodes-single"' not in page
    run_page = await (await client.get(f"/runs/{run_id}")).get_data(as_text=True)
    assert re.search(r'id="run-node">b</dd>', run_page)


def test_an_interval_schedule_fires_once_per_slot_with_two_nodes_running(tmp_path, database, git_repo,
                                                                         server_factory):
    ledger = tmp_path / "ledger"
    a = Node(tmp_path, "a", database, ledger, sleep_s=0.1).start(server_factory)
    b = Node(tmp_path, "b", database, ledger, sleep_s=0.1).start(server_factory)
    with a.client() as ca, b.client() as cb:
        raw = {"name": "tick", "brief": "tick", "repository": str(git_repo), "agent": "probe",
               "concurrency_policy": "always_enqueue", "timing": {"kind": "interval", "seconds": 10, "timezone": "UTC"}}
        composed = cb.post("/v1/outpost/schedules/compose", json=raw).json()
        schedule = cb.post("/v1/outpost/schedules", headers={"Idempotency-Key": uuid.uuid4().hex}, json={
            "definition": composed["definition"], "confirmation": composed["confirmation"]}).json()

        def slots():
            listed = ca.get(f"/v1/outpost/schedules/{schedule['id']}/occurrences").json()["occurrences"]
            return listed if len(listed) >= 3 else None
        occurrences = wait_for(slots, timeout_s=45, interval_s=0.5)
        runs = [r for r in ca.get("/v1/outpost/runs", params={"schedule_id": schedule["id"], "limit": 100})
                .json()["runs"]]
    assert len({o["due_at"] for o in occurrences}) == len(occurrences)      # one ledger row per slot
    assert {o["outcome"] for o in occurrences} == {"admitted"}
    assert len({r["occurrence_id"] for r in runs}) == len(runs) >= 3        # one run per slot
    starts = [r for w, r, _ in ledger_lines(ledger) if w == "start"]
    assert len(starts) == len(set(starts))                                  # none started twice


def test_a_node_leaves_runs_of_a_repository_it_cannot_reach_to_the_others(nodes, git_repo, tmp_path):
    a, b = nodes
    elsewhere = make_repo(tmp_path / "only-on-b")
    first = queue(a, elsewhere, 1)[0]
    second = queue(a, git_repo, 1)[0]
    assert call(a, a.runs.queued_repositories) == sorted([str(elsewhere), str(git_repo)])
    assert [r for r, _ in call(a, a.runs.admit_ready, 2, NOW, unreachable=[str(elsewhere)])] == [second]
    assert [r for r, _ in call(b, b.runs.admit_ready, 2, NOW)] == [first]   # FIFO for the node that reaches it


async def test_a_node_stops_at_once_while_a_repository_s_shared_mount_hangs(nodes, git_repo, tmp_path, monkeypatch):
    """docs/fleet.md: whether a run's repository path is reachable is asked off the event loop; a
    mount that hangs there must not hold up the node's shutdown either."""
    a, _ = nodes
    mount = make_repo(tmp_path / "on-a-hung-mount")
    queue(a, mount, 1)
    asked, release = threading.Event(), threading.Event()
    is_dir = Path.is_dir

    def hanging_is_dir(path: Path) -> bool:
        if path == mount:
            asked.set()
            release.wait(60)
        return is_dir(path)

    monkeypatch.setattr(Path, "is_dir", hanging_is_dir)
    deps = make_deps(tmp_path / "a", store=a, clock=outpost.WallClock(), inline_db=True)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(outpost.claim_actor, deps)
                await trio.to_thread.run_sync(asked.wait)
                nursery.cancel_scope.cancel()   # the claim actor is asking the hung mount now
    finally:
        release.set()


def test_a_cancel_sent_to_another_node_ends_the_agent_where_it_runs(tmp_path, database, git_repo, server_factory):
    ledger = tmp_path / "ledger"
    a = Node(tmp_path, "a", database, ledger, max_running=1, sleep_s=60).start(server_factory)
    b = Node(tmp_path, "b", database, ledger, max_running=1, sleep_s=60).start(server_factory)
    with a.client() as ca, b.client() as cb:
        run_id = dispatch(ca, git_repo)
        wait_for(lambda: any(w == "start" and r == run_id for w, r, _ in ledger_lines(ledger)), timeout_s=30)
        runner, other = (ca, cb) if ca.get(f"/v1/outpost/runs/{run_id}").json()["node"] == "a" else (cb, ca)
        reply = other.post(f"/v1/outpost/runs/{run_id}/control", json={"action": "cancel"},
                           headers={"Idempotency-Key": uuid.uuid4().hex})
        assert reply.status_code == 200, reply.text
        run = wait_for(lambda: settled(runner, [run_id]), timeout_s=15, interval_s=0.2)[0]
        paused = other.post(f"/v1/outpost/runs/{run_id}/control", json={"action": "pause"},
                            headers={"Idempotency-Key": uuid.uuid4().hex})
    assert run["status"] == "cancelled"
    assert not any(w == "end" and r == run_id for w, r, _ in ledger_lines(ledger))   # ended, not finished
    assert paused.status_code == 409


def test_a_second_process_under_a_live_node_s_name_is_refused(tmp_path, database, git_repo, server_factory):
    ledger = tmp_path / "ledger"
    a = Node(tmp_path, "same", database, ledger).start(server_factory)
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "outpost.toml").write_text('[settings]\nnode_name = "same"\n')
    serve = [sys.executable, str(Path(outpost.__file__)), "serve", "--data-dir", str(twin), "--port", "0",
             "--database", database]
    refused = subprocess.run(serve, capture_output=True, text=True, timeout=60)   # on this machine: known alive
    assert refused.returncode == 2, refused.stderr
    assert "node name 'same' is held by another running process" in refused.stderr
    assert f"pid {a.server.proc.pid} " in refused.stderr and "Traceback" not in refused.stderr
    a.server.stop(signal.SIGKILL)   # killed: the name's holder has ended; the next process takes it at once
    started = time.monotonic()
    again = server_factory("--database", database, data_dir=twin)
    assert time.monotonic() - started < outpost.NODE_LOST_S, again.logs()
    with again.client() as client:
        assert {n["name"]: n["status"] for n in client.get("/v1/outpost/nodes").json()["nodes"]} == {"same": "up"}


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat: T is stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_pause_sent_to_another_node_stops_the_agent_where_it_runs(tmp_path, database, git_repo, server_factory):
    """docs/http-api.md: a running run can always be paused: sent to a node that is not running it, the
    pause is recorded there and the node that runs the agent stops it; resume continues it."""
    ledger = tmp_path / "ledger"
    a = Node(tmp_path, "a", database, ledger, max_running=1, sleep_s=60).start(server_factory)
    b = Node(tmp_path, "b", database, ledger, max_running=1, sleep_s=60).start(server_factory)
    with a.client() as ca, b.client() as cb:
        run_id = dispatch(ca, git_repo)
        wait_for(lambda: any(w == "start" and r == run_id for w, r, _ in ledger_lines(ledger)), timeout_s=30)
        other = cb if ca.get(f"/v1/outpost/runs/{run_id}").json()["node"] == "a" else ca

        def control(action: str) -> httpx.Response:
            return other.post(f"/v1/outpost/runs/{run_id}/control", json={"action": action},
                              headers={"Idempotency-Key": uuid.uuid4().hex})
        import psycopg2
        connection = psycopg2.connect(database)
        cursor = connection.cursor()
        cursor.execute('SELECT pid FROM "Run" WHERE id = %s', (run_id,))
        (pid,) = cursor.fetchone()
        connection.close()
        paused = control("pause")
        assert paused.status_code == 200 and paused.json()["status"] == "paused", paused.text
        wait_for(lambda: process_state(pid) == "T", timeout_s=15)   # stopped by the node that runs it
        resumed = control("resume")
        assert resumed.status_code == 200, resumed.text
        wait_for(lambda: other.get(f"/v1/outpost/runs/{run_id}").json()["status"] == "running", timeout_s=15)
        wait_for(lambda: process_state(pid) != "T", timeout_s=15)
        assert control("cancel").status_code == 200
        run = wait_for(lambda: settled(other, [run_id]), timeout_s=30, interval_s=0.2)[0]
    assert run["status"] == "cancelled"


def test_a_node_that_cannot_fetch_a_url_leaves_its_run_queued_for_a_node_that_can(
        tmp_path, database, git_repo, server_factory):
    """Defect 9b: a node that could not fetch a run's URL admitted it and failed it (a failure of
    the schedule's streak). Now it puts the run back in the queue, stops taking that URL's runs for
    a while, and a node that reaches the URL runs it."""
    work = make_repo(tmp_path / "work")
    bare = tmp_path / "remote.git"
    subprocess.run(["git", "clone", "--quiet", "--bare", str(work), str(bare)], check=True)
    url = f"file://{bare}"
    ledger = tmp_path / "ledger"
    b = Node(tmp_path, "b", database, ledger, max_running=1, sleep_s=60).start(server_factory)
    with b.client() as cb:
        holder = dispatch(cb, git_repo)   # b's one slot is taken: only a can admit the next run
        wait_for(lambda: any(w == "start" and r == holder for w, r, _ in ledger_lines(ledger)), timeout_s=30)
        a = Node(tmp_path, "a", database, ledger, max_running=1)
        a.env["GIT_ALLOW_PROTOCOL"] = "https"   # a's git refuses file:// URLs: a cannot reach the remote
        a.start(server_factory)
        reply = cb.post("/v1/outpost/dispatches", headers={"Idempotency-Key": uuid.uuid4().hex},
                        json={"brief": "@print fetched", "repository": url, "agent": "demo"})
        assert reply.status_code == 202, reply.text
        run_id = reply.json()["run_id"]

        def requeued() -> bool:
            events = cb.get("/v1/outpost/events?limit=1000").json()["events"]
            return any(e["type"] == "run.requeued" and e["data"]["run_id"] == run_id for e in events)
        wait_for(requeued, timeout_s=30)   # a took it, could not fetch, and put it back
        assert cb.get(f"/v1/outpost/runs/{run_id}").json()["status"] == "queued"
        cancel = cb.post(f"/v1/outpost/runs/{holder}/control", json={"action": "cancel"},
                         headers={"Idempotency-Key": uuid.uuid4().hex})
        assert cancel.status_code == 200, cancel.text
        run = wait_for(lambda: settled(cb, [run_id]), timeout_s=60, interval_s=0.2)[0]
    assert (run["status"], run["node"]) == ("succeeded", "b"), run
    assert "fetched" in cb_log(b, run_id)
    assert "Traceback" not in a.server.logs()


def cb_log(node: Node, run_id: str) -> str:
    with node.client() as client:
        return client.get(f"/v1/outpost/runs/{run_id}/log").text

"""10,000 queued wakeups across 50 agents drain with every agent's concurrency and cooldown
respected and none lost.

The real Store on a temp file, driven the way the claim actor drives it, with a null
executor instead of agent processes and a virtual clock instead of the wall: each step runs
``dispatch_wakeups`` until it processes nothing, admits every run it may
(``admit_next``), settles the runs whose (random, 0-3 s) duration is over
(``settle_run``, succeeded; the null agent of a task-scoped run first moves its task to Done,
as an agent does through the API with its run's context), then advances ``now`` by a second,
or jumps to the next thing that can happen (``next_wakeup_at``, an arrival) when nothing is
claimable or running.

The wakeups are the three kinds that behave differently in the queue:

- task-scoped (``create_task`` with an assignee -> ``task_assigned``): one task each, so
  none merge, and an agent with max_concurrent_sessions 3 really holds three sessions;
- taskless ``user`` wakeups: same agent, same scope, so they merge (into a queued one within
  the coalescing window, into a claimed one whose run has not started, or at claim time);
- taskless ``self`` wakeups with a ``wake_at`` up to two minutes ahead: never merged, claimed
  only once due, so the clock has to jump to them.

Half are queued before the drain starts, the rest arrive during it. After every dispatch
transaction the checker asserts: no agent holds more claimed wakeups than its
max_concurrent_sessions; every wakeup claimed in it belongs to an agent whose
last_wakeup_finished_at + cooldown_sec <= now. Every settlement is the run's first (a
second one answers False and writes nothing). At the end: nothing queued or claimed, every
wakeup finished or coalesced into a finished one that holds its run, one run per finished
wakeup, each settled once, and the event stream tells the same story.

Size: OUTPOST_TORTURE_WAKEUPS (default 2000; the issue's figure is 10000)."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections import Counter
from datetime import datetime, timedelta

from conftest import T0, ended

import outpost

N_WAKEUPS = int(os.environ.get("OUTPOST_TORTURE_WAKEUPS", "2000"))
N_AGENTS = 50
#: The run admission limit: below the agents' total sessions, so runs also wait to start.
MAX_RUNNING = 32
COOLDOWNS_S = (0, 1, 5, 10)
SELF_WAKE_AHEAD_S = 120
PROFILES = {"demo": outpost.demo_profile()}


class Office:
    """The store, the 50 agents and what the checker remembers between transactions."""

    def __init__(self, store: outpost.Store, repo: str):
        self.store = store
        current = store.transaction(store.office.office_settings, None)[0]
        settings = outpost.normalize_settings({"repository": repo}, profiles=PROFILES, current=current)
        store.transaction(store.office.update_office_settings, None, settings)
        self.agents: dict[str, dict] = {}
        for i in range(N_AGENTS):
            raw = {"name": f"agent-{i:02d}", "executor": "demo", "max_concurrent_sessions": 1 + i % 3,
                   "cooldown_sec": COOLDOWNS_S[(i // 3) % len(COOLDOWNS_S)]}
            a = store.transaction(store.office.create_agent, None, outpost.normalize_agent(raw, profiles=PROFILES),
                                  T0)[0]
            self.agents[a["id"]] = a
        self.ids = list(self.agents)
        self.cursor = store.transaction(store.latest_cursor)[0]
        self.claimed_by_event: dict[str, str] = {}     # wakeup -> run, from wakeup.claimed events
        self.settled_events: Counter[str] = Counter()  # run -> run.settled events
        self.max_seen: Counter[str] = Counter()        # agent -> most claimed wakeups at once
        self.check_s = 0.0                             # wall time spent checking, not draining

    @contextlib.contextmanager
    def checking(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.check_s += time.perf_counter() - t0

    def select(self, sql: str, params: dict | None = None) -> list:
        return self.store.transaction(lambda: self.store.db.select(sql, params or {}))[0]

    def last_finished(self) -> dict[str, datetime | None]:
        return {aid: outpost.sql_instant(last) if last else None
                for aid, last in self.select('SELECT id, last_wakeup_finished_at FROM "Agent"')}

    def new_events(self) -> list[dict]:
        page = self.store.transaction(self.store.events_after, self.cursor, 100_000)[0]
        self.cursor = page["next_cursor"]
        return page["events"]

    def check_after_dispatch(self, now: datetime, before: dict[str, datetime | None]) -> None:
        """Concurrency from the table; cooldown from the claims this transaction made."""
        for agent_id, claimed in self.select('SELECT agent_id, COUNT(*) FROM "Wakeup" WHERE status = \'claimed\' '
                                             "GROUP BY agent_id"):
            cap = self.agents[agent_id]["max_concurrent_sessions"]
            assert claimed <= cap, f"agent {agent_id} holds {claimed} claimed wakeups, max {cap} (at {now})"
            self.max_seen[agent_id] = max(self.max_seen[agent_id], claimed)
        for e in self.new_events():
            self.note(e)
            if e["type"] != "wakeup.claimed":
                continue
            agent_id, last = e["data"]["agent_id"], before[e["data"]["agent_id"]]
            cooldown = timedelta(seconds=self.agents[agent_id]["cooldown_sec"])
            assert last is None or last + cooldown <= now, (
                f"agent {agent_id} claimed {e['data']['wakeup_id']} at {now}, in its cooldown "
                f"(last finished {last}, cooldown {cooldown})")

    def note(self, e: dict) -> None:
        if e["type"] == "wakeup.claimed":
            assert e["data"]["wakeup_id"] not in self.claimed_by_event, f"wakeup claimed twice: {e}"
            self.claimed_by_event[e["data"]["wakeup_id"]] = e["data"]["run_id"]
        elif e["type"] == "run.settled":
            self.settled_events[e["data"]["run_id"]] += 1

    def arrive(self, i: int, now: datetime) -> None:
        """Wakeup i, as the product makes it: one transaction, like one request or event."""
        store, agent_id = self.store, self.ids[i % N_AGENTS]
        kind = i % 10
        if kind < 6:
            fields = outpost.normalize_task({"title": f"task {i}", "assignee_agent_id": agent_id}, profiles=PROFILES)
            store.transaction(store.office.create_task, None, fields, now)
        elif kind < 8:
            store.transaction(store.wakeups.enqueue_wakeup, outpost.DEFAULT_WORKSPACE, agent_id,
                              outpost.WakeupSource.USER,
                      {"user_id": "u", "context": f"n{i}"}, now)
        else:
            ahead = timedelta(seconds=random.Random(i).randint(0, SELF_WAKE_AHEAD_S))
            store.transaction(store.wakeups.enqueue_wakeup, outpost.DEFAULT_WORKSPACE, agent_id,
                              outpost.WakeupSource.SELF,
                      {"reason": f"n{i}"}, now, wake_at=now + ahead)


def drain(office: Office, n: int, rng: random.Random) -> dict:
    store = office.store
    arrivals = sorted(rng.uniform(0, n / N_AGENTS * 4) for _ in range(n - n // 2))
    arrivals = [T0 + timedelta(seconds=s) for s in arrivals]
    now = T0
    for i in range(n // 2):
        office.arrive(i, now)
    next_i = n // 2
    running: dict[str, datetime] = {}   # run -> when its null agent is done
    steps = settled = resettled = 0
    t0 = time.perf_counter()
    while True:
        steps += 1
        assert steps < 50 * n, "the drain does not end"
        while arrivals and arrivals[0] <= now:
            arrivals.pop(0)
            office.arrive(next_i, now)
            next_i += 1
        processed_total = 0
        while True:
            with office.checking():
                before = office.last_finished()
            _, processed = store.transaction(store.pipeline.dispatch_wakeups, now, PROFILES)[0]
            with office.checking():
                office.check_after_dispatch(now, before)
            processed_total += processed
            if not processed:
                break
        while (admitted := store.transaction(store.runs.admit_next, MAX_RUNNING, now)[0]) is not None:
            run_id, is_resume = admitted
            assert not is_resume and run_id not in running
            running[run_id] = now + timedelta(seconds=rng.choice((0, 0, 1, 2, 3)))
        for run_id in [r for r, done_at in running.items() if done_at <= now]:
            del running[run_id]
            ctx = store.transaction(store.office.run_agent_context, run_id)[0]   # what its run token speaks for
            assert ctx is not None, f"run {run_id} is not running"
            if ctx["task_id"]:   # the null agent finishes its task, as an agent does through the API
                store.transaction(store.office.move_task, ctx["task_id"], outpost.TaskState.DONE, now,
                                  by_agent=ctx["agent_id"], workspace_id=ctx["workspace_id"])
            ok, wrote = store.transaction(store.runs.settle_run, run_id, ended(outpost.RunStatus.SUCCEEDED), now,
                                          exit_code=0)
            assert ok and wrote, f"run {run_id} was already settled"
            settled += 1
            if settled % 10 == 0:   # a second settlement changes nothing
                with office.checking():
                    again = store.transaction(store.runs.settle_run, run_id,
                                              ended(outpost.RunStatus.FAILED, error="late"), now)
                assert again == (False, False), f"run {run_id} settled twice: {again}"
                resettled += 1
        with office.checking():
            for e in office.new_events():
                office.note(e)
        left = office.select("SELECT COUNT(*) FROM \"Wakeup\" WHERE status IN ('queued', 'claimed')")[0]
        if not left and not arrivals and not running:
            break
        if processed_total or running:
            now += timedelta(seconds=1)
            continue
        wake = store.transaction(store.office.next_wakeup_at, now)[0]
        upcoming = [t for t in (wake, arrivals[0] if arrivals else None) if t is not None]
        assert upcoming, f"{left} wakeups left, nothing claimable, nothing due: stalled at {now}"
        now = max(now + timedelta(milliseconds=1), min(upcoming))
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "checking": office.check_s, "steps": steps, "settled": settled, "resettled": resettled,
            "virtual_s": (now - T0).total_seconds()}


def check_end_state(office: Office, n: int) -> Counter:
    rows = office.select('SELECT id, agent_id, status, run_id, coalesced_into, coalesced_count FROM "Wakeup"')
    assert len(rows) == n, f"{len(rows)} wakeups stored for {n} made"
    by_id = {r[0]: r for r in rows}
    statuses = Counter(r[2] for r in rows)
    assert set(statuses) <= {"finished", "coalesced"}, statuses
    runs = dict(office.select('SELECT id, status FROM "Run" WHERE trigger = \'wakeup\''))
    office_runs = dict(office.select('SELECT run_id, wakeup_id FROM "OfficeRun"'))
    assert set(runs) == set(office_runs)
    assert set(runs.values()) == {"succeeded"}, Counter(runs.values())
    finished = [r for r in rows if r[2] == "finished"]
    assert len({r[3] for r in finished}) == len(finished) == len(runs), "one run per finished wakeup"
    merged_into: Counter[str] = Counter()
    for wid, agent_id, status, run_id, into, _count in rows:
        if status == "finished":
            assert run_id in runs and office_runs[run_id] == wid, f"wakeup {wid} and run {run_id} disagree"
            assert office.claimed_by_event.get(wid) == run_id
        else:
            target = by_id.get(into)
            assert target is not None and target[2] == "finished", f"{wid} merged into {into}, which did not finish"
            assert run_id == target[3], f"{wid} was served by run {run_id}, its target by {target[3]}"
            assert target[1] == agent_id, f"{wid} merged across agents"
            merged_into[into] += 1
    for wid, *_rest, count in finished:
        assert count == 1 + merged_into[wid], f"wakeup {wid}: coalesced_count {count}, merged {merged_into[wid]}"
    assert all(office.settled_events[r] == 1 for r in runs), "a run.settled event per run, once"
    assert sum(office.settled_events.values()) == len(runs)
    statuses = dict(office.select('SELECT status, COUNT(*) FROM "Agent" GROUP BY status'))
    assert statuses == {"idle": N_AGENTS}, statuses
    tasks = office.select('SELECT state, checkout_agent_id IS NULL, COUNT(*) FROM "Task" GROUP BY 1, 2')
    assert [(state, free) for state, free, _ in tasks] == [("DONE", 1)], f"tasks left open or locked: {tasks}"
    return Counter({"finished": len(finished), "coalesced": len(rows) - len(finished)})


def test_wakeups_drain_with_concurrency_and_cooldown_respected_and_none_lost(tmp_path):
    store = outpost.Store(tmp_path / "outpost.sqlite3")
    try:
        office = Office(store, str(tmp_path / "repo"))   # nothing is spawned: no git needed
        stats = drain(office, N_WAKEUPS, random.Random(20261130))
        ends = check_end_state(office, N_WAKEUPS)
    finally:
        store.close()
    sessions = max(office.max_seen[a] for a, f in office.agents.items() if f["max_concurrent_sessions"] == 3)
    assert sessions == 3, "an agent allowed three sessions held three at once"
    rate = N_WAKEUPS / stats["elapsed"]
    own = N_WAKEUPS / (stats["elapsed"] - stats["checking"])
    print(f"\n{N_WAKEUPS} wakeups across {N_AGENTS} agents drained in {stats['elapsed']:.1f} s wall = "
          f"{rate:.0f} wakeups/s ({own:.0f}/s without the checker's {stats['checking']:.1f} s); "
          f"{ends['finished']} runs, {ends['coalesced']} coalesced; {stats['steps']} steps over "
          f"{stats['virtual_s']:.0f} s of virtual time; {stats['resettled']} second settlements refused")

"""Evidence for the rows of run.py that miss their target: where the time goes. outpost.py is
never modified; the store's methods are wrapped with timers, or `outpost serve` is driven with
requests that stop at different depths.

Usage::

    .venv/bin/python tests/bench/profile_misses.py \
        [wakeup_drain,intake,webhook_fires,fire_lag,housekeeping,housekeeping_full]

Prints one section per row. About two minutes and a half; only 127.0.0.1; bounded.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as B  # noqa: E402  (the benchmark's helpers)

import outpost  # noqa: E402

#: The store methods whose time the wakeup drain's section reports (a method's time includes
#: the methods it calls, and the flush of the Pony changes made before its first query).
TIMED = ("enqueue_wakeup", "dispatch_wakeups", "_claimable_wakeups", "process_wakeup", "task_facts",
         "office_prompt", "queue_run", "settle_run", "_settle_office_run", "release_checkout",
         "end_wakeup", "active_sessions", "admit_ready")


def statement_kind(sql: str) -> str:
    """SELECT, or a write with its table ("INSERT Event")."""
    words = sql.split()
    verb = words[0].upper() if words else "?"
    if verb in ("INSERT", "UPDATE", "DELETE") and '"' in sql:
        return f"{verb} {sql.split(chr(34))[1]}"
    return verb


def timed_store_methods() -> tuple[collections.Counter, collections.Counter]:
    spent, calls = collections.Counter(), collections.Counter()
    for name in TIMED:
        part = next(c for c in (outpost.Store, *outpost.StorePart.__subclasses__()) if hasattr(c, name))
        fn = getattr(part, name)

        @functools.wraps(fn)
        def timer(*args, fn=fn, name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1
        setattr(part, name, timer)
    return spent, calls


def wakeup_drain(work: Path) -> None:
    """The wakeup drain row at 1,000 wakeups, each store method's time per wakeup."""
    n = 1000
    repo = B.make_repo(work / "repo")
    tpl = work / "tpl"
    tpl.mkdir()
    pairs = B.office_template(tpl, repo, n)
    shutil.copytree(tpl, work / "run")
    spent, calls = timed_store_methods()
    statements = collections.Counter()
    real_connect = sqlite3.connect

    def traced_connect(*args, **kwargs):   # every connection Pony opens, the writer thread's too
        connection = real_connect(*args, **kwargs)
        connection.set_trace_callback(lambda sql: statements.update([statement_kind(sql)]))
        return connection
    sqlite3.connect = traced_connect
    try:
        figures = B.outpost_wakeup_drain(work / "run", pairs)
    finally:
        sqlite3.connect = real_connect
    print(f"  enqueue {figures['enqueue']:.0f}/s, drain {figures['drain']:.0f}/s, end to end {figures['e2e']:.0f}/s")
    print(f"  {'store method':22} {'us per wakeup':>14} {'calls':>7}")
    for name, seconds in spent.most_common():
        print(f"  {name:22} {seconds / n * 1e6:14.0f} {calls[name]:7d}")
    print(f"  {'statement':22} {'per wakeup':>14}")
    for kind, count in statements.most_common(12):
        print(f"  {kind:22} {count / n:14.2f}")
    print("  A wakeup is three store calls (enqueue, its claim through the twelve steps, its settlement);\n"
          "  the claim and the settlement load about seven Pony rows (wakeup, agent, task, office run) at\n"
          "  100-150 us each. Huey's whole cycle is two small SQL statements; the counts above are\n"
          "  the contract's: six events, the checkout lock taken and released, the agent's status.")


async def rate(port: int, method: str, path: str, headers: dict[str, str], body: bytes, n: int, tag: str | None):
    el, statuses = await B.http_load(port, method, path, headers, [body] * n, B.BURST, tag)
    return n / el, statuses


def intake(work: Path) -> None:
    """The same server answering requests that stop at different depths: what each step costs."""
    repo = B.make_repo(work / "repo")
    n = 600
    body = json.dumps({"brief": "bench intake", "repository": str(repo), "agent": "hold"}).encode()
    refused = json.dumps({"brief": "", "repository": str(repo), "agent": "hold"}).encode()
    with B.Server(work / "data", max_running=1, toml=B.HOLD_TOML) as srv:
        asyncio.run(rate(srv.port, "POST", "/v1/outpost/dispatches", srv.headers(), body, 50, "warm"))
        rows = [("GET /healthz (event loop only)", "GET", "/healthz", {}, b"", None),
                ("POST dispatch without a token: 401", "POST", "/v1/outpost/dispatches", {}, body, None),
                ("GET one run: one store call", "GET", "/v1/outpost/runs?limit=1", srv.headers(), b"", None),
                ("POST dispatch refused: key, 422, key", "POST", "/v1/outpost/dispatches", srv.headers(), refused,
                 "r"),
                ("POST dispatch: key, ref, run + answer", "POST", "/v1/outpost/dispatches", srv.headers(), body, "d")]
        for label, method, path, headers, payload, tag in rows:
            rates = [asyncio.run(rate(srv.port, method, path, headers, payload, n, tag and f"{tag}{i}"))[0]
                     for i in range(3)]
            print(f"  {label:40} {statistics.median(rates):7.0f} req/s")
    print("  Each store call a request makes costs its share of a group commit and a hop to the writer\n"
          "  thread, under the one GIL with the event loop: a dispatch makes two (the Idempotency-Key\n"
          "  reservation, then the run with its stored answer) and asks the resident cat-file once.")


def fire_lag(work: Path) -> None:
    """One claim at a time in the store, as the cron actor makes it: its CPU and its commit."""
    repo = B.make_repo(work / "repo")
    store = outpost.Store(work / "o.sqlite3")
    B.add_far_schedules(store, repo, 160)
    start = B.now_utc()
    dues = [start + timedelta(seconds=i) for i in range(40)]
    B.add_interval_due(store, repo, dues)
    whole, commits = [], []
    real_commit = outpost.orm.core.SessionCache.commit

    def timed_commit(cache):
        t0 = time.perf_counter()
        try:
            return real_commit(cache)
        finally:
            commits.append(time.perf_counter() - t0)
    outpost.orm.core.SessionCache.commit = timed_commit
    for due in dues:
        t0 = time.perf_counter()
        (written,) = store.transactions([functools.partial(store.schedules.claim_due, due, digests={}, heads={},
                                                           up_since=start)])
        whole.append(time.perf_counter() - t0)
        assert len(written.result) == 1, written
    outpost.orm.core.SessionCache.commit = real_commit
    store.close()
    print(f"  claim transaction p50 {statistics.median(whole) * 1000:.2f} ms, of which its commit "
          f"{statistics.median(commits) * 1000:.2f} ms (synchronous=FULL)")
    print("  The claim writes the schedule's next fire, a ledger row, a run (nine indexes) and its events:\n"
          "  a dozen pages to the WAL and one fsync, where the bare loop writes one row. Meeting 1.5x would\n"
          "  take the fire's rows written before the due instant, leaving one short write at it.")


def housekeeping(work: Path, full: bool = False) -> None:
    """The year's housekeeping pass (run.py's year row, --quick size: the cached 100,000 runs;
    ``housekeeping_full``: the 1 M runs): each HousekeepingStore call timed in a real
    ``housekeeping_pass`` (Deps inline, no server), then the query plans of its SQL and their
    time at the first and a middle batch."""
    import trio
    year = B.year_history(not full)
    d = B.year_copy(year, work / "data")
    con = sqlite3.connect(d / "outpost.sqlite3")
    oldest = con.execute('SELECT MIN(finished_at) FROM "Run"').fetchone()[0]
    con.close()
    keep_days = (B.now_utc().replace(tzinfo=None) - B.datetime.fromisoformat(oldest)).days - 36
    store = outpost.Store(d / "outpost.sqlite3", data_dir=d)
    hk = store.housekeeping
    took: dict[str, list[float]] = collections.defaultdict(list)
    def timer(name: str):
        real = getattr(hk, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                took[name + (f"({args[0]})" if name == "delete_history" else "")].append(time.perf_counter() - t0)
        return timed
    for name in ("old_runs", "branches_in_use", "delete_runs", "delete_history", "give_back_space"):
        setattr(hk, name, timer(name))
    config = outpost.Config(data_dir=d, agents=(outpost.demo_profile(),))
    deps = outpost.Deps(config=config, store=store, clock=outpost.WallClock(), token="bench", inline_db=True)
    t0 = time.perf_counter()
    counts = trio.run(functools.partial(outpost.housekeeping_pass, deps, keep_days, dry_run=False))
    print(f"  pass keep_days {keep_days}: {time.perf_counter() - t0:.1f} s, {counts}")
    print("  each call holds the one writer (API reads included) for its whole time:")
    for name, v in sorted(took.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {name:28} {len(v):5} calls  {sum(v):6.1f} s  p50 {statistics.median(v) * 1000:7.1f} ms  "
              f"max {max(v) * 1000:7.1f} ms")
    store.close()
    # The plans, on a fresh copy (the same rows as before the pass).
    d2 = B.year_copy(year, work / "plans")
    con = sqlite3.connect(d2 / "outpost.sqlite3")
    cutoff = B.sql_t(B.now_utc() - B.timedelta(days=keep_days))
    gone = outpost.HousekeepingStore._gone(None, "r").replace("$cutoff", ":cutoff")
    mid = con.execute('SELECT id FROM "Run" WHERE finished_at < ? ORDER BY id LIMIT 1 OFFSET 5000',
                      (cutoff,)).fetchone()[0]
    ids = [r[0] for r in con.execute('SELECT id FROM "Run" WHERE id > ? ORDER BY id LIMIT 100', (mid,))]
    listed = ",".join(f":i{k}" for k in range(len(ids)))
    last = con.execute('SELECT id FROM "Run" WHERE queued_at < ? ORDER BY queued_at DESC LIMIT 1',
                       (cutoff,)).fetchone()[0]
    old_events = con.execute('SELECT cursor FROM "Event" WHERE at < ? ORDER BY at DESC LIMIT 1',
                             (cutoff,)).fetchone()[0]
    params = {"cutoff": cutoff, "after": mid, "last": last[:last.index("_") + 11] + "~", "last_event": old_events,
              **{f"i{k}": v for k, v in enumerate(ids)}}
    queries = {
        "old_runs (a batch of 100 mid-pass)": f'SELECT r.id FROM "Run" r WHERE r.id > :after AND r.id <= :last '
                                             f"AND {gone} "
                                             "ORDER BY r.id LIMIT 100",
        "delete_runs' WHERE (as a SELECT)": f'SELECT id FROM "Run" r WHERE r.id IN ({listed}) AND {gone}',
        "branches_in_use (the batch's branches)": f'SELECT DISTINCT result_branch FROM "Run" r WHERE result_branch '
                                                  f"IN (SELECT result_branch FROM \"Run\" WHERE id IN ({listed})) "
                                                  f"AND NOT ({gone})",
        "delete_runs' Attention delete (as a SELECT)": f'SELECT 1 FROM "Attention" WHERE run_id IN ({listed})',
    }
    hk_sql = outpost.HousekeepingStore.__new__(outpost.HousekeepingStore)
    hk_sql.__dict__["dialect"] = outpost.Dialect()
    for what in ("events", "occurrences"):
        table, key, where = outpost.HousekeepingStore._history(hk_sql, what, False)   # a real pass's
        for mark, name in (("$$", "$"), ("$cutoff", ":cutoff"), ("$latest", ":latest"),
                           ("$keep_offset", ":keep_offset"), ("$last_event", ":last_event")):
            where = where.replace(mark, name)
        queries[f"delete_history({what}) batch (as a SELECT)"] = (f'SELECT {key} FROM "{table}" WHERE {where} '
                                                                  f"LIMIT {outpost.HOUSEKEEPING_ROWS}")
    params |= {"latest": 2**62, "keep_offset": outpost.LEDGER_KEEP - 1}
    for label, sql in queries.items():
        plan = [r[3] for r in con.execute("EXPLAIN QUERY PLAN " + sql, params)]
        t0 = time.perf_counter()
        con.execute(sql, params).fetchall()
        print(f"  {label}: {(time.perf_counter() - t0) * 1000:.0f} ms")
        for step in plan:
            print(f"      {step}")
    con.close()


def webhook_fires(work: Path) -> None:
    """The webhook-fires row's agent three ways, each on a server of its own with the one slot held
    (as in the row): 4 x 400 signed fires, 6 s apart, then /healthz. ``merged``: skip_idle_wakeups
    off, the fires merge into one wakeup claimed into a run queued behind the slot (the row's set-up);
    ``paused``: the agent paused, the fires merge into a queued wakeup (the coalescing window) that
    waits for it to be resumed; ``idle skip``: the dispatcher ends each wakeup by its idle skip,
    while the fires arrive, queuing again what merged into it."""
    import httpx
    for label, skip_idle, pause in (("merged", False, False), ("paused", True, True), ("idle skip", True, False)):
        d = work / label.replace(" ", "-")
        repo = B.make_repo(d / "repo")
        body = json.dumps({"brief": "x", "repository": str(repo), "agent": "hold"}).encode()
        with B.Server(d / "data", max_running=1, toml=B.HOLD_TOML) as srv:
            asyncio.run(B.http_load(srv.port, "POST", "/v1/outpost/dispatches", srv.headers(), [body] * 5, 2, "w"))
            with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30) as c:
                c.patch("/api/office/settings", json={"repository": str(repo)}).raise_for_status()
                agent = c.post("/api/office/agents", json={"name": "hook", "executor": "demo",
                                                           "skip_idle_wakeups": skip_idle}).json()["id"]
                routine = c.post("/api/office/routines", json={
                    "name": "w", "assignee_agent_id": agent, "concurrency_policy": "always_enqueue",
                    "variables": [{"name": "n", "type": "text"}],
                    "triggers": [{"kind": "webhook", "signing_mode": "hmac_sha256"}]}).json()
                if pause:
                    c.patch(f"/api/office/agents/{agent}", json={"status": "paused"}).raise_for_status()
            trigger = routine["triggers"][0]
            rates = []
            for i in range(4):
                bodies, sigs = B.signed_deliveries(trigger["secret"], str(i), 400)
                el, _ = asyncio.run(B.http_load(srv.port, "POST", trigger["fire_path"], {}, bodies, 16, None, sigs))
                rates.append(400 / el)
                time.sleep(6)
            hel, _ = asyncio.run(B.http_load(srv.port, "GET", "/healthz", {}, [b""] * 1500, 16, None))
            print(f"  {label:10} fires/s {[round(r) for r in rates]}, median {statistics.median(rates):.0f}; "
                  f"/healthz {1500 / hel:.0f}/s; wakeups still queued {B.queued_wakeups(srv)}")
    print("  A merge into the claimed wakeup builds its queued run's prompt again (office_prompt, Run.prompt);\n"
          "  the idle skip's drain runs beside the fires, one wakeup per transaction (before 2483253 each\n"
          "  skip queued again the k fires merged into it: ~n^2/2 writes for a burst of n).")


SECTIONS = {"wakeup_drain": wakeup_drain, "intake": intake, "webhook_fires": webhook_fires, "fire_lag": fire_lag,
            "housekeeping": housekeeping, "housekeeping_full": functools.partial(housekeeping, full=True)}


def main() -> int:
    chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SECTIONS)
    with tempfile.TemporaryDirectory(prefix="outpost-profile-") as tmp:
        for name in chosen:
            print(f"\n== {name}")
            work = Path(tmp) / name
            work.mkdir()
            SECTIONS[name](work)
    return 0


if __name__ == "__main__":
    sys.exit(main())

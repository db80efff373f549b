"""Evidence for the rows of run.py that miss their target: where the time goes. outpost.py is
never modified; the store's methods are wrapped with timers, or `outpost serve` is driven with
requests that stop at different depths.

Usage::

    .venv/bin/python tests/bench/profile_misses.py [wakeup_drain,intake,fire_lag]

Prints one section per row. About a minute; only 127.0.0.1; bounded.
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
TIMED = ("enqueue_wakeup", "dispatch_wakeups", "_claimable_wakeups", "process_wakeup", "_task_facts",
         "_office_prompt", "_queue_run", "settle_run", "_settle_office_run", "_release_checkout",
         "_end_wakeup", "_active_sessions", "admit_ready")


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


SECTIONS = {"wakeup_drain": wakeup_drain, "intake": intake, "fire_lag": fire_lag}


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

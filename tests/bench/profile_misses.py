"""Evidence for the rows of run.py that miss their target: where the time goes, and what the
proposed design change would buy. outpost.py is never modified: experiments monkeypatch a copy
of the process (a patched ``outpost serve`` launcher) or call the real store functions in a
different transaction shape.

Usage::

    .venv/bin/python tests/bench/profile_misses.py [fire_lag,intake,drain,dashboard,webhook]

Prints one section per miss. Takes about 2 minutes; only 127.0.0.1; bounded.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as B  # noqa: E402  (the benchmark's helpers)
import trio  # noqa: E402

import outpost  # noqa: E402

UTC = timezone.utc

# --- a patched `outpost serve` (the launcher mode of this file) --------------------------------


def patched_serve(argv: list[str]) -> int:
    """``outpost serve`` with counters and optional experiments (env BENCH_PATCH):
    ``gitcache``: check_repository/resolve_ref remembered per (repository, ref) for 5 s;
    ``nofsync``: PRAGMA synchronous=OFF on every connection (what the commits' fsyncs cost);
    ``probe``: Store._unstarted_target as two index probes (``task_id IS $t``, one status per
    branch) instead of a scan of every wakeup the agent ever had;
    ``hookcache``: the webhook route's trigger lookup (store.webhook_trigger) remembered per
    public id for 1 s, so a fire costs one transaction instead of two."""
    mode = os.environ.get("BENCH_PATCH", "")
    counts: collections.Counter[str] = collections.Counter()
    orig_run = outpost.Store.run

    def counting_run(self, fn, *a, **k):
        counts[getattr(fn, "__name__", "?")] += 1
        return orig_run(self, fn, *a, **k)
    outpost.Store.run = counting_run
    orig_git = outpost.git

    async def counting_git(repo, *args, check=True):
        counts[f"git {args[0]}"] += 1
        return await orig_git(repo, *args, check=check)
    outpost.git = counting_git
    if "gitcache" in mode:
        cache: dict[tuple, tuple] = {}
        orig_resolve, orig_check = outpost.resolve_ref, outpost.check_repository

        async def resolve_ref(repo, ref):
            hit = cache.get((repo, ref))
            if hit and time.monotonic() - hit[1] < 5:
                return hit[0]
            value = await orig_resolve(repo, ref)
            cache[(repo, ref)] = (value, time.monotonic())
            return value

        async def check_repository(d):
            key = ("check", d["repository"], d["source_ref"])
            if key in cache and time.monotonic() - cache[key][1] < 5:
                return
            await orig_check(d)
            cache[key] = (None, time.monotonic())
        outpost.resolve_ref, outpost.check_repository = resolve_ref, check_repository
    if "nofsync" in mode:   # how much of a request is waiting for the disk (a measurement, never a setting)
        orig_init = outpost.Store.__init__

        def init(self, path):
            orig_init(self, path)
            self.db.on_connect(provider="sqlite")(lambda _db, con: con.execute("PRAGMA synchronous=OFF"))
            self.db.disconnect()   # the writer thread's connection is opened later, with both hooks
        outpost.Store.__init__ = init
    if "probe" in mode:
        outpost.Store._unstarted_target = probe_unstarted_target
    if "hookcache" in mode:
        orig_db = outpost.Deps.db
        hooks: dict[str, tuple] = {}

        async def db(self, fn, *args, **kwargs):
            if getattr(fn, "__name__", "") != "webhook_trigger":
                return await orig_db(self, fn, *args, **kwargs)
            hit = hooks.get(args[0])
            if hit is None or time.monotonic() - hit[1] >= 1.0:
                hit = hooks[args[0]] = (await orig_db(self, fn, *args, **kwargs), time.monotonic())
            return hit[0]
        outpost.Deps.db = db
    try:
        return outpost.main(argv)
    finally:
        Path(os.environ["BENCH_COUNTS"]).write_text(json.dumps(counts))


UNSTARTED_AS_IS = (   # outpost.Store._unstarted_target's statement, task_id NULL (a taskless wakeup)
    'SELECT w.id FROM "Wakeup" w LEFT JOIN "Run" r ON r.id = w.run_id WHERE w.agent_id = ? '
    "AND (w.task_id = ? OR (w.task_id IS NULL AND ? IS NULL)) AND ((w.status = 'claimed' AND "
    "r.status = 'queued') OR (w.status = 'queued' AND w.scheduled_retry_at > ?)) "
    "ORDER BY w.requested_at LIMIT 1")
UNSTARTED_PROBE = (
    'SELECT id FROM (SELECT w.id, w.requested_at FROM "Wakeup" w JOIN "Run" r ON r.id = w.run_id '
    "WHERE w.agent_id = $a AND w.task_id IS $t AND w.status = 'claimed' AND r.status = 'queued' "
    'UNION ALL SELECT id, requested_at FROM "Wakeup" WHERE agent_id = $a AND task_id IS $t '
    "AND status = 'queued' AND scheduled_retry_at > $now) ORDER BY requested_at LIMIT 1")


def probe_unstarted_target(self, agent_id: str, task_id: str | None, now: datetime):
    """The same answer as Store._unstarted_target (``a = $t OR (a IS NULL AND $t IS NULL)`` is
    ``a IS $t``), written so that each branch is an index probe."""
    rows = self.db.select(UNSTARTED_PROBE, {"a": agent_id, "t": task_id, "now": outpost.sql_time(now)})
    return self.db.Wakeup[rows[0]] if rows else None


# --- sections ---------------------------------------------------------------------------------


def fire_lag(work: Path) -> None:
    """Full size (1,000 schedules, 200 due over 10 s). Splits each fire's lag into: the cron actor
    waking late (Occurrence.created_at - due), the claim transaction, and what the actor did
    between claims (resolve_new_runs: git rev-parse + 2 transactions, then next_fire_at)."""
    from pyinstrument import Profiler
    repo = B.make_repo(work / "repo")
    prof = Profiler(interval=0.0005)
    durs: list[float] = []
    gits: list[tuple[float, float]] = []
    orig_git = outpost.git

    async def timed_git(repo_, *args, check=True):
        t0 = time.time()
        try:
            return await orig_git(repo_, *args, check=check)
        finally:
            gits.append((t0, (time.time() - t0) * 1000))
    outpost.git = timed_git

    class Profiled(B.TimedStore):
        def transaction(self, fn, *a, **k):
            if getattr(fn, "__name__", "") != "claim_due":
                return super().transaction(fn, *a, **k)
            t0 = time.perf_counter()
            prof.start()
            try:
                return super().transaction(fn, *a, **k)
            finally:
                prof.stop()
                durs.append((time.perf_counter() - t0) * 1000)
    store = Profiled(work / "o.sqlite3")
    B.add_far_schedules(store, repo, 800)
    B.add_interval_due(store, repo, B.fire_instants(200, 10.0, 1.0))
    deps = outpost.Deps(config=outpost.Config(data_dir=work), store=store, clock=outpost.WallClock(), token="x")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps, deps.cron_wake.rx)
            await trio.sleep(12)
            nursery.cancel_scope.cancel()
    trio.run(main)
    outpost.git = orig_git
    with outpost.orm.db_session:
        rows = store.db.select('SELECT r.id, r.due_at, o.created_at FROM "Run" r JOIN "Occurrence" o '
                               'ON o.id = r.occurrence_id')
    store.close()
    committed = {rid: t for t, rids in store.claims for rid in rids}

    def ts(v) -> float:
        return datetime.fromisoformat(str(v)).replace(tzinfo=UTC).timestamp()
    wake = [(ts(c) - ts(d)) * 1000 for _, d, c in rows]
    total = sorted(((committed[r] - ts(d)) * 1000, ts(d)) for r, d, _ in rows)
    git_ms = [g for _, g in gits]
    print(f"fires {len(rows)}; lag p50 {B.pct([t for t, _ in total], 50):.1f} ms, "
          f"p99 {B.pct([t for t, _ in total], 99):.1f}, max {total[-1][0]:.1f}")
    print(f"  woke late (created_at - due): p50 {B.pct(wake, 50):.1f} ms, p99 {B.pct(wake, 99):.1f}, "
          f"max {max(wake):.1f}")
    print(f"  claim_due transaction (profiler on): p50 {statistics.median(durs):.2f} ms, "
          f"p99 {B.pct(durs, 99):.2f}, max {max(durs):.2f}")
    print(f"  git calls made by the cron actor between claims: {len(gits)}, p50 {statistics.median(git_ms):.1f} ms, "
          f"p99 {B.pct(git_ms, 99):.1f}, max {max(git_ms):.1f}")
    for lag, due in total[-3:]:
        before = [g for t0, g in gits if due - 0.5 < t0 < due]
        print(f"  worst fire: lag {lag:.1f} ms; git calls in the 0.5 s before its due instant: "
              f"{[round(g, 1) for g in before]}")
    print(prof.output_text(unicode=False, color=False, short_mode=True))


def intake(work: Path) -> None:
    launcher = work / "serve.sh"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --serve \"$@\"\n")
    launcher.chmod(0o755)
    B.OUTPOST_BIN = launcher
    for mode in ("", "gitcache", "nofsync", "gitcache,nofsync"):
        d = work / (mode.replace(",", "+") or "baseline")
        d.mkdir()
        os.environ["BENCH_PATCH"], os.environ["BENCH_COUNTS"] = mode, str(d / "counts.json")
        repo = B.make_repo(d / "repo")
        body = json.dumps({"brief": "bench intake", "repository": str(repo), "agent": "hold"}).encode()
        n = 300
        with B.Server(d / "data", max_running=1, toml=B.HOLD_TOML) as srv:
            rates = []
            for rep in range(3):
                el, st = asyncio.run(B.http_load(srv.port, "POST", "/v1/outpost/dispatches", srv.headers(),
                                                 [body] * n, 16, f"r{rep}"))
                assert set(st) == {202}, st
                rates.append(n / el)
        counts = json.loads((d / "counts.json").read_text())
        per = {k: round(v / (3 * n), 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if v >= n}
        print(f"{mode or 'baseline'}: {statistics.median(rates):.0f} dispatches/s "
              f"[{min(rates):.0f}..{max(rates):.0f}]; per request: {per}")


def drain(work: Path) -> None:
    repo = B.make_repo(work / "repo")
    n, agents_n = 5000, 50
    for batched in (False, True):
        store = outpost.Store(work / f"d{int(batched)}.sqlite3")
        B.queue_dispatches(store, B.dispatch_payload(repo), n)

        def admit_many(store: outpost.Store = store) -> list[str]:
            out = []
            while len(out) < agents_n:
                a = store.admit_next(agents_n, B.now_utc())
                if a is None:
                    break
                out.append(a[0])
            return out
        done, t0 = 0, time.perf_counter()
        while True:
            if batched:
                admitted = store.transaction(admit_many)[0]
                store.transaction(lambda ids=admitted, st=store: [
                    st.settle_run(r, B.SUCCESS, B.now_utc(), exit_code=0) for r in ids])
            else:
                admitted = []
                while len(admitted) < agents_n and (a := store.transaction(store.admit_next, agents_n, B.now_utc())[0]):
                    admitted.append(a[0])
                for r in admitted:
                    store.transaction(store.settle_run, r, B.SUCCESS, B.now_utc(), exit_code=0)
            if not admitted:
                break
            done += len(admitted)
        store.close()
        shape = ("50 admissions / 50 settlements per transaction" if batched
                 else "one transaction per admission and per settlement (today)")
        print(f"{shape}: {done / (time.perf_counter() - t0):.0f} runs/s")


def dashboard(work: Path) -> None:
    repo = B.make_repo(work / "repo")
    db = work / "outpost.sqlite3"
    store = outpost.Store(db)
    B.add_far_schedules(store, repo, 1000)
    ids = [s["id"] for s in store.transaction(store.list_schedules)[0]]
    B.queue_dispatches(store, B.dispatch_payload(repo), 1)
    store.close()
    B.bulk_runs(db, 100000, status="succeeded", schedule_ids=ids)
    store = outpost.Store(db)

    def timed(label: str, fn, *a) -> object:
        ts, result = [], None
        for _ in range(3):
            t0 = time.perf_counter()
            result = store.transaction(fn, *a)[0]
            ts.append((time.perf_counter() - t0) * 1000)
        print(f"  {label}: {statistics.median(ts):.1f} ms")
        return result
    print("GET /schedules today (store time):")
    schedules = timed("store.list_schedules (every Schedule entity hydrated)", store.list_schedules, False)
    timed("store.last_runs of every schedule (before 2026-11-30 the page asked for all)", store.last_runs,
          [s["id"] for s in schedules])
    timed("store.schedules_page(False, 1): what the page reads now, one transaction", store.schedules_page, False, 1)
    print("GET /runs today (store time):")
    timed("store.list_runs(None, None, 50)", store.list_runs, None, None, 50, None)
    timed("store.schedule_zones (every schedule hydrated)", store.schedule_zones)
    store.close()
    con = sqlite3.connect(db)
    one = ('SELECT s.id, s.name, s.definition, s.next_fire_at, '
           '(SELECT r.id FROM "Run" r WHERE r.schedule = s.id AND r.status IN (\'queued\',\'running\',\'paused\') '
           'ORDER BY r.queued_at LIMIT 1), '
           '(SELECT r.id || \'|\' || r.status || \'|\' || r.queued_at FROM "Run" r WHERE r.schedule = s.id '
           'ORDER BY r.id DESC LIMIT 1) FROM "Schedule" s WHERE s.archived = 0 ORDER BY s.created_at')

    def q(label: str, sql: str) -> None:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            rows = con.execute(sql).fetchall()
            if len(rows[0]) > 3:
                [json.loads(r[2]) for r in rows]
            ts.append((time.perf_counter() - t0) * 1000)
        print(f"  {label}: {statistics.median(ts):.1f} ms")
    print("proposed:")
    print("  plan of the per-schedule last-run query:",
          con.execute('EXPLAIN QUERY PLAN SELECT id FROM "Run" WHERE schedule = ? ORDER BY id DESC LIMIT 1',
                      ("x",)).fetchall())
    print("  plan of last_runs' GROUP BY:", con.execute(
        'EXPLAIN QUERY PLAN SELECT MAX(id) FROM "Run" WHERE schedule IS NOT NULL GROUP BY schedule').fetchall())
    q("last_runs' GROUP BY alone, current indexes",
      'SELECT MAX(id) FROM "Run" WHERE schedule IS NOT NULL GROUP BY schedule')
    q("one query for the whole schedules list, current indexes", one)
    con.execute('CREATE INDEX bench_run_schedule_id ON "Run"(schedule, id)')
    q("same + index Run(schedule, id)", one)
    q("last_runs' GROUP BY alone + index Run(schedule, id)",
      'SELECT MAX(id) FROM "Run" WHERE schedule IS NOT NULL GROUP BY schedule')
    q("schedule zones with json_extract (no hydration)",
      'SELECT id, name, json_extract(definition, \'$.timing.timezone\') FROM "Schedule"')
    con.close()


def webhook(work: Path) -> None:
    """The webhook-fire intake row (run.py ``durable intake (webhook fires)``). Over HTTP: fires/s
    in successive batches (the wakeup history grows), the server's CPU per fire (it is one
    GIL-bound process) and its store calls per fire, today and with the ``probe`` and
    ``hookcache`` patches. In-process, on the database the baseline server left: every SQL
    statement of one fire, timed; _unstarted_target as-is and as index probes; and the CPU of the
    route's two store calls per fire as the history grows, as-is and with ``probe``."""
    import psutil
    from pony.orm import dbapiprovider
    launcher = work / "serve.sh"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --serve \"$@\"\n")
    launcher.chmod(0o755)
    B.OUTPOST_BIN = launcher
    repo = B.make_repo(work / "repo")
    n, batches = 1000, 3
    for mode in ("", "probe,hookcache"):
        d = work / (mode.replace(",", "+") or "baseline")
        d.mkdir()
        os.environ["BENCH_PATCH"], os.environ["BENCH_COUNTS"] = mode, str(d / "counts.json")
        with B.Server(d / "data", max_running=1, toml=B.HOLD_TOML) as srv:
            fire_path, secret = B.webhook_routine(srv, repo)
            proc = psutil.Process(srv.proc.pid)
            rates, cpu = [], []
            for k in range(batches):
                bodies, sigs = B.signed_deliveries(secret, f"b{k}", n)
                c0 = sum(proc.cpu_times()[:2])
                el, st = asyncio.run(B.http_load(srv.port, "POST", fire_path, {}, bodies, 16, None, sigs))
                assert set(st) == {202}, st
                rates.append(n / el)
                cpu.append((sum(proc.cpu_times()[:2]) - c0) * 1000 / n)
            if not mode:
                c0 = sum(proc.cpu_times()[:2])
                el, st = asyncio.run(B.http_load(srv.port, "GET", "/healthz", {}, [b""] * 3000, 16, None))
                print(f"GET /healthz (no transaction): {3000 / el:.0f}/s, server CPU "
                      f"{(sum(proc.cpu_times()[:2]) - c0) * 1000 / 3000:.2f} ms per request")
        counts = json.loads((d / "counts.json").read_text())
        per = {k: round(v / (n * batches), 2) for k, v in counts.items() if v >= n}
        print(f"{mode or 'baseline'}: fires/s per successive {n}: {[round(r) for r in rates]}; server CPU per fire "
              f"{[round(c, 2) for c in cpu]} ms; store calls per fire {per}", flush=True)
    db = work / "baseline" / "data" / "outpost.sqlite3"
    con = sqlite3.connect(db)
    agent = con.execute('SELECT agent_id, COUNT(*) FROM "Wakeup" GROUP BY agent_id').fetchone()
    probe = UNSTARTED_PROBE.replace("$a", ":a").replace("$t", ":t").replace("$now", ":now")
    for label, sql, args in (("as-is", UNSTARTED_AS_IS, (agent[0], None, None, "2000-01-01")),
                             ("index probes", probe, {"a": agent[0], "t": None, "now": "2000-01-01"})):
        plan = [r[3] for r in con.execute("EXPLAIN QUERY PLAN " + sql, args)]
        t0 = time.perf_counter()
        for _ in range(100):
            con.execute(sql, args).fetchall()
        print(f"_unstarted_target {label} with {agent[1]} wakeups of history: "
              f"{(time.perf_counter() - t0) * 10:.3f} ms; plan {plan}")
    con.close()
    store = outpost.Store(db)
    public_id = public_id_of(store)
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    orig = dbapiprovider.DBAPIProvider.execute

    def timed(self, cursor, sql, arguments=None, returning_id=False):
        t0 = time.perf_counter()
        try:
            return orig(self, cursor, sql, arguments, returning_id)
        finally:
            s = stats[" ".join(sql.split())[:150]]
            s[0] += 1
            s[1] += time.perf_counter() - t0
    dbapiprovider.DBAPIProvider.execute = timed
    k = 300
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(k):   # the two transactions of the route: the trigger lookup, then the fire
        t = store.transaction(store.webhook_trigger, public_id, B.now_utc())[0]
        store.transaction(store.fire_webhook, t["trigger_id"], {"n": f"p{i}"}, f"hmac:p{i:062x}", 300, B.now_utc())
    el, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    dbapiprovider.DBAPIProvider.execute = orig
    store.close()
    in_sql = sum(v[1] for v in stats.values())
    print(f"in-process, the route's two store calls: {k / el:.0f} fires/s, {cpu_s * 1000 / k:.2f} ms CPU per fire, "
          f"{sum(v[0] for v in stats.values()) / k:.0f} statements per fire taking {in_sql * 1000 / k:.2f} ms "
          f"(the rest is Pony: entity loads, JSON columns wrapped in TrackedDict, datetime parsing, commit):")
    for sql, (c, s) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"  {s * 1000 / k:6.3f} ms  x{c / k:.0f}  {sql}")
    as_is = outpost.Store._unstarted_target
    for label, fn in (("as-is", as_is), ("probe", probe_unstarted_target)):
        outpost.Store._unstarted_target = fn
        copy = work / f"growth-{label}.sqlite3"
        shutil.copy(work / "probe+hookcache" / "data" / "outpost.sqlite3", copy)
        store = outpost.Store(copy)
        trigger_id = store.transaction(store.webhook_trigger, public_id_of(store), B.now_utc())[0]["trigger_id"]
        cpu = []
        for b in range(4):
            c0 = time.process_time()
            for i in range(500):
                store.transaction(store.webhook_trigger, public_id_of(store), B.now_utc())
                store.transaction(store.fire_webhook, trigger_id, {"n": f"g{b}-{i}"}, f"hmac:g{b}:{i:060x}", 300,
                                  B.now_utc())
            cpu.append(round((time.process_time() - c0) * 2, 2))
        store.close()
        print(f"in-process CPU per fire, {label} _unstarted_target, per successive 500 from "
              f"{n * batches} wakeups of history: {cpu} ms")
    outpost.Store._unstarted_target = as_is


def public_id_of(store: outpost.Store) -> str:
    sql = 'SELECT public_id FROM "RoutineTrigger" WHERE kind = \'webhook\''
    return store.transaction(lambda: store.db.select(sql))[0][0]


SECTIONS = {"fire_lag": fire_lag, "intake": intake, "drain": drain, "dashboard": dashboard,
            "webhook": webhook}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return patched_serve(sys.argv[2:])
    chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SECTIONS)
    with tempfile.TemporaryDirectory(prefix="outpost-profile-") as tmp:
        for name in chosen:
            print(f"\n=== {name} ===", flush=True)
            work = Path(tmp) / name
            work.mkdir()
            SECTIONS[name](work)
    return 0


if __name__ == "__main__":
    sys.exit(main())

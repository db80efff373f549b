"""docs/operations.md, the first two bullets: empty result branches go at settlement, and housekeeping
(``[settings] keep_days``, the daily pass, ``POST /v1/outpost/housekeeping``, ``outpost gc``)."""

from __future__ import annotations

from pathlib import Path

import conftest
import trio
from conftest import T0, Api, call, git, make_deps, until

import outpost


def branch_exists(repo: Path, branch: str) -> bool:
    return bool(git(repo, "branch", "--list", branch))


async def run_to_end(deps: outpost.Deps, run_id: str) -> dict:
    """The claim actor runs ``run_id`` to its settlement; its attention is raised as the
    notification actor would."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.claim_actor, deps)
        deps.claim_wake.poke()
        view = await until(lambda: (r := call(deps.store, deps.store.runs.get_run, run_id))["status"]
                           in ("succeeded", "failed", "needs_you", "cancelled") and r)
        await until(lambda: deps.live.get(run_id) is None)   # its supervisor has finished (the branch)
        nursery.cancel_scope.cancel()
    call(deps.store, deps.store.schedules.notify_run, run_id, deps.clock.now())
    return view


def in_process(tmp_path: Path, repo: Path, name: str = "hk.sqlite3") -> Api:
    store = outpost.Store(tmp_path / name)
    return Api(make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), inline_db=True), repo)


async def dispatch(api: Api, brief: str) -> str:
    reply = await api.post("/v1/outpost/dispatches", {"brief": brief, "repository": str(api.repo), "agent": "demo"})
    assert reply.status == 202, reply.body
    return reply.body["run_id"]


###############################################################################
# Empty result branches
###############################################################################

async def test_a_run_with_no_commits_leaves_no_branch_one_with_commits_keeps_it(autojump_clock, tmp_path, git_repo):
    api = in_process(tmp_path, git_repo)
    empty = await run_to_end(api.deps, await dispatch(api, "@print hello"))
    assert (empty["status"], empty["changes"]["commits"]) == ("succeeded", 0)
    assert empty["result_branch"].startswith("outpost/") and not branch_exists(git_repo, empty["result_branch"])
    work = await run_to_end(api.deps, await dispatch(api, "@commit notes.txt hello"))
    assert (work["status"], work["changes"]["commits"]) == ("succeeded", 1)
    assert branch_exists(git_repo, work["result_branch"])
    failed = await run_to_end(api.deps, await dispatch(api, "@fail boom"))
    assert failed["status"] == "failed" and not branch_exists(git_repo, failed["result_branch"])
    # A re-run of the empty run starts from its resolved commit, its branch gone or not.
    again = (await api.post(f"/v1/outpost/runs/{empty['id']}/rerun", {})).body["run_id"]
    rerun = await run_to_end(api.deps, again)
    assert (rerun["status"], rerun["resolved_commit"]) == ("succeeded", empty["resolved_commit"])
    # Compare still reads a run whose branch is gone: it returned its commit.
    compared = (await api.get(f"/v1/outpost/runs/{empty['id']}/compare/{work['id']}")).body
    assert [f["path"] for f in compared["files"]] == ["notes.txt"], compared
    api.store.close()


async def test_a_branch_moved_since_the_run_left_it_is_not_deleted(autojump_clock, tmp_path, git_repo):
    """The compare-and-delete: a branch that points elsewhere than where the run left it stays."""
    head = git(git_repo, "rev-parse", "HEAD")
    git(git_repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "later")
    git(git_repo, "branch", "outpost/x/out_1")
    assert not await outpost.drop_branch(str(git_repo), "outpost/x/out_1", head)
    assert not await outpost.drop_branch(str(git_repo), "main", git(git_repo, "rev-parse", "main"))
    assert branch_exists(git_repo, "outpost/x/out_1") and branch_exists(git_repo, "main")
    assert await outpost.drop_branch(str(git_repo), "outpost/x/out_1", git(git_repo, "rev-parse", "HEAD"))
    assert not branch_exists(git_repo, "outpost/x/out_1")


async def test_a_needs_you_run_keeps_its_branch_until_acknowledged(autojump_clock, tmp_path, git_repo):
    api = in_process(tmp_path, git_repo)
    asked = await run_to_end(api.deps, await dispatch(api, "@needs-you which one?"))
    assert asked["status"] == "needs_you" and branch_exists(git_repo, asked["result_branch"])
    (item,) = [a for a in (await api.get("/v1/outpost/attention")).body["attention"] if a["run_id"] == asked["id"]]
    assert (await api.post(f"/v1/outpost/attention/{item['id']}/ack", {})).status == 200
    assert not branch_exists(git_repo, asked["result_branch"])
    api.store.close()


async def test_a_needs_you_run_keeps_its_branch_until_answered_and_the_reply_starts_from_its_commit(
        autojump_clock, tmp_path, git_repo):
    api = in_process(tmp_path, git_repo)
    asked = await run_to_end(api.deps, await dispatch(api, "@needs-you which one?"))
    assert branch_exists(git_repo, asked["result_branch"])
    git(git_repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "moved on")
    assert (await api.post(f"/v1/outpost/runs/{asked['id']}/adopt", {"workspace": "me"})).status == 200
    reply = await api.post(f"/v1/outpost/runs/{asked['id']}/reply", {"message": "@print the first"})
    assert reply.status == 202, reply.body
    answer = await run_to_end(api.deps, reply.body["run_id"])
    assert (answer["status"], answer["resolved_commit"]) == ("succeeded", asked["resolved_commit"])
    assert answer["result_branch"] == asked["result_branch"] and not branch_exists(git_repo, asked["result_branch"])
    # Asked again with work on the branch: the reply continues the branch, which stays.
    asked = await run_to_end(api.deps, await dispatch(api, "@commit a.txt one\n@needs-you and now?"))
    assert (asked["status"], asked["changes"]["commits"]) == ("needs_you", 1)
    await api.post(f"/v1/outpost/runs/{asked['id']}/adopt", {"workspace": "me"})
    reply = await api.post(f"/v1/outpost/runs/{asked['id']}/reply", {"message": "@print fine"})
    answer = await run_to_end(api.deps, reply.body["run_id"])
    assert (answer["status"], answer["changes"]["commits"]) == ("succeeded", 0)
    assert branch_exists(git_repo, asked["result_branch"])
    assert git(git_repo, "rev-parse", asked["result_branch"]) != asked["resolved_commit"]
    api.store.close()


###############################################################################
# Housekeeping
###############################################################################

DAY = 86400


async def ack_items(api: Api, run_id: str) -> None:
    for item in (await api.get("/v1/outpost/attention")).body["attention"]:
        if item["run_id"] == run_id:
            assert (await api.post(f"/v1/outpost/attention/{item['id']}/ack", {})).status == 200


async def test_gc_deletes_old_runs_and_merged_branches_and_keeps_what_the_rules_keep(autojump_clock, tmp_path,
                                                                                    git_repo):
    api = in_process(tmp_path, git_repo)
    runs = {}
    for name, brief in (("empty", "@print x"), ("merged", "@commit m.txt m"), ("unmerged", "@commit u.txt u"),
                        ("open", "@commit o.txt o"), ("asked", "@needs-you which?")):
        runs[name] = await run_to_end(api.deps, await dispatch(api, brief))
    for name in ("empty", "merged", "unmerged", "asked"):
        await ack_items(api, runs[name]["id"])
    sched = await api.schedule(brief="@print tick", timing={"kind": "cron", "expression": "0 0 1 1 *",
                                                             "timezone": "UTC"})
    for name in ("first", "latest"):
        await trio.sleep(60)
        runs[name] = await run_to_end(api.deps, (await api.fire(sched["id"]))["run_id"])
        await ack_items(api, runs[name]["id"])
    git(git_repo, "merge", "-q", "--ff-only", runs["merged"]["result_branch"])
    assert (tmp_path / "runs" / f"{runs['empty']['id']}.log").is_file()
    assert (tmp_path / "runs" / f"{runs['empty']['id']}.times").is_file()   # when its lines began
    await trio.sleep(2 * DAY)

    dry = await api.post("/v1/outpost/housekeeping", {"keep_days": 1, "dry_run": True})
    assert dry.status == 200, dry.body
    assert set(dry.body) == {"dry_run", "runs", "log_bytes", "events", "wakeups", "deliveries", "branches",
                             "database_bytes_before", "database_bytes_after"}
    assert (dry.body["dry_run"], dry.body["runs"], dry.body["branches"]) == (True, 4, 1)
    assert dry.body["log_bytes"] > 0 and dry.body["events"] > 0
    assert (await api.get(f"/v1/outpost/runs/{runs['empty']['id']}")).status == 200
    assert branch_exists(git_repo, runs["merged"]["result_branch"])

    done = await api.post("/v1/outpost/housekeeping", {"keep_days": 1})
    assert done.status == 200, done.body
    assert {k: done.body[k] for k in ("dry_run", "runs", "branches", "log_bytes", "events")} == {
        k: dry.body[k] if k != "dry_run" else False for k in ("dry_run", "runs", "branches", "log_bytes", "events")}
    for name in ("empty", "merged", "unmerged", "first"):
        assert (await api.get(f"/v1/outpost/runs/{runs[name]['id']}")).status == 404, name
    for name in ("open", "asked", "latest"):   # open attention, unanswered needs_you, the schedule's latest
        assert (await api.get(f"/v1/outpost/runs/{runs[name]['id']}")).status == 200, name
    assert not (tmp_path / "runs" / f"{runs['empty']['id']}.log").exists()
    assert not (tmp_path / "runs" / f"{runs['empty']['id']}.times").exists()
    assert (tmp_path / "runs" / f"{runs['open']['id']}.log").is_file()
    assert (tmp_path / "runs" / f"{runs['open']['id']}.times").is_file()
    assert not branch_exists(git_repo, runs["merged"]["result_branch"])
    assert branch_exists(git_repo, runs["unmerged"]["result_branch"])   # work nobody merged stays
    assert branch_exists(git_repo, runs["open"]["result_branch"])
    # The run list and the events still read; the pass is recorded; a second one finds nothing.
    assert {r["id"] for r in (await api.get("/v1/outpost/runs")).body["runs"]} == {
        runs[n]["id"] for n in ("open", "asked", "latest")}
    assert (await api.get("/v1/outpost/events")).status == 200
    last = call(api.store, api.store.housekeeping.last_pass)
    assert (last["runs"], last["keep_days"]) == (4, 1)
    page = await api.get("/settings")   # the dashboard: disk use and the last pass
    assert page.status == 200 and 'id="housekeeping-panel"' in page.text and "Last pass" in page.text
    assert 'data-disk="logs"' in page.text and "4 runs" in page.text
    again = (await api.post("/v1/outpost/housekeeping", {"keep_days": 1})).body
    assert (again["runs"], again["branches"]) == (0, 0)
    # keep_days 0: every settled run the rules allow, here none more.
    assert (await api.post("/v1/outpost/housekeeping", {"keep_days": 0})).body["runs"] == 0
    api.store.close()


async def test_gc_body_is_checked_field_by_field(autojump_clock, tmp_path, git_repo):
    api = in_process(tmp_path, git_repo)
    from conftest import assert_problem
    for body, field in (({"keep_days": -1}, "keep_days"), ({"keep_days": "x"}, "keep_days"),
                        ({"keep_days": True}, "keep_days"), ({"dry_run": "yes"}, "dry_run"),
                        ({"keep": 3}, "keep")):
        assert_problem(await api.post("/v1/outpost/housekeeping", body), 422, "validation_failed", field)
    assert_problem(await api.post("/v1/outpost/housekeeping", {}, key=None), 428, "idempotency_key_required")
    first = await api.post("/v1/outpost/housekeeping", {"dry_run": True}, key="gc-1")
    replay = await api.post("/v1/outpost/housekeeping", {"dry_run": True}, key="gc-1")
    assert (replay.status, replay.body, replay.headers.get("Idempotent-Replayed")) == (200, first.body, "true")
    api.store.close()


async def test_the_database_gives_its_space_back_after_a_big_delete(autojump_clock, tmp_path):
    store = outpost.Store(tmp_path / "big.sqlite3")
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), inline_db=True)

    def many_old_runs(n: int) -> None:
        for i in range(n):
            store.runs.queue_run(outpost.QueuedRun(agent="demo", trigger="dispatch", prompt=f"{i} " + "x" * 8000,
                                                   repository=str(tmp_path), workdir=".", source_ref="HEAD",
                                                   notify="never", timeout_seconds=60), T0)
        store.db.execute("UPDATE \"Run\" SET status = 'succeeded', finished_at = $t", {"t": outpost.sql_time(T0)})
    call(store, many_old_runs, 1000)
    before = (tmp_path / "big.sqlite3").stat().st_size
    await trio.sleep(3 * DAY)
    async with deps.housekeeping:
        counts = await outpost.housekeeping_pass(deps, 1, dry_run=False)
    assert counts["runs"] == 1000 and counts["events"] >= 999
    assert counts["database_bytes_after"] < counts["database_bytes_before"] / 4, counts
    store.close()
    assert (tmp_path / "big.sqlite3").stat().st_size < before / 4


async def test_the_daily_pass_runs_with_the_configured_keep_days(autojump_clock, tmp_path):
    store = outpost.Store(tmp_path / "daily.sqlite3")
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), inline_db=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.housekeeping_actor, deps)
        await trio.sleep(outpost.HOUSEKEEPING_FIRST_S + 1)
        assert call(store, store.housekeeping.last_pass)["keep_days"] == outpost.DEFAULT_KEEP_DAYS
        await trio.sleep(outpost.HOUSEKEEPING_EVERY_S)
        events = call(store, store.events_after, 0, 100)["events"]
        assert [e["type"] for e in events].count("housekeeping.finished") == 2
        nursery.cancel_scope.cancel()
    store.close()


def test_keep_days_below_one_stops_serve_with_one_line(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "outpost.toml").write_text("[settings]\nkeep_days = 0\n")
    assert outpost.main(["--data-dir", str(data), "serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "keep_days" in err, err
    (data / "outpost.toml").write_text("[settings]\nkeep_days = 30\n")
    assert outpost.load_config(data).keep_days == 30


def test_outpost_gc_dry_run_prints_the_counts(server_factory, tmp_path):
    import subprocess
    import sys
    server = server_factory()
    done = subprocess.run([sys.executable, str(conftest.OUTPOST_PY), "--data-dir", str(server.data_dir), "gc",
                           "--dry-run", "--keep-days", "0", "--url", server.url], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("would delete: 0 run(s)") and "database:" in done.stdout, done.stdout


def test_an_older_small_database_is_converted_to_incremental_vacuum_at_start(tmp_path):
    import sqlite3
    path = tmp_path / "old.sqlite3"
    outpost.Store(path).close()
    with sqlite3.connect(path, isolation_level=None) as old:   # as a database made before housekeeping
        old.execute("PRAGMA auto_vacuum=NONE")
        old.execute("VACUUM")
        assert old.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    outpost.Store(path).close()
    with sqlite3.connect(path) as reopened:
        assert reopened.execute("PRAGMA auto_vacuum").fetchone()[0] == 2   # incremental


async def test_a_pass_deletes_old_sent_notifications_and_keeps_those_still_waiting(autojump_clock, tmp_path):
    store = outpost.Store(tmp_path / "outbox.sqlite3")
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), inline_db=True)

    def outbox(statuses: list[str]) -> None:
        for status in statuses:
            store.db.Notification(entry="e", item=None, kind="test", title=status, status=status,
                                  next_at=outpost.naive(T0), created_at=outpost.naive(T0))
    call(store, outbox, ["delivered", "given_up", "queued"])
    await trio.sleep(3 * DAY)
    async with deps.housekeeping:
        dry = await outpost.housekeeping_pass(deps, 1, dry_run=True)
        counts = await outpost.housekeeping_pass(deps, 1, dry_run=False)
    assert dry["deliveries"] == counts["deliveries"] == 2
    left = call(store, lambda: sorted(n.status for n in store.db.Notification.select()))
    assert left == ["queued"]
    store.close()

"""Skip when nothing changed, ask before catching up, the dead-man alert and /healthz,
re-run and compare, the charts (docs/schedules.md)."""
from __future__ import annotations

import re
import sqlite3
from datetime import timedelta

import pytest
import trio
from conftest import (
    T0,
    Api,
    SteppedClock,
    call,
    git,
    make_deps,
    new_store,
    normalized,
    only,
    settle,
    sign_in_client,
    until,
)

import outpost

MIN = timedelta(minutes=1)
EVERY_10_MIN = {"kind": "interval", "seconds": 600, "timezone": "UTC"}


def ledger(store, schedule_id: str) -> list[str]:
    """The slot ledger's outcomes, oldest first."""
    return [o["outcome"] for o in reversed(call(store, store.schedules.occurrences, schedule_id, 100))]


###############################################################################
# skip_if_unchanged
###############################################################################

def test_an_unchanged_commit_skips_the_fire_and_a_new_one_admits_it(store, git_repo):
    sched = call(store, store.schedules.create_schedule, normalized(git_repo, timing=EVERY_10_MIN,
                                                                    skip_if_unchanged=True), T0)
    head = git(git_repo, "rev-parse", "HEAD")
    (first,) = call(store, store.schedules.claim_due, T0 + 10 * MIN, heads={sched["id"]: head})
    call(store, store.runs.set_resolved_commit, first, head)
    settle(store, first, "succeeded", T0 + 11 * MIN)
    assert call(store, store.schedules.claim_due, T0 + 20 * MIN, heads={sched["id"]: head}) == []
    (again,) = call(store, store.schedules.claim_due, T0 + 30 * MIN, heads={sched["id"]: "0" * 40})   # a new commit
    assert ledger(store, sched["id"]) == ["admitted", "skipped_unchanged", "admitted"]
    assert again != first
    # A manual fire ignores the flag.
    settle(store, again, "succeeded", T0 + 31 * MIN)
    fired = call(store, store.schedules.fire_manual, sched["id"], 1, T0 + 32 * MIN)
    assert fired["outcome"] == "admitted"


def test_only_a_success_counts_as_the_last_commit(store, git_repo):
    sched = call(store, store.schedules.create_schedule, normalized(git_repo, timing=EVERY_10_MIN,
                                                                    skip_if_unchanged=True), T0)
    head = git(git_repo, "rev-parse", "HEAD")
    (first,) = call(store, store.schedules.claim_due, T0 + 10 * MIN, heads={sched["id"]: head})
    call(store, store.runs.set_resolved_commit, first, head)
    settle(store, first, "failed", T0 + 11 * MIN, error="boom")
    assert len(call(store, store.schedules.claim_due, T0 + 20 * MIN, heads={sched["id"]: head})) == 1


async def test_the_refs_of_due_schedules_are_resolved_before_the_claim(tmp_path, git_repo):
    """What the cron actor does before each claim: git resolves the source_ref of every due
    schedule that skips when unchanged (and only of those), outside the claim's transaction."""
    store = new_store(tmp_path, "cron.sqlite3")
    deps = make_deps(tmp_path, store=store, token="t", inline_db=True)
    sched = call(store, store.schedules.create_schedule, normalized(git_repo, name="skips", timing=EVERY_10_MIN,
                                                          skip_if_unchanged=True), T0)
    call(store, store.schedules.create_schedule, normalized(git_repo, name="always", timing=EVERY_10_MIN), T0)
    head = git(git_repo, "rev-parse", "HEAD")
    assert await outpost.unchanged_heads(deps, T0 + 5 * MIN) == {}, "nothing is due yet"
    assert await outpost.unchanged_heads(deps, T0 + 10 * MIN) == {sched["id"]: head}
    broken = call(store, store.schedules.create_schedule, normalized(git_repo, name="gone", timing=EVERY_10_MIN,
                                                           skip_if_unchanged=True, source_ref="main"), T0)
    git(git_repo, "branch", "-m", "main", "renamed")
    heads = await outpost.unchanged_heads(deps, T0 + 10 * MIN)
    assert broken["id"] not in heads, "a ref that no longer resolves is left to the run, which says why"
    store.close()


async def test_a_fire_that_skips_when_unchanged_resolves_its_ref_once(tmp_path, git_repo, monkeypatch):
    """Issue 26: the commit the cron actor resolved to decide the skip is the one the run starts
    from; fire step 2 does not resolve the ref again (nor does the worktree step: it is recorded)."""
    store = new_store(tmp_path, "once.sqlite3")
    deps = make_deps(tmp_path, store=store, token="t", inline_db=True)
    sched = call(store, store.schedules.create_schedule,
                 normalized(git_repo, timing=EVERY_10_MIN, skip_if_unchanged=True), T0)
    asked, real = [], outpost.resolve_ref

    async def counting(repository: str, ref: str) -> str:
        asked.append(ref)
        return await real(repository, ref)
    monkeypatch.setattr(outpost, "resolve_ref", counting)
    heads = await outpost.unchanged_heads(deps, T0 + 10 * MIN)
    (run_id,) = call(store, store.schedules.claim_due, T0 + 10 * MIN, heads=heads)
    await outpost.resolve_new_runs(deps, [run_id])
    assert asked == ["HEAD"]
    recorded = call(store, store.runs.launch_info, run_id)["resolved_commit"]
    assert recorded == heads[sched["id"]] == git(git_repo, "rev-parse", "HEAD")
    store.close()


async def test_the_cron_actor_reads_the_checks_while_asleep_and_the_due_instant_costs_only_the_claim(
        autojump_clock, tmp_path, git_repo, monkeypatch):
    """Fire lag (issue 15): what the claim needs to know before it runs is read with the
    wake-up plan, before the sleep; at the due instant the actor resolves the ref and claims,
    with no read in between. A commit that lands while it sleeps still counts: the ref is
    resolved at the instant, not before. (The ref's commit is a fake here: a real git process
    under MockClock lets the clock jump while it runs.)"""
    store = new_store(tmp_path, "prepared.sqlite3")
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), token="t", inline_db=True)
    sched = call(store, store.schedules.create_schedule, normalized(git_repo, timing=EVERY_10_MIN,
                                                                    skip_if_unchanged=True), T0)
    head = {"now": "1" * 40}
    asked_at = []

    async def resolve_ref(repository: str, ref: str) -> str:
        asked_at.append(deps.clock.now())
        return head["now"]
    monkeypatch.setattr(outpost, "resolve_ref", resolve_ref)
    cron_calls = []
    real = store.transaction

    def recording(fn, *args, **kwargs):
        name = getattr(fn, "func", fn).__name__   # Deps.transaction hands a partial
        if name in ("unchanged_checks", "claim_due", "next_fire_plan"):
            cron_calls.append(name)
        return real(fn, *args, **kwargs)
    monkeypatch.setattr(store, "transaction", recording)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            await trio.sleep(10 * 60 + 1)    # 08:10: the first run of this schedule
            (run,) = call(store, store.runs.list_runs, sched["id"], None, 10, None)["runs"]
            settle(store, run["id"], "succeeded", deps.clock.now())
            await trio.sleep(10 * 60)        # 08:20: nothing changed, so it skips
            head["now"] = "2" * 40           # a commit lands while the actor sleeps
            await trio.sleep(10 * 60)        # 08:30: it fires
            nursery.cancel_scope.cancel()
    assert ledger(store, sched["id"]) == ["admitted", "skipped_unchanged", "admitted"]
    assert {T0 + 10 * MIN, T0 + 20 * MIN, T0 + 30 * MIN} <= set(asked_at), "asked at each due instant"
    assert cron_calls.count("unchanged_checks") == 1, "after the first pass the checks come with the wake-up plan"
    claims = [i for i, name in enumerate(cron_calls) if name == "claim_due"][1:]
    assert all(cron_calls[i - 1] == "next_fire_plan" for i in claims), cron_calls
    store.close()


def test_the_checks_name_only_schedules_that_skip_even_when_a_brief_mentions_the_flag(store, git_repo):
    skips = call(store, store.schedules.create_schedule, normalized(git_repo, name="skips", timing=EVERY_10_MIN,
                                                          skip_if_unchanged=True), T0)
    call(store, store.schedules.create_schedule, normalized(git_repo, name="talks", timing=EVERY_10_MIN,
                                                  brief='Explain "skip_if_unchanged" to the team'), T0)
    assert call(store, store.schedules.unchanged_checks, T0 + 10 * MIN) == [(skips["id"], str(git_repo), "HEAD")]


def test_a_claim_until_an_instant_leaves_later_slots_for_the_next_claim(store, git_repo):
    early = call(store, store.schedules.create_schedule, normalized(git_repo, name="early", timing=EVERY_10_MIN), T0)
    later = call(store, store.schedules.create_schedule, normalized(git_repo, name="later", timing=EVERY_10_MIN),
                 T0 + timedelta(seconds=2))
    assert len(call(store, store.schedules.claim_due, T0 + 10 * MIN + timedelta(seconds=3), until=T0 + 10 * MIN)) == 1
    assert ledger(store, early["id"]) == ["admitted"] and ledger(store, later["id"]) == []
    assert len(call(store, store.schedules.claim_due, T0 + 10 * MIN + timedelta(seconds=3))) == 1
    assert ledger(store, later["id"]) == ["admitted"]


###############################################################################
# catch_up ask
###############################################################################

def asking_schedule(store, git_repo) -> dict:
    return call(store, store.schedules.create_schedule, normalized(git_repo, timing=EVERY_10_MIN,
                                                                   catch_up={"policy": "ask"}),
                T0)


def test_missed_slots_under_ask_wait_for_a_human_then_approve_runs_one_catch_up(store, git_repo):
    sched = asking_schedule(store, git_repo)
    # The daemon was down for an hour: six slots were missed; nothing runs.
    assert call(store, store.schedules.claim_due, T0 + 65 * MIN) == []
    s = call(store, store.schedules.get_schedule, sched["id"])
    assert s["pending_catch_up"] == {"missed_count": 6, "first_missed_at": "2026-11-30T08:10:00Z",
                                     "last_missed_at": "2026-11-30T09:00:00Z", "missed_count_exact": True}
    assert ledger(store, sched["id"]) == ["pending_catch_up"] * 6
    item = only([a for a in call(store, store.list_attention, True) if a["kind"] == "catch_up_plan"])
    assert "missed 6 occurrences" in item["title"]
    approved = call(store, store.schedules.control_schedule, sched["id"], 1, "approve_catch_up", T0 + 61 * MIN)
    assert approved["pending_catch_up"] is None and approved["revision"] == 2
    (run,) = call(store, store.runs.list_runs, sched["id"], None, 10, None)["runs"]
    assert (run["trigger"], run["missed_count"], run["status"]) == ("catch_up", 6, "queued")
    assert ledger(store, sched["id"]) == ["folded"] * 5 + ["admitted"]
    assert call(store, store.list_attention, True) == [], "the decision closes the plan's item"
    with pytest.raises(outpost.Conflict):
        call(store, store.schedules.control_schedule, sched["id"], 2, "approve_catch_up", T0 + 62 * MIN)


def test_approving_a_catch_up_while_a_run_is_active_starts_it_later_not_never(store, git_repo):
    """shared/API.md 9: approve_catch_up answers as fire does. While a run of the schedule is
    active it is skipped_overlap: the plan stays pending, its item open and saying so, nothing is
    folded; approved again once the run ended, the catch-up runs (before: 200, the plan cleared,
    the item closed and nothing started)."""
    sched = asking_schedule(store, git_repo)
    call(store, store.schedules.claim_due, T0 + 65 * MIN)
    busy = call(store, store.schedules.fire_manual, sched["id"], 1, T0 + 66 * MIN)["run_id"]
    held = call(store, store.schedules.control_schedule, sched["id"], 1, "approve_catch_up", T0 + 67 * MIN)
    assert (held["outcome"], held["run_id"], held["revision"]) == ("skipped_overlap", None, 1)
    assert held["pending_catch_up"]["missed_count"] == 6
    assert ledger(store, sched["id"]).count("pending_catch_up") == 6, "nothing folded"
    item = only([a for a in call(store, store.list_attention, True) if a["kind"] == "catch_up_plan"])
    assert busy in item["detail"] and "approve again" in item["detail"]
    settle(store, busy, "succeeded", T0 + 69 * MIN)
    approved = call(store, store.schedules.control_schedule, sched["id"], 1, "approve_catch_up", T0 + 70 * MIN)
    assert approved["outcome"] == "admitted" and approved["pending_catch_up"] is None
    run = call(store, store.runs.get_run, approved["run_id"])
    assert (run["trigger"], run["missed_count"]) == ("catch_up", 6)
    assert not [a for a in call(store, store.list_attention, True) if a["kind"] == "catch_up_plan"]


def test_a_second_outage_updates_the_open_plans_item_to_the_whole_count(store, git_repo):
    """Its item said 4 missed while the plan said 24: it now tells the plan's count and window."""
    sched = asking_schedule(store, git_repo)
    call(store, store.schedules.claim_due, T0 + 45 * MIN)    # 4 missed: 08:10 .. 08:40
    call(store, store.schedules.claim_due, T0 + 245 * MIN)   # down again: 20 more, 08:50 .. 12:00
    plan = call(store, store.schedules.get_schedule, sched["id"])["pending_catch_up"]
    item = only([a for a in call(store, store.list_attention, True) if a["kind"] == "catch_up_plan"])
    assert f"missed {plan['missed_count']} occurrences" in item["title"] and plan["missed_count"] == 24
    assert "from 2026-11-30 08:10 UTC to 2026-11-30 12:00 UTC" in item["detail"]


def test_dismissing_a_catch_up_records_the_slots_as_skipped(store, git_repo):
    sched = asking_schedule(store, git_repo)
    call(store, store.schedules.claim_due, T0 + 35 * MIN)
    call(store, store.schedules.claim_due, T0 + 55 * MIN)   # more missed slots join the same plan: one item
    assert call(store, store.schedules.get_schedule, sched["id"])["pending_catch_up"]["missed_count"] == 5
    assert len([a for a in call(store, store.list_attention, True) if a["kind"] == "catch_up_plan"]) == 1
    call(store, store.schedules.control_schedule, sched["id"], 1, "dismiss_catch_up", T0 + 56 * MIN)
    assert ledger(store, sched["id"]) == ["skipped_missed"] * 5
    assert call(store, store.runs.list_runs, sched["id"], None, 10, None)["runs"] == []
    # A slot on time fires as usual.
    assert len(call(store, store.schedules.claim_due, T0 + 60 * MIN)) == 1


async def test_approve_and_dismiss_are_controls_of_the_api(tmp_path, git_repo):
    api = Api(make_deps(tmp_path), git_repo)
    created = await api.schedule(timing=EVERY_10_MIN, catch_up={"policy": "ask"})
    call(api.store, api.store.schedules.claim_due, T0 + 45 * MIN)
    reply = await api.control(created["id"], "approve_catch_up", 1)
    assert reply.status == 200 and reply.body["pending_catch_up"] is None
    reply = await api.control(created["id"], "dismiss_catch_up", 2)
    assert reply.status == 409 and reply.body["code"] == "conflict"


EVERY_MINUTE = {"kind": "cron", "expression": "* * * * *", "timezone": "UTC"}


async def test_a_long_outage_under_ask_names_its_first_slot_and_says_more_than(tmp_path, git_repo):
    """Defect 8: past 500 missed slots the plan named the first of the newest recorded slots as
    ``first_missed_at`` and showed the counting cap as the exact count; the approved run's prompt
    repeated both. Now the true first slot, and "more than N" in the API, the page and the prompt."""
    api = Api(make_deps(tmp_path), git_repo)
    sched = await api.schedule(timing=EVERY_MINUTE, catch_up={"policy": "ask"})
    back = T0 + timedelta(days=2, minutes=30, seconds=30)   # down two days: 2,909 per-minute slots missed
    api.clock.at = back
    call(api.store, api.store.schedules.claim_due, back)   # the cron actor's first claim
    plan = (await api.get(f"/v1/outpost/schedules/{sched['id']}")).body["pending_catch_up"]
    assert plan["first_missed_at"] == "2026-11-30T08:01:00Z"
    assert plan["last_missed_at"] == "2026-12-02T08:29:00Z"
    assert plan["missed_count_exact"] is False and plan["missed_count"] >= outpost.MISSED_COUNT_CAP
    many = f"more than {plan['missed_count']:,}"
    item = only([a for a in (await api.get("/v1/outpost/attention")).body["attention"]
                 if a["kind"] == "catch_up_plan"])
    assert f"missed {many} occurrences" in item["title"] and "2026-11-30 08:01" in item["detail"]
    sign_in_client(api.client, api.store, back)
    page = await (await api.client.get(f"/schedules/{sched['id']}")).get_data(as_text=True)
    panel = page.split('id="catch-up-plan"', 1)[1].split("</div>", 1)[0]
    assert f"<strong>{many}</strong>" in panel and "the first at 2026-11-30 08:01" in panel
    (on_time,) = call(api.store, api.store.runs.list_runs, sched["id"], None, 10, None)["runs"]   # 08:30 fired
    await api.post(f"/v1/outpost/runs/{on_time['id']}/control", {"action": "cancel"})
    approved = await api.control(sched["id"], "approve_catch_up", await api.revision(sched["id"]))
    assert approved.status == 200, approved.body
    run, _ = call(api.store, api.store.runs.list_runs, sched["id"], None, 10, None)["runs"]
    prompt = call(api.store, api.store.runs.launch_info, run["id"])["prompt"]
    assert f"missed {many} occurrences since 2026-11-30 08:01 UTC" in prompt


def test_a_plan_of_few_slots_says_its_count_is_exact(store, git_repo):
    sched = asking_schedule(store, git_repo)
    call(store, store.schedules.claim_due, T0 + 65 * MIN)
    plan = call(store, store.schedules.get_schedule, sched["id"])["pending_catch_up"]
    assert (plan["missed_count"], plan["missed_count_exact"]) == (6, True)


@pytest.mark.parametrize(("policy", "outcome"), [("skip_missed", "skipped_missed"), ("ask", "pending_catch_up")])
@pytest.mark.parametrize("concurrency", ["skip_if_active", "always_enqueue"])
async def test_after_a_restart_the_slots_of_the_downtime_follow_catch_up_not_overlap(
        autojump_clock, tmp_path, git_repo, monkeypatch, policy, outcome, concurrency):
    """Defect 8: the slots of the downtime due in the last 60 s before the restart were taken as
    on time: one ran, the others were recorded ``skipped_overlap`` (or, always_enqueue, each ran).
    Only the newest slot is on time; the older ones were missed and follow catch_up."""
    head = git(git_repo, "rev-parse", "HEAD")

    async def resolve_ref(repository: str, ref: str) -> str:   # no git subprocess under MockClock
        return head
    monkeypatch.setattr(outpost, "resolve_ref", resolve_ref)
    store = new_store(tmp_path, "restart.sqlite3")
    every_10_s = {"kind": "interval", "seconds": 10, "timezone": "UTC"}
    sched = call(store, store.schedules.create_schedule, normalized(git_repo, timing=every_10_s,
                                                                    catch_up={"policy": policy},
                                                          concurrency_policy=concurrency), T0)
    back = T0 + timedelta(hours=1, seconds=5)   # down an hour: back 5 s after the 09:00:00 slot
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(back), token="t", inline_db=True)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    slots = list(reversed(call(store, store.schedules.occurrences, sched["id"], 1000)))
    assert slots[-1]["due_at"] == "2026-11-30T09:00:00Z" and slots[-1]["outcome"] == "admitted"
    assert {o["outcome"] for o in slots[:-1]} == {outcome}, "every older slot of the downtime was missed"
    assert len(call(store, store.runs.list_runs, sched["id"], None, 100, None)["runs"]) == 1
    store.close()


###############################################################################
# The dead-man alert and /healthz
###############################################################################

async def healthz(deps) -> tuple[int, dict]:
    response = await outpost.create_app(deps).test_client().get("/healthz")
    return response.status_code, await response.get_json()


async def test_a_stalled_store_raises_one_missed_fire_and_healthz_says_503_until_it_recovers(
        autojump_clock, tmp_path, git_repo, monkeypatch):
    monkeypatch.setattr(outpost, "BUSY_TIMEOUT_MS", 50)   # a locked attempt costs 50 ms here, not 5 s
    path = tmp_path / "stalled.sqlite3"
    store = outpost.Store(path)
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), token="t", inline_db=True)
    sched = call(store, store.schedules.create_schedule, normalized(git_repo, timing=EVERY_10_MIN), T0)
    outside = sqlite3.connect(path, isolation_level=None)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            await trio.sleep(9 * 60)
            assert (await healthz(deps))[0] == 200
            outside.execute("BEGIN IMMEDIATE")   # another process holds the write lock
            await trio.sleep(2 * 60 + 30)        # the 08:10 slot is 90 s overdue
            status, body = await healthz(deps)
            assert status == 503 and body["status"] == "cron_lagging" and body["cron_lag_seconds"] > 60
            outside.execute("ROLLBACK")
            await until(lambda: call(store, store.schedules.occurrences, sched["id"], 10), poll_s=1)
            await trio.sleep(1)
            assert (await healthz(deps))[0] == 200
            nursery.cancel_scope.cancel()
    outside.close()
    item = only([a for a in call(store, store.list_attention, True) if a["kind"] == "missed_fire"])
    assert item["schedule_id"] == sched["id"] and "08:10" in item["title"] and "late" in item["detail"]
    store.close()


async def test_a_clock_step_raises_a_missed_fire_but_downtime_does_not(autojump_clock, tmp_path, git_repo):
    store = new_store(tmp_path, "step.sqlite3")
    clock = SteppedClock(T0)
    deps = make_deps(tmp_path, store=store, clock=clock, token="t", inline_db=True)
    down = call(store, store.schedules.create_schedule, normalized(git_repo, name="down", timing=EVERY_10_MIN),
                T0 - 60 * MIN)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            await trio.sleep(60)   # the first pass caught up the downtime's slots: no alarm
            assert [a["kind"] for a in call(store, store.list_attention, True)] == []
            stepped = call(store, store.schedules.create_schedule, normalized(git_repo, name="stepped",
                                                                              timing=EVERY_10_MIN),
                           clock.now())
            deps.cron_wake.poke()
            await trio.sleep(1)
            clock.offset = timedelta(hours=1)     # the wall clock jumps an hour ahead
            status, body = await healthz(deps)
            assert status == 503 and body["cron_lag_seconds"] > 60
            await trio.sleep(outpost.CRON_MAX_SLEEP_S)   # the actor wakes and claims
            assert (await healthz(deps))[0] == 200
            nursery.cancel_scope.cancel()
    items = [a for a in call(store, store.list_attention, True) if a["kind"] == "missed_fire"]
    assert {a["schedule_id"] for a in items} == {stepped["id"], down["id"]}
    assert len(items) == 2, "one item per schedule and claim"
    store.close()


async def test_healthz_says_503_when_the_cron_actor_is_stuck_on_a_held_store_before_it_knew_of_a_due_fire(
        autojump_clock, tmp_path, git_repo, monkeypatch):
    """Defect 9a: held from its first claim, the cron actor never learnt of the 08:10 fire, so its
    lag read 0 and /healthz said ok for as long as the hold lasted. Now a cron (or claim) actor in
    one step for more than 60 s is reported, with the reason."""
    monkeypatch.setattr(outpost, "BUSY_TIMEOUT_MS", 50)   # a locked attempt costs 50 ms here, not 5 s
    head = git(git_repo, "rev-parse", "HEAD")

    async def resolve_ref(repository: str, ref: str) -> str:   # no git subprocess under MockClock
        return head
    monkeypatch.setattr(outpost, "resolve_ref", resolve_ref)
    path = tmp_path / "held.sqlite3"
    store = outpost.Store(path)
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0 + 9 * MIN), token="t", inline_db=True)
    sched = call(store, store.schedules.create_schedule, normalized(git_repo, timing=EVERY_10_MIN), T0)   # due 08:10
    outside = sqlite3.connect(path, isolation_level=None)
    outside.execute("BEGIN IMMEDIATE")   # another process holds the write lock before the actors start
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            await trio.sleep(30)
            assert (await healthz(deps))[0] == 200, "30 s in one step is not yet stuck"
            await trio.sleep(2 * 60)   # 08:11:30: the 08:10 fire is 90 s overdue, unknown to the actor
            status, body = await healthz(deps)
            assert status == 503 and body["status"] == "cron_stuck" and not body["ok"]
            assert "cron actor" in body["reason"] and "150 s" in body["reason"]
            outside.execute("ROLLBACK")
            await until(lambda: call(store, store.schedules.occurrences, sched["id"], 10), poll_s=1)
            await trio.sleep(1)
            status, body = await healthz(deps)
            assert status == 200 and body["status"] == "ok", body
            nursery.cancel_scope.cancel()
    outside.close()
    store.close()


def test_a_claim_actor_stuck_in_one_step_is_not_healthy():
    watch = outpost.CronWatch()
    watch.busy("claim", T0)
    assert watch.stuck(T0 + timedelta(seconds=60)) is None
    assert watch.stuck(T0 + timedelta(seconds=61)) == ("claim", 61.0)
    watch.idle("claim")
    assert watch.stuck(T0 + timedelta(seconds=600)) is None


###############################################################################
# Re-run and compare
###############################################################################

async def run_to_end(deps, run_id: str) -> dict:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.claim_actor, deps)
        deps.claim_wake.poke()
        view = await until(lambda: (r := call(deps.store, deps.store.runs.get_run, run_id))["status"]
                           in ("succeeded", "failed") and r)
        nursery.cancel_scope.cancel()
    return view


async def test_a_rerun_repeats_commit_prompt_and_profile_and_compare_shows_the_diff(autojump_clock, tmp_path,
                                                                                  git_repo):
    store = new_store(tmp_path, "rerun.sqlite3")
    deps = make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), inline_db=True)
    api = Api(deps, git_repo)
    first = (await api.post("/v1/outpost/dispatches", {"brief": "@commit notes.txt hello", "repository": str(git_repo),
                                                        "agent": "demo"})).body["run_id"]
    one = await run_to_end(deps, first)
    git(git_repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "moved on")
    reply = await api.post(f"/v1/outpost/runs/{first}/rerun", {})
    assert reply.status == 202
    two = await run_to_end(deps, reply.body["run_id"])
    assert (two["trigger"], two["rerun_of"], two["status"]) == ("rerun", first, "succeeded")
    assert two["resolved_commit"] == one["resolved_commit"] != git(git_repo, "rev-parse", "HEAD")
    assert two["result_branch"] != one["result_branch"]
    # The second run turned out differently: one more file on its branch.
    worktree = tmp_path / "wt"
    git(git_repo, "worktree", "add", "-q", str(worktree), two["result_branch"])
    (worktree / "extra.txt").write_text("only in the re-run\n")
    git(worktree, "add", "extra.txt")
    git(worktree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "extra")
    compared = (await api.get(f"/v1/outpost/runs/{first}/compare/{two['id']}")).body
    assert (compared["a"], compared["b"]) == (first, two["id"])
    assert (compared["same_commit"], compared["same_prompt"], compared["same_profile"]) == (True, True, True)
    assert "extra.txt" in compared["diff_stat"] and "+only in the re-run" in compared["diff"]
    assert [f["path"] for f in compared["files"]] == ["extra.txt"]
    assert (await api.post(f"/v1/outpost/runs/{first}/rerun", {})).status == 202
    store.close()


async def test_a_run_still_active_is_not_rerun_and_unknown_runs_are_404(tmp_path, git_repo):
    api = Api(make_deps(tmp_path), git_repo)
    run_id = (await api.post("/v1/outpost/dispatches", {"brief": "x", "repository": str(git_repo),
                                                         "agent": "demo"})).body["run_id"]
    assert (await api.post(f"/v1/outpost/runs/{run_id}/rerun", {})).status == 409
    assert (await api.get(f"/v1/outpost/runs/{run_id}/compare/out_nope")).status == 404


###############################################################################
# Charts
###############################################################################

async def test_the_chart_holds_one_bar_per_day_with_the_right_counts(tmp_path, git_repo):
    api = Api(make_deps(tmp_path), git_repo)
    sched = await api.schedule(timing=EVERY_10_MIN)
    store = api.store
    for minutes, status in ((5, "succeeded"), (6, "succeeded"), (7, "failed")):
        fired = call(store, store.schedules.fire_manual, sched["id"], 1, T0 - timedelta(days=2) + minutes * MIN)
        settle(store, fired["run_id"], status, T0 - timedelta(days=2) + (minutes + 1) * MIN,
               **({"error": "boom"} if status == "failed" else {}))
    reply = await api.get(f"/v1/outpost/charts/runs.svg?schedule_id={sched['id']}")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("image/svg+xml")
    svg = reply.text
    days = re.findall(r'<g class="day" data-day="([0-9-]+)">', svg)
    assert len(days) == outpost.CHART_DAYS and days[-1] == "2026-11-30" and days[-3] == "2026-11-28"
    day = svg.split('data-day="2026-11-28"')[1].split("</g>")[0]
    assert 'bar-succeeded" data-count="2"' in day and 'bar-failed" data-count="1"' in day
    assert "<title>2026-11-28: 2 succeeded, 1 failed</title>" in day
    assert "<script" not in svg
    assert (await api.get("/v1/outpost/charts/runs.svg?schedule_id=sch_nope")).status == 404


def test_a_chart_in_an_unknown_timezone_is_422_naming_tz_on_a_real_server(server_factory):
    server = server_factory()
    with server.client() as client:
        assert client.get("/v1/outpost/charts/runs.svg", params={"tz": "Europe/Berlin"}).status_code == 200
        for tz in ("Nope", "", "Europe", "../../etc/passwd", "x" * 100):
            reply = client.get("/v1/outpost/charts/runs.svg", params={"tz": tz})
            assert reply.status_code == 422, (tz, reply.status_code, reply.text[:200])
            assert reply.headers["content-type"] == "application/problem+json"
            assert [e["field"] for e in reply.json()["errors"]] == ["tz"]
    assert "Traceback" not in server.logs()

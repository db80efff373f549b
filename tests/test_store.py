"""Section 5 of outpost.py: the Store on a temporary SQLite file.

Every call goes through ``Store.run`` (one db_session each, events numbered last), the way
the daemon calls it. Races use two Store objects on one file: two connections, two threads."""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import T0, ended, normalized

import outpost
from outpost import RunStatus

REPO = "/srv/app"
MIN = timedelta(minutes=1)
SEC = timedelta(seconds=1)


class Tx:
    """``tx.schedules.claim_due(now)`` is ``store.transaction(store.schedules.claim_due, now)[0]``:
    one transaction per call, on the store or on one of its parts."""

    def __init__(self, store: outpost.Store, part: Any = None):
        self.store, self.part = store, part

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.part or self.store, name)
        if isinstance(target, outpost.StorePart):
            return Tx(self.store, target)
        return lambda *args, **kwargs: self.store.transaction(target, *args, **kwargs)[0]


@pytest.fixture
def tx(store) -> Tx:
    return Tx(store)


@pytest.fixture
def claimers(store, tmp_path: Path):
    """Two more Store objects on the same database file as ``store``: two more connections."""
    pair = [outpost.Store(store.database, data_dir=tmp_path) for _ in range(2)]
    yield [Tx(s) for s in pair]
    for s in pair:
        s.close()


def race(*calls: Callable[[], Any]) -> list[Any]:
    """Start the calls at the same moment, one thread each; each call's result or exception."""
    barrier = threading.Barrier(len(calls), timeout=10)
    results: list[Any] = [None] * len(calls)

    def go(i: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            results[i] = call()
        except Exception as exc:  # the test inspects what each claimer got
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a claimer hung"
    return results


def schedule(tx: Tx, **overrides) -> dict:
    """A */5 UTC cron schedule created at T0: its first fire is 08:05."""
    return tx.schedules.create_schedule(normalized(REPO, **overrides), T0)


def dispatch(tx: Tx, at) -> str:
    payload = {"brief": "@print hi", "repository": REPO, "workdir": ".", "source_ref": "HEAD", "agent": "demo",
               "limits": {"timeout_seconds": 60, "model": None}, "notify": "attention"}
    return tx.schedules.create_dispatch(payload, at)["run_id"]


def runs_of(tx: Tx, schedule_id: str) -> list[dict]:
    return tx.runs.list_runs(schedule_id, None, 500, None)["runs"]


def outcomes(tx: Tx, schedule_id: str) -> Counter:
    return Counter(o["outcome"] for o in tx.schedules.occurrences(schedule_id, 1000))


def run_due_slot(tx: Tx, now, status: RunStatus, *, commits: int = 0, error: str | None = None,
                 result: dict | None = None) -> str:
    """The one slot due at ``now``: claimed, admitted, settled with ``status``, notified."""
    [run_id] = tx.schedules.claim_due(now)
    assert tx.runs.admit_next(100, now) == (run_id, False)
    exit_code = 1 if status == RunStatus.FAILED else 0
    assert tx.runs.settle_run(run_id, ended(status, error=error, result=result), now, exit_code=exit_code,
                              commits=commits)
    tx.schedules.notify_run(run_id, now)
    return run_id


###############################################################################
# Schedules
###############################################################################

@pytest.mark.parametrize(("timing", "first_fire"), [
    ({"kind": "cron", "expression": "*/5 * * * *", "timezone": "UTC"}, "2026-11-30T08:05:00Z"),
    ({"kind": "cron", "expression": "0 9 * * *", "timezone": "Europe/Berlin"}, "2026-12-01T08:00:00Z"),
    ({"kind": "interval", "seconds": 600, "timezone": "UTC"}, "2026-11-30T08:10:00Z"),
    ({"kind": "once", "at": "2026-12-01T09:00:00", "timezone": "Europe/Berlin"}, "2026-12-01T08:00:00Z"),
])
def test_create_schedule_sets_its_first_fire(tx, timing, first_fire):
    definition = normalized(REPO, timing=timing)
    s = tx.schedules.create_schedule(definition, T0)
    assert s["next_fire_at"] == first_fire
    assert (s["revision"], s["enabled"], s["archived"], s["auto_paused"], s["failure_streak"]) == (
        1, True, False, False, 0)
    assert s["active_run_id"] is None and s["last_fired_at"] is None
    assert s["authority"] == {"confirmation": outpost.confirmation_of(definition),
                              "confirmed_at": "2026-11-30T08:00:00Z", "profile_digest": None}
    assert tx.schedules.get_schedule(s["id"]) == s


def test_schedule_name_is_unique_among_live_schedules_and_free_again_after_archive(tx):
    first = schedule(tx)
    with pytest.raises(outpost.Conflict) as caught:
        schedule(tx)
    assert caught.value.problem()["status"] == 409
    tx.schedules.control_schedule(first["id"], 1, "archive", T0)
    second = schedule(tx)
    assert second["id"] != first["id"]
    with pytest.raises(outpost.Conflict):
        schedule(tx)
    assert [s["id"] for s in tx.schedules.list_schedules()] == [second["id"]]
    assert {s["id"] for s in tx.schedules.list_schedules(True)} == {first["id"], second["id"]}


###############################################################################
# Claiming due slots
###############################################################################

def test_a_due_slot_creates_one_occurrence_and_one_queued_run_once(tx):
    s = schedule(tx)
    assert tx.schedules.claim_due(T0 + 5 * MIN - SEC) == []
    [run_id] = tx.schedules.claim_due(T0 + 5 * MIN)
    [occurrence] = tx.schedules.occurrences(s["id"])
    assert (occurrence["due_at"], occurrence["outcome"], occurrence["run_id"], occurrence["trigger"]) == (
        "2026-11-30T08:05:00Z", "admitted", run_id, "cron")
    run = tx.runs.get_run(run_id)
    assert (run["status"], run["trigger"], run["due_at"], run["schedule_id"], run["occurrence_id"]) == (
        "queued", "cron", "2026-11-30T08:05:00Z", s["id"], occurrence["id"])
    assert run["result_branch"] == f"outpost/nightly/{run_id}"
    assert tx.schedules.claim_due(T0 + 5 * MIN) == []                                 # the same instant again: nothing
    assert len(tx.schedules.occurrences(s["id"])) == 1 and len(runs_of(tx, s["id"])) == 1
    view = tx.schedules.get_schedule(s["id"])
    assert (view["next_fire_at"], view["active_run_id"]) == ("2026-11-30T08:10:00Z", run_id)


@pytest.mark.parametrize("active", ["queued", "running"])
@pytest.mark.parametrize(("policy", "outcome", "run_count"), [
    ("skip_if_active", "skipped_overlap", 1),
    ("coalesce_if_active", "coalesced", 1),
    ("always_enqueue", "admitted", 2),
])
def test_a_slot_due_while_a_run_is_active_follows_the_concurrency_policy(tx, policy, outcome, run_count, active):
    s = schedule(tx, concurrency_policy=policy)
    [first] = tx.schedules.claim_due(T0 + 5 * MIN)
    if active == "running":
        assert tx.runs.admit_next(2, T0 + 5 * MIN) == (first, False)
    tx.schedules.claim_due(T0 + 10 * MIN)
    [later] = [o for o in tx.schedules.occurrences(s["id"]) if o["due_at"] == "2026-11-30T08:10:00Z"]
    assert later["outcome"] == outcome
    if outcome != "admitted":
        assert later["run_id"] == first                                   # the ledger points at the active run
    assert len(runs_of(tx, s["id"])) == run_count


def test_skip_if_active_admits_again_once_the_active_run_settled(tx):
    s = schedule(tx)
    first = run_due_slot(tx, T0 + 5 * MIN, RunStatus.SUCCEEDED)
    [second] = tx.schedules.claim_due(T0 + 10 * MIN)
    assert second != first
    assert outcomes(tx, s["id"]) == {"admitted": 2}


def test_two_claimers_racing_for_one_due_slot_admit_it_exactly_once(tx, claimers):
    a, b = claimers
    now = T0 + 5 * MIN + SEC
    for i in range(20):
        s = schedule(tx, name=f"race-{i}")
        results = race(lambda: a.schedules.claim_due(now), lambda: b.schedules.claim_due(now))
        assert len(tx.schedules.occurrences(s["id"])) == 1
        [run] = runs_of(tx, s["id"])
        assert [r for r in results if isinstance(r, list) and r] == [[run["id"]]]


def test_the_losing_claimer_claims_nothing_instead_of_failing(tx, claimers):
    a, b = claimers
    now = T0 + 5 * MIN + SEC
    for i in range(20):
        schedule(tx, name=f"race-{i}")
        results = race(lambda: a.schedules.claim_due(now), lambda: b.schedules.claim_due(now))
        assert not [r for r in results if isinstance(r, Exception)], results
        assert sorted(len(r) for r in results) == [0, 1]


def test_two_claimers_racing_for_one_queued_run_start_it_exactly_once(tx, claimers):
    a, b = claimers
    for _ in range(20):
        run_id = dispatch(tx, T0)
        results = race(lambda: a.runs.admit_next(100, T0), lambda: b.runs.admit_next(100, T0))
        assert sorted(results, key=repr) == [(run_id, False), None]
        assert tx.runs.get_run(run_id)["status"] == "running"


def test_two_claimers_racing_never_exceed_max_running(tx, claimers):
    a, b = claimers
    for _ in range(20):
        dispatch(tx, T0)
        dispatch(tx, T0 + SEC)
        race(lambda: a.runs.admit_next(1, T0), lambda: b.runs.admit_next(1, T0))
        running = tx.runs.own_runs_in(["running"])
        assert len(running) <= 1, running
        for run_id in running:
            tx.runs.settle_run(run_id, ended(RunStatus.SUCCEEDED), T0)
        for run_id in tx.runs.own_runs_in(["queued"]):
            tx.runs.control_run(run_id, "cancel", T0)


###############################################################################
# Downtime and catch-up (docs/schedules.md)
###############################################################################

#: Back at 11:07:30 after the 08:05 run: the slots 08:10 ... 11:05 were missed.
RESTART = T0 + timedelta(hours=3, minutes=7, seconds=30)
MISSED = 36


def down_for_three_hours(tx, **overrides) -> tuple[str, list[str], list[dict]]:
    """Fire 08:05, go down, claim again at RESTART: (schedule id, new run ids, ledger rows of the gap)."""
    s = schedule(tx, **overrides)
    before = run_due_slot(tx, T0 + 5 * MIN, RunStatus.SUCCEEDED)
    queued = tx.schedules.claim_due(RESTART)
    assert set(queued) == {r["id"] for r in runs_of(tx, s["id"])} - {before}
    gap = [o for o in tx.schedules.occurrences(s["id"], 1000) if o["due_at"] != "2026-11-30T08:05:00Z"]
    assert len(gap) == MISSED                                          # every missed slot recorded once
    assert tx.schedules.get_schedule(s["id"])["next_fire_at"] == "2026-11-30T11:10:00Z"
    return s["id"], queued, gap


def test_restart_after_three_hours_queues_one_catch_up_run_carrying_the_missed_count(tx):
    _, queued, gap = down_for_three_hours(tx)
    [run_id] = queued
    run = tx.runs.get_run(run_id)
    assert (run["trigger"], run["missed_count"]) == ("catch_up", MISSED)
    assert Counter(o["outcome"] for o in gap) == {"admitted": 1, "folded": MISSED - 1}
    assert all(o["run_id"] == run_id for o in gap)
    assert f"missed {MISSED} occurrences since 2026-11-30 08:10" in tx.runs.launch_info(run_id)["prompt"]


def test_restart_under_skip_missed_queues_nothing_for_the_gap(tx):
    _, queued, gap = down_for_three_hours(tx, catch_up={"policy": "skip_missed"})
    assert queued == []
    assert Counter(o["outcome"] for o in gap) == {"skipped_missed": MISSED}


@pytest.mark.parametrize(("policy", "expected_runs"), [("skip_if_active", 1), ("always_enqueue", 3)])
def test_restart_with_catch_up_max_3_queues_at_most_three_runs(tx, policy, expected_runs):
    _, queued, _ = down_for_three_hours(tx, concurrency_policy=policy,
                                        catch_up={"policy": "enqueue_missed_with_cap", "max": 3})
    runs = [tx.runs.get_run(r) for r in queued]
    assert len(runs) == expected_runs
    assert all(r["trigger"] == "catch_up" for r in runs)
    if policy == "always_enqueue":
        assert sum(r["missed_count"] for r in runs) == MISSED


def test_a_slot_late_by_less_than_the_grace_fires_normally(tx):
    s = schedule(tx)
    [run_id] = tx.schedules.claim_due(T0 + 5 * MIN + 30 * SEC)
    assert (tx.runs.get_run(run_id)["trigger"], tx.runs.get_run(run_id)["missed_count"]) == ("cron", 0)
    assert outcomes(tx, s["id"]) == {"admitted": 1}


###############################################################################
# Pause, enable, admission
###############################################################################

def test_a_paused_schedule_records_its_slots_as_paused_and_enable_does_not_replay_them(tx):
    s = schedule(tx)
    tx.schedules.control_schedule(s["id"], 1, "pause", T0)
    assert tx.schedules.claim_due(T0 + 31 * MIN) == []
    assert outcomes(tx, s["id"]) == {"paused": 6}                     # 08:05 ... 08:30
    assert runs_of(tx, s["id"]) == []
    tx.schedules.control_schedule(s["id"], 2, "enable", T0 + 31 * MIN)
    assert tx.schedules.claim_due(T0 + 31 * MIN) == []
    [run_id] = tx.schedules.claim_due(T0 + 35 * MIN)
    assert tx.runs.get_run(run_id)["due_at"] == "2026-11-30T08:35:00Z"
    assert outcomes(tx, s["id"]) == {"paused": 6, "admitted": 1}


def test_admission_is_fifo_by_queued_at_within_max_running(tx):
    third, first, second = dispatch(tx, T0 + 3 * SEC), dispatch(tx, T0 + SEC), dispatch(tx, T0 + 2 * SEC)
    assert tx.runs.admit_next(2, T0) == (first, False)
    assert tx.runs.admit_next(2, T0) == (second, False)
    assert tx.runs.admit_next(2, T0) is None
    assert tx.runs.get_run(third)["status"] == "queued"
    tx.runs.settle_run(first, ended(RunStatus.SUCCEEDED), T0)
    assert tx.runs.admit_next(2, T0) == (third, False)
    assert tx.runs.admit_next(2, T0) is None


def test_a_paused_run_frees_its_slot_and_a_resumed_run_goes_before_queued_ones(tx):
    now = T0 + timedelta(microseconds=250_000)                         # a wall clock: never a whole second
    a, b, c = dispatch(tx, now + SEC), dispatch(tx, now + 2 * SEC), dispatch(tx, now + 3 * SEC)
    assert tx.runs.admit_next(1, now) == (a, False)
    assert tx.runs.admit_next(1, now) is None
    assert tx.runs.control_run(a, "pause", now)["status"] == "paused"
    assert tx.runs.admit_next(1, now) == (b, False)                         # a's slot is free
    tx.runs.control_run(a, "resume", now)
    assert tx.runs.admit_next(1, now) is None                               # b holds the only slot
    assert tx.runs.get_run(a)["status"] == "paused"
    tx.runs.settle_run(b, ended(RunStatus.SUCCEEDED), now)
    assert tx.runs.admit_next(1, now) == (a, True)                          # before c, queued earlier than the resume
    assert tx.runs.get_run(a)["status"] == "running"
    tx.runs.settle_run(a, ended(RunStatus.SUCCEEDED), now)
    assert tx.runs.admit_next(1, now) == (c, False)


@pytest.mark.parametrize("action", ["pause", "cancel", "adopt"])
def test_a_run_admitted_at_a_whole_second_can_be_paused_cancelled_and_adopted(tx, action):
    run_id = dispatch(tx, T0)
    assert tx.runs.admit_next(1, T0) == (run_id, False)
    if action == "adopt":
        assert tx.runs.adopt_run(run_id, "ws-1", T0 + SEC)["owner"] == "ws-1"
    else:
        assert tx.runs.control_run(run_id, action, T0 + SEC)["id"] == run_id


def test_instants_read_back_exactly_whichever_way_the_row_was_written(tx, store):
    at = T0 + timedelta(microseconds=123456)
    run_id = dispatch(tx, at)
    assert tx.runs.get_run(run_id)["queued_at"] == outpost.rfc3339(at)
    with outpost.orm.db_session:   # as sqlite3's own adapter writes a whole second: no fraction
        store.db.execute('UPDATE "Run" SET queued_at = $t WHERE id = $r', {"t": "2026-11-30 09:00:05", "r": run_id})
    assert tx.runs.get_run(run_id)["queued_at"] == outpost.rfc3339(T0.replace(hour=9, minute=0, second=5))


###############################################################################
# Settlement, failure streak, attention (docs/schedules.md, 5.6)
###############################################################################

def test_failure_streak_counts_failures_and_a_success_resets_it(tx):
    s = schedule(tx)
    streaks = []
    for i, status in enumerate([RunStatus.FAILED, RunStatus.FAILED, RunStatus.SUCCEEDED, RunStatus.FAILED,
                                RunStatus.NEEDS_YOU, RunStatus.FAILED]):
        run_due_slot(tx, T0 + (i + 1) * 5 * MIN, status)
        streaks.append(tx.schedules.get_schedule(s["id"])["failure_streak"])
    assert streaks == [1, 2, 0, 1, 1, 2]
    view = tx.schedules.get_schedule(s["id"])
    assert view["enabled"] and not view["auto_paused"]


@pytest.mark.parametrize("policy", [{"policy": "enqueue_missed_with_cap", "max": 1}, {"policy": "skip_missed"}])
def test_a_year_of_downtime_on_a_per_minute_cron_is_claimed_in_bounded_work(tx, monkeypatch, policy):
    """Defect 13: counting every missed slot made one claim walk 525,600 slots on the only
    writer thread (about an hour). The count stops at a cap and says "more than"; the newest
    slots come from a window ending at now; the next fire is the minute after now."""
    s = schedule(tx, timing={"kind": "cron", "expression": "* * * * *", "timezone": "Europe/Berlin"},
                 catch_up=policy)
    steps = 0
    real_next = outpost.croniter.get_next

    def counted(self, *args, **kwargs):
        nonlocal steps
        steps += 1
        return real_next(self, *args, **kwargs)
    monkeypatch.setattr(outpost.croniter, "get_next", counted)
    now = T0 + timedelta(days=365, seconds=30)
    queued = tx.schedules.claim_due(now)
    assert steps < 5 * outpost.MISSED_COUNT_CAP   # not one step per missed minute
    view = tx.schedules.get_schedule(s["id"])
    assert view["next_fire_at"] == outpost.rfc3339(now.replace(second=0) + timedelta(minutes=1))
    ledger = outcomes(tx, s["id"])
    assert sum(ledger.values()) <= outpost.LEDGER_KEEP
    (run_id,) = queued
    if policy["policy"] == "skip_missed":   # the slot just due (30 s ago) fires; the missed ones are skipped
        assert ledger["admitted"] == 1 and set(ledger) == {"admitted", "skipped_missed"}
        assert tx.runs.get_run(run_id)["trigger"] == "cron"
        return
    run = tx.runs.get_run(run_id)
    assert run["trigger"] == "catch_up" and run["missed_count"] > outpost.MISSED_COUNT_CAP
    assert "missed more than" in tx.runs.launch_info(run_id)["prompt"]


def test_three_restarts_during_runs_do_not_auto_pause_the_schedule(tx):
    """Defect 3: three runs interrupted by deploys are not three failures of the agent."""
    s = schedule(tx)
    for i in range(3):
        run_due_slot(tx, T0 + (i + 1) * 5 * MIN, RunStatus.FAILED, error=outpost.INTERRUPTED)
    view = tx.schedules.get_schedule(s["id"])
    assert (view["enabled"], view["auto_paused"], view["failure_streak"]) == (True, False, 0)
    assert not [a for a in tx.list_attention(False) if a["kind"] == "auto_pause"]


def test_three_failures_in_a_row_auto_pause_with_exactly_one_attention_item(tx):
    s = schedule(tx)
    last = None
    for i in range(3):
        last = run_due_slot(tx, T0 + (i + 1) * 5 * MIN, RunStatus.FAILED, error="tests failed")
    tx.schedules.notify_run(last, T0 + 16 * MIN)
    view = tx.schedules.get_schedule(s["id"])
    assert (view["enabled"], view["auto_paused"], view["failure_streak"]) == (False, True, 3)
    items = tx.list_attention(False)
    assert Counter(a["kind"] for a in items) == {"failed": 1, "auto_pause": 1}   # the failures fold into one
    assert next(a for a in items if a["kind"] == "failed")["count"] == 3
    [auto] = [a for a in items if a["kind"] == "auto_pause"]
    assert auto["schedule_id"] == s["id"]
    assert tx.schedules.claim_due(T0 + 26 * MIN) == []                           # auto-paused: its slots fire nothing
    assert outcomes(tx, s["id"])["paused"] == 2
    with pytest.raises(outpost.AutoPaused) as caught:
        tx.schedules.control_schedule(s["id"], view["revision"], "enable", T0 + 26 * MIN)
    assert caught.value.problem()["code"] == "auto_paused"
    view = tx.schedules.control_schedule(s["id"], view["revision"], "resume", T0 + 26 * MIN)
    assert (view["enabled"], view["auto_paused"], view["failure_streak"]) == (True, False, 0)
    assert len(tx.schedules.claim_due(T0 + 30 * MIN)) == 1


def test_a_run_failing_after_the_auto_pause_raises_no_second_auto_pause_item(tx):
    s = schedule(tx, concurrency_policy="always_enqueue")
    queued = [run for i in range(4) for run in tx.schedules.claim_due(T0 + (i + 1) * 5 * MIN)]
    assert len(queued) == 4
    for run_id in queued:
        tx.runs.settle_run(run_id, ended(RunStatus.FAILED, error="boom"), T0 + 21 * MIN, exit_code=1)
        tx.schedules.notify_run(run_id, T0 + 21 * MIN)
    assert tx.schedules.get_schedule(s["id"])["failure_streak"] == 4
    items = tx.list_attention(False)
    assert Counter(a["kind"] for a in items) == {"failed": 1, "auto_pause": 1}
    assert next(a for a in items if a["kind"] == "failed")["run_ids"] == queued[::-1]


@pytest.mark.parametrize(("notify", "status", "commits", "kinds"), [
    ("attention", RunStatus.SUCCEEDED, 0, []),
    ("attention", RunStatus.SUCCEEDED, 2, ["changes_returned"]),
    ("attention", RunStatus.FAILED, 0, ["failed"]),
    ("attention", RunStatus.NEEDS_YOU, 0, ["needs_you"]),
    ("failures_only", RunStatus.SUCCEEDED, 2, []),
    ("failures_only", RunStatus.FAILED, 0, ["failed"]),
    ("failures_only", RunStatus.NEEDS_YOU, 0, ["needs_you"]),
    ("always", RunStatus.SUCCEEDED, 0, ["succeeded"]),
    ("always", RunStatus.SUCCEEDED, 1, ["changes_returned"]),
    ("always", RunStatus.FAILED, 0, ["failed"]),
])
def test_a_settled_run_raises_the_attention_its_notify_policy_asks_for(tx, notify, status, commits, kinds):
    s = schedule(tx, notify=notify)
    result = {"status": "needs_you", "question": "Which database?"} if status == RunStatus.NEEDS_YOU else None
    run_id = run_due_slot(tx, T0 + 5 * MIN, status, commits=commits, error="exit 1: tests failed", result=result)
    items = tx.list_attention(True)
    assert [(a["kind"], a["run_id"], a["schedule_id"]) for a in items] == [(k, run_id, s["id"]) for k in kinds]
    details = {a["kind"]: a["detail"] for a in items}
    if "failed" in details:
        assert details["failed"] == "exit 1: tests failed"
    if "needs_you" in details:
        assert details["needs_you"] == "Which database?"
    if "changes_returned" in details:
        assert tx.runs.get_run(run_id)["result_branch"] in details["changes_returned"]


def test_notify_run_applies_a_settled_run_exactly_once(tx):
    s = schedule(tx)
    [run_id] = tx.schedules.claim_due(T0 + 5 * MIN)
    tx.runs.admit_next(1, T0 + 5 * MIN)
    tx.schedules.notify_run(run_id, T0 + 5 * MIN)                                # not settled yet: nothing to apply
    assert tx.list_attention(False) == [] and tx.runs.unnotified_runs() == []
    tx.runs.settle_run(run_id, ended(RunStatus.FAILED, error="boom"), T0 + 6 * MIN, exit_code=1)
    assert tx.runs.unnotified_runs() == [run_id]
    for _ in range(3):
        tx.schedules.notify_run(run_id, T0 + 6 * MIN)
    assert tx.runs.unnotified_runs() == []
    assert [a["kind"] for a in tx.list_attention(False)] == ["failed"]
    assert tx.schedules.get_schedule(s["id"])["failure_streak"] == 1


def test_settle_run_records_the_first_end_only(tx):
    schedule(tx)
    [run_id] = tx.schedules.claim_due(T0 + 5 * MIN)
    tx.runs.admit_next(1, T0 + 5 * MIN)
    assert tx.runs.settle_run(run_id, ended(RunStatus.FAILED, error="boom"), T0 + 6 * MIN, exit_code=1)
    assert not tx.runs.settle_run(run_id, ended(RunStatus.SUCCEEDED), T0 + 7 * MIN, exit_code=0)
    run = tx.runs.get_run(run_id)
    assert (run["status"], run["exit_code"], run["error"], run["finished_at"]) == (
        "failed", 1, "boom", "2026-11-30T08:06:00Z")


def test_a_runs_steps_ride_its_spawn_and_its_settlement_in_time_order(tx, store):
    """API.md 15: the timeline, to the millisecond: queued and settled are the run's own instants;
    the rest come with the writes a run makes anyway (its pid, its settlement)."""
    schedule(tx)
    [run_id] = tx.schedules.claim_due(T0 + 5 * MIN)
    tx.runs.admit_next(1, T0 + 5 * MIN)
    ms = outpost.instant_ms
    at = {"worktree_ready": T0 + 5 * MIN + 0.25 * SEC, "agent_started": T0 + 5 * MIN + 0.5 * SEC}
    assert tx.runs.mark_spawned(run_id, 4242, "1", (store.node, 1), {k: ms(v) for k, v in at.items()})
    assert [s["step"] for s in tx.runs.get_run(run_id)["steps"]] == ["queued", "worktree_ready", "agent_started"]
    at |= {"first_output": T0 + 5 * MIN + 0.5 * SEC + timedelta(milliseconds=7), "agent_exited": T0 + 6 * MIN,
           "branch_back": T0 + 6 * MIN + 0.125 * SEC}
    tx.runs.settle_run(run_id, ended(RunStatus.SUCCEEDED), T0 + 6 * MIN + 0.2 * SEC, commits=1,
                       steps={k: ms(v) for k, v in at.items()})
    assert tx.runs.get_run(run_id)["steps"] == [
        {"step": "queued", "at": "2026-11-30T08:05:00.000Z"},
        {"step": "worktree_ready", "at": "2026-11-30T08:05:00.250Z"},
        {"step": "agent_started", "at": "2026-11-30T08:05:00.500Z"},
        {"step": "first_output", "at": "2026-11-30T08:05:00.507Z"},
        {"step": "agent_exited", "at": "2026-11-30T08:06:00.000Z"},
        {"step": "branch_back", "at": "2026-11-30T08:06:00.125Z"},
        {"step": "settled", "at": "2026-11-30T08:06:00.200Z"}]


def test_a_run_settled_after_a_restart_keeps_the_steps_recorded_with_its_pid(tx, store):
    schedule(tx)
    [run_id] = tx.schedules.claim_due(T0 + 5 * MIN)
    tx.runs.admit_next(1, T0 + 5 * MIN)
    tx.runs.mark_spawned(run_id, 4242, "1", (store.node, 1), {"agent_started": "2026-11-30T08:05:01.000Z"})
    tx.runs.settle_run(run_id, ended(RunStatus.FAILED, error="interrupted"), T0 + 7 * MIN)   # no steps: none seen
    assert [s["step"] for s in tx.runs.get_run(run_id)["steps"]] == ["queued", "agent_started", "settled"]


###############################################################################
# Control and manual fire (docs/http-api.md)
###############################################################################

@pytest.mark.parametrize(("before", "action", "enabled"), [
    ([], "pause", False), (["pause"], "enable", True), (["pause"], "resume", True), ([], "archive", False),
])
def test_each_state_changing_control_adds_one_to_the_revision(tx, before, action, enabled):
    s = schedule(tx)
    for earlier in before:
        tx.schedules.control_schedule(s["id"], tx.schedules.get_schedule(s["id"])["revision"], earlier, T0)
    revision = tx.schedules.get_schedule(s["id"])["revision"]
    view = tx.schedules.control_schedule(s["id"], revision, action, T0 + MIN)
    assert (view["revision"], view["enabled"], view["updated_at"]) == (revision + 1, enabled, "2026-11-30T08:01:00Z")
    assert tx.schedules.get_schedule(s["id"]) == view


def test_resume_clears_the_failure_streak(tx):
    s = schedule(tx)
    run_due_slot(tx, T0 + 5 * MIN, RunStatus.FAILED)
    run_due_slot(tx, T0 + 10 * MIN, RunStatus.FAILED)
    assert tx.schedules.control_schedule(s["id"], 1, "resume", T0 + 11 * MIN)["failure_streak"] == 0


def test_stale_revision_is_refused_with_the_current_revision(tx):
    s = schedule(tx)
    tx.schedules.control_schedule(s["id"], 1, "pause", T0)
    with pytest.raises(outpost.RevisionMismatch) as caught:
        tx.schedules.control_schedule(s["id"], 1, "enable", T0)
    problem = caught.value.problem()
    assert (problem["status"], problem["code"], problem["current_revision"]) == (412, "revision_mismatch", 2)
    view = tx.schedules.get_schedule(s["id"])
    assert (view["revision"], view["enabled"]) == (2, False)
    with pytest.raises(outpost.RevisionMismatch):
        tx.schedules.fire_manual(s["id"], 1, T0)
    assert runs_of(tx, s["id"]) == []


@pytest.mark.parametrize("action", ["enable", "pause", "resume", "archive", "fire", "update"])
def test_archive_is_terminal(tx, action):
    s = schedule(tx)
    tx.schedules.control_schedule(s["id"], 1, "archive", T0)
    assert tx.schedules.get_schedule(s["id"])["next_fire_at"] is None
    with pytest.raises(outpost.Archived) as caught:
        if action == "fire":
            tx.schedules.fire_manual(s["id"], 2, T0 + MIN)
        elif action == "update":
            tx.schedules.update_schedule(s["id"], 2, normalized(REPO, brief="@print again"), T0 + MIN)
        else:
            tx.schedules.control_schedule(s["id"], 2, action, T0 + MIN)
    assert caught.value.problem()["status"] == 409 and caught.value.problem()["code"] == "archived"
    assert tx.schedules.claim_due(T0 + 10 * MIN) == []
    assert tx.schedules.occurrences(s["id"]) == [] and runs_of(tx, s["id"]) == []


def test_manual_fire_is_admitted_then_skipped_while_its_run_is_active(tx):
    s = schedule(tx)
    first = tx.schedules.fire_manual(s["id"], 1, T0 + SEC)
    assert first["outcome"] == "admitted"
    run = tx.runs.get_run(first["run_id"])
    assert (run["trigger"], run["occurrence_id"], run["status"]) == ("manual", first["occurrence_id"], "queued")
    queued = tx.schedules.fire_manual(s["id"], 1, T0 + 2 * SEC)
    assert (queued["outcome"], queued["run_id"]) == ("skipped_overlap", first["run_id"])
    assert tx.runs.admit_next(1, T0 + 3 * SEC) == (first["run_id"], False)
    running = tx.schedules.fire_manual(s["id"], 1, T0 + 4 * SEC)
    assert (running["outcome"], running["run_id"]) == ("skipped_overlap", first["run_id"])
    tx.runs.settle_run(first["run_id"], ended(RunStatus.SUCCEEDED), T0 + 5 * SEC)
    again = tx.schedules.fire_manual(s["id"], 1, T0 + 6 * SEC)
    assert again["outcome"] == "admitted" and again["run_id"] != first["run_id"]
    assert tx.schedules.get_schedule(s["id"])["revision"] == 1                    # fire is not a change of the schedule
    assert outcomes(tx, s["id"]) == {"admitted": 2, "skipped_overlap": 2}


def test_manual_fire_at_the_instant_of_an_already_claimed_slot_still_queues_a_run(tx):
    s = schedule(tx)
    slot = T0 + 5 * MIN
    run_due_slot(tx, slot, RunStatus.SUCCEEDED)
    fired = tx.schedules.fire_manual(s["id"], 1, slot)
    assert fired["outcome"] == "admitted"
    assert fired["run_id"] is not None and fired["occurrence_id"] is not None
    assert tx.runs.get_run(fired["run_id"])["trigger"] == "manual"


###############################################################################
# Idempotency keys (docs/http-api.md)
###############################################################################

STORED = {"body": {"id": "sch_1"}, "headers": {"ETag": '"1"'}}


def test_idempotency_key_is_reserved_then_replayed_for_24_hours(tx):
    assert tx.access.begin_idempotent("key-1", "fp", T0) is None
    tx.access.finish_idempotent("key-1", 201, STORED)
    assert tx.access.begin_idempotent("key-1", "fp", T0 + MIN) == (201, STORED)
    assert tx.access.begin_idempotent("key-1", "fp", T0 + timedelta(hours=23, minutes=59)) == (201, STORED)


def test_idempotency_key_expires_after_24_hours(tx):
    for key, at in (("old", T0), ("young", T0 + timedelta(hours=12))):
        tx.access.begin_idempotent(key, "fp", at)
        tx.access.finish_idempotent(key, 201, STORED)
    later = T0 + timedelta(hours=24, seconds=1)
    assert tx.access.begin_idempotent("old", "another request", later) is None     # free for a new request
    assert tx.access.begin_idempotent("young", "fp", later) == (201, STORED)
    assert tx.access.purge_expired(T0 + timedelta(hours=36, seconds=1)) == 1         # "young" goes, "old" was renewed


@pytest.mark.parametrize("finished", [True, False])
def test_same_key_for_a_different_request_is_refused(tx, finished):
    tx.access.begin_idempotent("key-1", "fp-create", T0)
    if finished:
        tx.access.finish_idempotent("key-1", 201, STORED)
    with pytest.raises(outpost.IdempotencyKeyReused) as caught:
        tx.access.begin_idempotent("key-1", "fp-other", T0 + MIN)
    assert caught.value.problem()["status"] == 422 and caught.value.problem()["code"] == "idempotency_key_reused"


def test_a_repeat_while_the_first_request_is_in_flight_is_a_conflict(tx):
    tx.access.begin_idempotent("key-1", "fp", T0)
    with pytest.raises(outpost.Conflict) as caught:
        tx.access.begin_idempotent("key-1", "fp", T0 + SEC)
    assert caught.value.problem()["status"] == 409


def test_forget_in_flight_frees_the_keys_of_a_process_that_died(tx):
    tx.access.begin_idempotent("died", "fp", T0)
    tx.access.begin_idempotent("done", "fp", T0)
    tx.access.finish_idempotent("done", 200, STORED)
    assert tx.access.forget_in_flight() == 1
    assert tx.access.begin_idempotent("died", "fp", T0 + MIN) is None
    assert tx.access.begin_idempotent("done", "fp", T0 + MIN) == (200, STORED)


def test_idempotency_keys_survive_a_restart(tmp_path):
    first = outpost.Store(tmp_path / "db.sqlite3")
    Tx(first).access.begin_idempotent("key-1", "fp", T0)
    Tx(first).access.finish_idempotent("key-1", 201, STORED)
    first.close()
    again = outpost.Store(tmp_path / "db.sqlite3")
    try:
        assert Tx(again).access.begin_idempotent("key-1", "fp", T0 + MIN) == (201, STORED)
    finally:
        again.close()


###############################################################################
# Events (docs/http-api.md)
###############################################################################

def busy_morning(tx: Tx) -> str:
    """A mix of writes, refused writes and reads; the schedule id."""
    s = schedule(tx)
    with pytest.raises(outpost.Conflict):
        schedule(tx)
    run_due_slot(tx, T0 + 5 * MIN, RunStatus.FAILED, error="boom")
    with pytest.raises(outpost.RevisionMismatch):
        tx.schedules.control_schedule(s["id"], 7, "pause", T0 + 6 * MIN)
    tx.schedules.get_schedule(s["id"])
    tx.schedules.fire_manual(s["id"], 1, T0 + 7 * MIN)
    tx.schedules.control_schedule(s["id"], 1, "pause", T0 + 8 * MIN)
    return s["id"]


def test_event_cursors_increase_by_one_without_gaps(tx):
    busy_morning(tx)
    page = tx.events_after(0, 1000)
    cursors = [e["cursor"] for e in page["events"]]
    assert cursors == list(range(1, len(cursors) + 1))
    assert page["next_cursor"] == cursors[-1] == tx.latest_cursor()
    assert {"schedule.created", "occurrence.claimed", "run.queued", "run.started", "run.settled",
            "attention.raised", "schedule.controlled"} <= {e["type"] for e in page["events"]}


def test_events_after_pages_through_the_whole_log(tx):
    busy_morning(tx)
    everything = tx.events_after(0, 1000)["events"]
    assert len(everything) > 6
    pages, cursor = [], 0
    while page := tx.events_after(cursor, 3)["events"]:
        assert len(page) <= 3
        assert tx.events_after(cursor, 3)["next_cursor"] == page[-1]["cursor"]
        pages += page
        cursor = page[-1]["cursor"]
    assert pages == everything
    assert tx.events_after(cursor, 3) == {"events": [], "next_cursor": cursor}


def test_store_run_reports_whether_events_were_written(store):
    s, wrote = store.transaction(store.schedules.create_schedule, normalized(REPO), T0)
    assert wrote
    assert store.transaction(store.schedules.get_schedule, s["id"]) == (s, False)
    assert store.transaction(store.schedules.claim_due, T0 + MIN) == ([], False)
    assert store.transaction(store.schedules.claim_due, T0 + 5 * MIN)[1]


###############################################################################
# Migrations
###############################################################################

def test_reopening_the_database_keeps_its_data(tmp_path):
    path = tmp_path / "outpost.sqlite3"
    first = outpost.Store(path)
    s = Tx(first).schedules.create_schedule(normalized(REPO), T0)
    [run_id] = Tx(first).schedules.claim_due(T0 + 5 * MIN)
    cursor = Tx(first).latest_cursor()
    first.close()
    again = outpost.Store(path)
    try:
        tx = Tx(again)
        assert tx.schedules.get_schedule(s["id"])["next_fire_at"] == "2026-11-30T08:10:00Z"
        assert tx.runs.get_run(run_id)["status"] == "queued"
        assert tx.latest_cursor() == cursor
        assert tx.schedules.claim_due(T0 + 5 * MIN) == []                       # the claimed slot stays claimed
        tx.schedules.control_schedule(s["id"], 1, "pause", T0 + 6 * MIN)
        assert [e["cursor"] for e in tx.events_after(cursor, 10)["events"]] == [cursor + 1]
    finally:
        again.close()


def test_a_database_from_a_newer_outpost_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "outpost.sqlite3"
    first = outpost.Store(path)
    Tx(first).schedules.create_schedule(normalized(REPO), T0)
    first.close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE schema_version SET version = ?", (outpost.SCHEMA_VERSION + 1,))
    with pytest.raises(outpost.SchemaTooNew):
        outpost.Store(path)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(outpost.SCHEMA_VERSION + 1,)]
        assert db.execute('SELECT COUNT(*) FROM "Schedule"').fetchone() == (1,)


def test_a_sqlite_file_not_made_by_outpost_is_refused(tmp_path):
    path = tmp_path / "other.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
    with pytest.raises(outpost.SchemaTooNew):
        outpost.Store(path)


def test_a_version_1_database_is_upgraded_in_place_keeping_its_data(tmp_path):
    """Version 2 added the dashboard's session and sign-in tables; a v1 file gains them at start."""
    path = tmp_path / "outpost.sqlite3"
    first = outpost.Store(path)
    s = Tx(first).schedules.create_schedule(normalized(REPO), T0)
    first.close()
    with sqlite3.connect(path) as db:   # make it the file an Outpost of schema version 1 left behind
        db.execute('DROP TABLE "DashboardSession"')
        db.execute('DROP TABLE "SigninCode"')
        db.execute("UPDATE schema_version SET version = 1")
    upgraded = outpost.Store(path)
    try:
        tx = Tx(upgraded)
        assert tx.schedules.get_schedule(s["id"])["name"] == s["name"]
        cookie, csrf = tx.access.create_session(T0)
        assert tx.access.session_csrf(cookie, T0) == csrf
    finally:
        upgraded.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(outpost.SCHEMA_VERSION,)]
        indexes = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "run_schedule_newest" in indexes   # version 3's index, added in place


def test_a_signin_code_works_once_and_only_while_fresh(store):
    tx = Tx(store)
    code = tx.access.create_signin_code(T0)
    assert tx.access.use_signin_code(code, T0 + MIN) is True
    assert tx.access.use_signin_code(code, T0 + MIN) is False
    late = tx.access.create_signin_code(T0)
    assert tx.access.use_signin_code(late, T0 + timedelta(seconds=outpost.SIGNIN_CODE_TTL_S + 1)) is False
    assert tx.access.use_signin_code("guessed", T0) is False


def test_a_session_ends_on_sign_out_and_on_expiry(store):
    tx = Tx(store)
    cookie, csrf = tx.access.create_session(T0)
    assert tx.access.session_csrf(cookie, T0 + timedelta(seconds=outpost.SESSION_TTL_S - 1)) == csrf
    assert tx.access.session_csrf(cookie, T0 + timedelta(seconds=outpost.SESSION_TTL_S + 1)) is None
    tx.access.end_session(cookie)
    assert tx.access.session_csrf(cookie, T0) is None


def test_migrate_copies_each_run_s_log_file_into_the_database(tmp_path):
    """Defect 9c: ``outpost migrate`` copied the tables but not the logs, which an appliance keeps
    as files: on PostgreSQL the old runs showed an empty log. Each file becomes the run's stored log."""
    source = outpost.Store(tmp_path / "appliance.sqlite3")
    target = outpost.Store(tmp_path / "target.sqlite3")   # the same copy a PostgreSQL target gets
    try:
        logged, silent = dispatch(Tx(source), T0), dispatch(Tx(source), T0)
        runs = tmp_path / "runs"
        runs.mkdir()
        (runs / f"{logged}.log").write_bytes(b"hello\n\xff the end\n")
        (runs / "out_not_a_run.log").write_bytes(b"stray")
        counts = source.copy_into(target, logs=runs)
        assert counts["LogChunk"] == 1 and counts["Run"] == 2
        assert Tx(target).runs.stored_log(logged) == b"hello\n\xff the end\n"
        assert Tx(target).runs.stored_log(silent) == b""
    finally:
        source.close()
        target.close()

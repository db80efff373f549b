"""One actor at a time, on real channels.

The cron and notification actors run under ``MockClock(autojump_threshold=0)``: a test
that names ``autojump_clock`` drives days of schedules in milliseconds, each guarded by
``trio.fail_after`` in mock time. The claim actor and its run supervisors start the real
demo agent in real git worktrees, so those tests use real time (``WallClock``, store calls
on the worker thread) under a ``trio.fail_after(30)`` guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import (
    HOUR,
    MINUTE,
    T0,
    Api,
    call,
    git,
    instant,
    make_deps,
    mock_deps_at,
    normalized,
    settle,
    until,
)

import outpost

DAY = 24 * HOUR
SETTLED = {str(s) for s in outpost.SETTLED_RUN_STATUSES}


# --- helpers -------------------------------------------------------------------------------------

def at(dt: datetime) -> str:
    return outpost.rfc3339(dt)


def ledger(store: outpost.Store, schedule_id: str) -> list[dict]:
    """The slot ledger of a schedule, oldest first."""
    return sorted(call(store, store.schedules.occurrences, schedule_id, 10_000), key=lambda o: o["due_at"])


def runs_of(store: outpost.Store, schedule_id: str) -> list[dict]:
    return call(store, store.runs.list_runs, schedule_id, None, 10_000, None)["runs"]


@contextlib.asynccontextmanager
async def actor_running(actor, *args):
    """Run one actor in a nursery for the body of the ``async with``, then cancel it."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor, *args)
        yield nursery
        nursery.cancel_scope.cancel()


@pytest.fixture
def head_sha(git_repo: Path) -> str:
    return git(git_repo, "rev-parse", "HEAD")


@pytest.fixture
def no_git_subprocess(monkeypatch, head_sha):
    """Fire step 2 (resolve source_ref) without a git subprocess.

    Under MockClock with autojump a real subprocess wait lets the clock jump to the next
    timer (the test's own sleep), so the cron tests resolve refs in-process."""
    async def resolve_ref(repository: str, ref: str) -> str:
        return head_sha
    monkeypatch.setattr(outpost, "resolve_ref", resolve_ref)


# --- cron actor ----------------------------------------------------------------------------------

async def test_cron_fires_each_five_minutes_over_a_day(autojump_clock, mock_deps, git_repo, no_git_subprocess):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    with trio.fail_after(DAY + HOUR):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep(DAY + 1)
    slots = ledger(store, sid)
    assert [o["due_at"] for o in slots] == [at(T0 + timedelta(minutes=5 * k)) for k in range(1, 289)]
    # Claimed at the due instant, not at the next poll.
    assert all(o["recorded_at"] == o["due_at"] for o in slots)
    # No claim actor: the first run stays queued, so every later slot is an overlap skip.
    runs = runs_of(store, sid)
    assert len(runs) == 1 and runs[0]["status"] == "queued"
    assert slots[0]["outcome"] == "admitted" and slots[0]["run_id"] == runs[0]["id"]
    assert {o["outcome"] for o in slots[1:]} == {"skipped_overlap"}
    assert {o["run_id"] for o in slots[1:]} == {runs[0]["id"]}
    assert runs[0]["trigger"] == "cron" and runs[0]["due_at"] == at(T0 + timedelta(minutes=5))
    assert runs[0]["resolved_commit"] is not None
    sched = call(store, store.schedules.get_schedule, sid)
    assert sched["next_fire_at"] == at(T0 + timedelta(days=1, minutes=5))


async def test_cron_always_enqueue_queues_one_run_per_slot(autojump_clock, mock_deps, git_repo, no_git_subprocess):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo, concurrency_policy="always_enqueue"),
               T0)["id"]
    with trio.fail_after(DAY + HOUR):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep(DAY + 1)
    slots = ledger(store, sid)
    runs = runs_of(store, sid)
    assert len(slots) == len(runs) == 288
    assert {o["outcome"] for o in slots} == {"admitted"}
    assert len({o["run_id"] for o in slots}) == 288
    assert sorted(r["due_at"] for r in runs) == [o["due_at"] for o in slots]
    assert {r["status"] for r in runs} == {"queued"}


async def test_cron_interval_fires_at_anchor_plus_k_seconds(autojump_clock, mock_deps, git_repo, no_git_subprocess):
    store = mock_deps.store
    anchor = T0 + timedelta(seconds=7 * MINUTE + 13)
    raw = normalized(git_repo, timing={"kind": "interval", "seconds": 4000, "timezone": "UTC"},
                     concurrency_policy="always_enqueue")
    with trio.fail_after(DAY + HOUR):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep((anchor - T0).total_seconds())
            sid = call(store, store.schedules.create_schedule, raw, mock_deps.clock.now())["id"]
            mock_deps.cron_wake.poke()
            await trio.sleep(DAY)
    slots = ledger(store, sid)
    expected = [anchor + timedelta(seconds=4000 * k) for k in range(1, DAY // 4000 + 1)]
    assert [o["due_at"] for o in slots] == [at(t) for t in expected]
    assert all(o["recorded_at"] == o["due_at"] and o["trigger"] == "interval" for o in slots)
    assert len(runs_of(store, sid)) == len(expected)


async def test_cron_once_fires_exactly_once(autojump_clock, mock_deps, git_repo, no_git_subprocess):
    store = mock_deps.store
    raw = normalized(git_repo, timing={"kind": "once", "at": "2026-11-30T10:30:00", "timezone": "Europe/Berlin"})
    sid = call(store, store.schedules.create_schedule, raw, T0)["id"]
    assert call(store, store.schedules.get_schedule, sid)["next_fire_at"] == "2026-11-30T09:30:00Z"
    with trio.fail_after(3 * DAY):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep(2 * DAY)
    slots = ledger(store, sid)
    assert [(o["due_at"], o["recorded_at"], o["trigger"], o["outcome"]) for o in slots] == [
        ("2026-11-30T09:30:00Z", "2026-11-30T09:30:00Z", "once", "admitted")]
    assert len(runs_of(store, sid)) == 1
    assert call(store, store.schedules.get_schedule, sid)["next_fire_at"] is None


async def test_a_slow_git_does_not_hold_back_the_next_fire(autojump_clock, mock_deps, git_repo, head_sha,
                                                           monkeypatch):
    """Fire step 2 (resolve source_ref) runs beside the cron actor, not in its way: a fire due
    while git is still resolving the previous one is claimed at its due instant."""
    async def slow_resolve_ref(repository: str, ref: str) -> str:
        await trio.sleep(5)
        return head_sha
    monkeypatch.setattr(outpost, "resolve_ref", slow_resolve_ref)
    store = mock_deps.store
    dues = {"first": "2026-11-30T09:00:00Z", "second": "2026-11-30T09:00:01Z"}
    ids = {name: call(store, store.schedules.create_schedule, normalized(
        git_repo, name=name, timing={"kind": "once", "at": due[:-1], "timezone": "UTC"}), T0)["id"]
        for name, due in dues.items()}
    with trio.fail_after(DAY):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep(2 * HOUR)
    for name, sid in ids.items():
        assert [(o["due_at"], o["recorded_at"]) for o in ledger(store, sid)] == [(dues[name], dues[name])]
        assert runs_of(store, sid)[0]["resolved_commit"] == head_sha


@pytest.mark.parametrize(("origin", "expected"), [
    # Spring forward: 02:30 does not exist on 2027-03-28, it fires at 03:00 CEST (01:00 UTC).
    (datetime(2027, 3, 27, 12, tzinfo=UTC),
     ["2027-03-28T01:00:00Z", "2027-03-29T00:30:00Z", "2027-03-30T00:30:00Z"]),
    # Fall back: 02:30 occurs twice on 2027-10-31, it fires once, at the first (CEST).
    (datetime(2027, 10, 30, 12, tzinfo=UTC),
     ["2027-10-31T00:30:00Z", "2027-11-01T01:30:00Z", "2027-11-02T01:30:00Z"]),
], ids=["spring-forward", "fall-back"])
async def test_cron_berlin_daily_across_dst(autojump_clock, tmp_path, store, git_repo, no_git_subprocess,
                                            origin, expected):
    deps = mock_deps_at(tmp_path, store, origin)
    raw = normalized(git_repo, now=origin, concurrency_policy="always_enqueue",
                     timing={"kind": "cron", "expression": "30 2 * * *", "timezone": "Europe/Berlin"})
    sid = call(store, store.schedules.create_schedule, raw, origin)["id"]
    with trio.fail_after(4 * DAY):
        async with actor_running(outpost.cron_actor, deps):
            await trio.sleep(3 * DAY - 1)
    slots = ledger(store, sid)
    assert [o["due_at"] for o in slots] == expected
    assert all(o["recorded_at"] == o["due_at"] and o["outcome"] == "admitted" for o in slots)
    berlin = [outpost.parse_instant(o["due_at"]).astimezone(outpost.ZoneInfo("Europe/Berlin")) for o in slots]
    assert len({b.date() for b in berlin}) == 3, "one fire per local day"
    if origin.month == 3:
        assert (berlin[0].hour, berlin[0].minute, berlin[0].tzname()) == (3, 0, "CEST")
    else:
        assert (berlin[0].hour, berlin[0].minute, berlin[0].tzname()) == (2, 30, "CEST")


async def test_cron_paused_schedule_records_paused_slots(autojump_clock, mock_deps, git_repo, no_git_subprocess):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    call(store, store.schedules.control_schedule, sid, 1, "pause", T0)
    with trio.fail_after(2 * DAY):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep(HOUR + 1)
            paused = ledger(store, sid)
            assert [o["due_at"] for o in paused] == [at(T0 + timedelta(minutes=5 * k)) for k in range(1, 13)]
            assert {o["outcome"] for o in paused} == {"paused"}
            assert runs_of(store, sid) == []
            call(store, store.schedules.control_schedule, sid, 2, "resume", mock_deps.clock.now())
            mock_deps.cron_wake.poke()
            await trio.sleep(5 * MINUTE)
    slots = ledger(store, sid)
    assert len(slots) == 13
    assert slots[-1]["due_at"] == at(T0 + timedelta(minutes=65)) and slots[-1]["outcome"] == "admitted"
    assert len(runs_of(store, sid)) == 1


async def test_cron_nudge_picks_up_an_earlier_next_fire(autojump_clock, mock_deps, git_repo, no_git_subprocess):
    """The actor sleeps up to CRON_MAX_SLEEP_S; a nudge makes it re-read the next fire."""
    store = mock_deps.store
    call(store, store.schedules.create_schedule, normalized(
        git_repo, name="far", timing={"kind": "once", "at": "2026-12-10T08:00:00Z", "timezone": "UTC"}), T0)
    with trio.fail_after(DAY):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep(10)
            soon = normalized(git_repo, now=mock_deps.clock.now(), name="soon",
                              timing={"kind": "once", "at": "2026-11-30T08:01:00Z", "timezone": "UTC"})
            sid = call(store, store.schedules.create_schedule, soon, mock_deps.clock.now())["id"]
            mock_deps.cron_wake.poke()
            await trio.sleep(2 * MINUTE)
    assert [(o["due_at"], o["recorded_at"], o["trigger"]) for o in ledger(store, sid)] == [
        ("2026-11-30T08:01:00Z", "2026-11-30T08:01:00Z", "once")]


async def test_cron_without_nudge_notices_a_new_schedule_only_at_its_longest_sleep(
        autojump_clock, mock_deps, git_repo, no_git_subprocess):
    store = mock_deps.store
    call(store, store.schedules.create_schedule, normalized(
        git_repo, name="far", timing={"kind": "once", "at": "2026-12-10T08:00:00Z", "timezone": "UTC"}), T0)
    with trio.fail_after(DAY):
        async with actor_running(outpost.cron_actor, mock_deps):
            await trio.sleep(10)
            soon = normalized(git_repo, now=mock_deps.clock.now(), name="soon",
                              timing={"kind": "once", "at": "2026-11-30T08:01:00Z", "timezone": "UTC"})
            sid = call(store, store.schedules.create_schedule, soon, mock_deps.clock.now())["id"]
            await trio.sleep(outpost.CRON_MAX_SLEEP_S + MINUTE)
    [slot] = ledger(store, sid)
    assert slot["recorded_at"] == at(T0 + timedelta(seconds=outpost.CRON_MAX_SLEEP_S))


class CountingSchedules(outpost.ScheduleStore):
    """The schedules part, counting how often the cron actor asks for due slots."""

    claims = 0

    def claim_due(self, now, grace_s=outpost.MISFIRE_GRACE_S, **kw):
        self.claims += 1
        return super().claim_due(now, grace_s, **kw)


class CountingStore(outpost.Store):
    """A store whose schedules part counts the cron actor's claims."""

    def __init__(self, database, **kwargs):
        super().__init__(database, **kwargs)
        self.schedules = CountingSchedules(self, self.runs)

    @property
    def claims(self) -> int:
        return self.schedules.claims


async def test_cron_idle_actor_does_not_poll(autojump_clock, tmp_path, git_repo):
    store = CountingStore(tmp_path / "counting.sqlite3")
    try:
        deps = mock_deps_at(tmp_path, store, T0)
        sid = call(store, store.schedules.create_schedule, normalized(
            git_repo, timing={"kind": "once", "at": "2026-12-10T08:00:00Z", "timezone": "UTC"}), T0)["id"]
        with trio.fail_after(DAY):
            async with actor_running(outpost.cron_actor, deps):
                await trio.sleep(HOUR)
        assert 1 <= store.claims <= HOUR / outpost.CRON_MAX_SLEEP_S + 2
        assert ledger(store, sid) == []
    finally:
        store.close()


# --- "the scheduler was down for 3 hours" ----------------------------------------------------------

@pytest.mark.parametrize("late_s", [
    30,
    90,
], ids=["back-30s-after-a-slot", "back-90s-after-a-slot"])
async def test_scheduler_down_three_hours_catches_up_once(autojump_clock, tmp_path, store, git_repo,
                                                          no_git_subprocess, late_s):
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    deps = mock_deps_at(tmp_path, store, T0 + timedelta(hours=3, seconds=late_s))
    with trio.fail_after(DAY):
        async with actor_running(outpost.cron_actor, deps):
            await trio.sleep(1)
    runs = runs_of(store, sid)
    assert len(runs) == 1, "never a storm"
    [run] = runs
    assert run["trigger"] == "catch_up"
    assert run["missed_count"] == 36
    prompt = call(store, store.runs.launch_info, run["id"])["prompt"]
    assert "missed 36 occurrences since 2026-11-30 08:05 UTC" in prompt
    slots = ledger(store, sid)
    assert len(slots) == 36
    assert {o["run_id"] for o in slots} == {run["id"]}
    assert sum(o["outcome"] == "admitted" for o in slots) == 1


async def test_scheduler_down_three_hours_skip_missed(autojump_clock, tmp_path, store, git_repo, no_git_subprocess):
    sid = call(store, store.schedules.create_schedule, normalized(git_repo, catch_up={"policy": "skip_missed"}),
               T0)["id"]
    back = T0 + timedelta(hours=3, seconds=30)
    deps = mock_deps_at(tmp_path, store, back)
    with trio.fail_after(DAY):
        async with actor_running(outpost.cron_actor, deps):
            await trio.sleep(1)
            # The next regular slot (11:05) fires as usual.
            await trio.sleep(5 * MINUTE)
    runs = runs_of(store, sid)
    assert all(r["trigger"] == "cron" for r in runs), "no catch-up run"
    assert all(outpost.parse_instant(r["due_at"]) >= back - timedelta(seconds=outpost.MISFIRE_GRACE_S)
               for r in runs), "no run for a slot of the gap"
    assert len(runs) <= 2, "never a storm"
    slots = ledger(store, sid)
    gap = [o for o in slots if outpost.parse_instant(o["due_at"]) < back - timedelta(seconds=outpost.MISFIRE_GRACE_S)]
    assert len(gap) == 35 and {o["outcome"] for o in gap} == {"skipped_missed"}
    assert any(o["due_at"] == at(T0 + timedelta(hours=3, minutes=5)) for o in slots)


# --- notification actor -----------------------------------------------------------------------------

def settle_fired_run(store: outpost.Store, sid: str, status: str, now: datetime, *, commits: int = 0,
                     error: str | None = None, result: dict | None = None) -> str:
    """A manual fire, claimed and settled in the store (the claim actor's part, without a process)."""
    revision = call(store, store.schedules.get_schedule, sid)["revision"]
    run_id = call(store, store.schedules.fire_manual, sid, revision, now)["run_id"]
    settle(store, run_id, status, now, error=error, result=result, commits=commits)
    return run_id


def test_two_manual_fires_at_one_instant_both_queue_a_run(store, git_repo):
    sid = call(store, store.schedules.create_schedule, normalized(git_repo, concurrency_policy="always_enqueue"),
               T0)["id"]
    first = call(store, store.schedules.fire_manual, sid, 1, T0)
    second = call(store, store.schedules.fire_manual, sid, 1, T0)
    assert first["outcome"] == second["outcome"] == "admitted"
    assert second["run_id"] is not None and second["run_id"] != first["run_id"]
    assert sorted(o["due_at"] for o in ledger(store, sid)) == ["2026-11-30T08:00:00.001Z", "2026-11-30T08:00:00Z"]


def attention(store: outpost.Store) -> list[dict]:
    return sorted(call(store, store.list_attention, False), key=lambda a: a["created_at"])


async def test_notification_raises_attention_per_outcome(autojump_clock, mock_deps, git_repo):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    tx = mock_deps.settled.tx
    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.notification_actor, mock_deps)
            async with tx:
                now = mock_deps.clock.now()
                quiet = settle_fired_run(store, sid, "succeeded", now)
                await tx.send(outpost.RunSettled(quiet))
                await trio.sleep(1)
                assert attention(store) == []
                changes = settle_fired_run(store, sid, "succeeded", mock_deps.clock.now(), commits=2)
                await tx.send(outpost.RunSettled(changes))
                await trio.sleep(1)
                failed = settle_fired_run(store, sid, "failed", mock_deps.clock.now(), error="boom")
                await tx.send(outpost.RunSettled(failed))
                await trio.sleep(1)
                assert call(store, store.schedules.get_schedule, sid)["failure_streak"] == 1
                asked = settle_fired_run(store, sid, "needs_you", mock_deps.clock.now(),
                                         result={"status": "needs_you", "question": "Which DB?"})
                await tx.send(outpost.RunSettled(asked))
                await trio.sleep(1)
                # The same message twice is applied once.
                await tx.send(outpost.RunSettled(failed))
                await trio.sleep(1)
        # The actor ended on its own when its channel closed.
    items = attention(store)
    assert [(a["kind"], a["run_id"]) for a in items] == [
        ("changes_returned", changes), ("failed", failed), ("needs_you", asked)]
    assert all(a["schedule_id"] == sid and a["acknowledged_at"] is None for a in items)
    assert items[1]["detail"] == "boom"
    assert items[2]["detail"] == "Which DB?"
    sched = call(store, store.schedules.get_schedule, sid)
    assert sched["failure_streak"] == 1 and sched["enabled"] and not sched["auto_paused"]


async def test_notification_success_resets_the_failure_streak(autojump_clock, mock_deps, git_repo):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    tx = mock_deps.settled.tx
    streaks = []
    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery, tx:
            nursery.start_soon(outpost.notification_actor, mock_deps)
            for status in ("failed", "failed", "succeeded", "failed"):
                await tx.send(outpost.RunSettled(settle_fired_run(store, sid, status, mock_deps.clock.now())))
                await trio.sleep(1)
                streaks.append(call(store, store.schedules.get_schedule, sid)["failure_streak"])
    assert streaks == [1, 2, 0, 1]
    assert not call(store, store.schedules.get_schedule, sid)["auto_paused"]


async def test_notification_three_failures_auto_pause_once(autojump_clock, mock_deps, git_repo):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    tx = mock_deps.settled.tx
    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery, tx:
            nursery.start_soon(outpost.notification_actor, mock_deps)
            for n in range(1, 5):
                await tx.send(outpost.RunSettled(settle_fired_run(store, sid, "failed", mock_deps.clock.now(),
                                                                  error=f"failure {n}")))
                await trio.sleep(1)
                sched = call(store, store.schedules.get_schedule, sid)
                assert sched["enabled"] == (n < 3) and sched["auto_paused"] == (n >= 3)
    kinds = [a["kind"] for a in attention(store)]
    assert kinds.count("auto_pause") == 1
    assert kinds.count("failed") == 1   # the four failures fold into one open item
    assert next(a for a in attention(store) if a["kind"] == "failed")["count"] == 4
    sched = call(store, store.schedules.get_schedule, sid)
    assert sched["failure_streak"] == 4
    # Only resume re-enables it.
    with pytest.raises(outpost.AutoPaused):
        call(store, store.schedules.control_schedule, sid, sched["revision"], "enable", mock_deps.clock.now())
    resumed = call(store, store.schedules.control_schedule, sid, sched["revision"], "resume", mock_deps.clock.now())
    assert resumed["enabled"] and not resumed["auto_paused"] and resumed["failure_streak"] == 0


async def test_notification_applies_runs_settled_before_a_crash_at_start(autojump_clock, mock_deps, git_repo):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    # Settled by a process that died before its notification actor saw them.
    before = [settle_fired_run(store, sid, "failed", T0 + timedelta(seconds=n), error=f"lost {n}") for n in range(3)]
    tx = mock_deps.settled.tx
    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery, tx:
            nursery.start_soon(outpost.notification_actor, mock_deps)
            await trio.sleep(1)
            items = attention(store)
            (failed,) = [a for a in items if a["kind"] == "failed"]   # folded, each run counted once
            assert sorted(failed["run_ids"]) == sorted(before) and failed["count"] == 3
            assert [a["kind"] for a in items].count("auto_pause") == 1
            # A late message for one of them changes nothing.
            await tx.send(outpost.RunSettled(before[0]))
            await trio.sleep(1)
    assert len(attention(store)) == 2
    sched = call(store, store.schedules.get_schedule, sid)
    assert sched["failure_streak"] == 3 and sched["auto_paused"]
    assert call(store, store.runs.unnotified_runs) == []


async def test_notification_sweep_applies_a_run_whose_message_was_lost(autojump_clock, mock_deps, git_repo):
    store = mock_deps.store
    sid = call(store, store.schedules.create_schedule, normalized(git_repo), T0)["id"]
    tx = mock_deps.settled.tx
    with trio.fail_after(HOUR):
        async with trio.open_nursery() as nursery, tx:
            nursery.start_soon(outpost.notification_actor, mock_deps)
            await trio.sleep(1)
            lost = settle_fired_run(store, sid, "failed", mock_deps.clock.now(), error="no message")
            await trio.sleep(outpost.NOTIFY_SWEEP_S + 1)
            assert [(a["kind"], a["run_id"]) for a in attention(store)] == [("failed", lost)]
    assert call(store, store.schedules.get_schedule, sid)["failure_streak"] == 1


# --- claim actor + run supervisor, with the real demo agent (real time) ---------------------------------

ENV_DUMP = outpost.AgentProfile("envdump", ("sh", "-c", "env > env.txt"))
LEAKY = outpost.AgentProfile("leaky", ("sh", "-c", "env > env.txt"),
                             env=(("NOTIFY_SOCKET", "/run/notify"), ("WATCHDOG_USEC", "1")),
                             pass_env=(*outpost.DEFAULT_PASS_ENV, "OUTPOST_API_TOKEN", "SECRET_OF_THE_DAEMON"))
MISSING = outpost.AgentProfile("missing", ("/nonexistent/agent",))


@pytest.fixture
def real_deps(tmp_path: Path, store: outpost.Store):
    """Deps on the wall clock with store calls on the worker thread, as in production."""
    def make(max_running: int = 2) -> outpost.Deps:
        config = outpost.Config(data_dir=tmp_path / "data", max_running=max_running,
                                agents=(outpost.demo_profile(), ENV_DUMP, LEAKY, MISSING))
        return outpost.Deps(config=config, store=store, clock=outpost.WallClock(), token="t",
                            inline_db=False, grace_s=1.0)
    return make


async def queue_dispatch(deps: outpost.Deps, repo: Path, brief: str, *, resolve: bool = True, **fields) -> str:
    """A one-shot run as POST /v1/outpost/dispatches queues it (resolve=False: the ref is left
    for the supervisor, as when resolution failed at queue time)."""
    raw = {"name": "dispatch", "brief": brief, "repository": str(repo), "agent": "demo",
           "timing": {"kind": "interval", "seconds": 3600, "timezone": "UTC"}, **fields}
    payload = outpost.normalize_definition(raw, deps.clock.now(), agents=[a.name for a in deps.config.agents])
    run_id = (await deps.transaction(deps.store.schedules.create_dispatch, payload, deps.clock.now()))["run_id"]
    if resolve:
        await outpost.resolve_new_runs(deps, [run_id])
    deps.claim_wake.poke()
    return run_id


async def get_run(deps: outpost.Deps, run_id: str) -> dict:
    return await deps.transaction(deps.store.runs.get_run, run_id)


async def until_status(deps: outpost.Deps, run_id: str, statuses=SETTLED) -> dict:
    while True:
        run = await get_run(deps, run_id)
        if run["status"] in statuses:
            return run
        await trio.sleep(0.05)


def branch_exists(repo: Path, branch: str) -> bool:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}"],
                          capture_output=True).returncode == 0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_claim_max_running_one_runs_fifo_one_after_the_other(real_deps, git_repo):
    deps = real_deps(max_running=1)
    with trio.fail_after(30):
        first = await queue_dispatch(deps, git_repo, "@sleep 0.5\n@print first")
        second = await queue_dispatch(deps, git_repo, "@print second")
        async with actor_running(outpost.claim_actor, deps):
            a = await until_status(deps, first)
            b = await until_status(deps, second)
    assert a["status"] == b["status"] == "succeeded"
    assert instant(b["started_at"]) >= instant(a["finished_at"])
    assert "first" in outpost.read_log(deps.log_path(first))[0]


async def test_run_commits_and_leftovers_return_on_the_result_branch(real_deps, git_repo):
    deps = real_deps()
    head = git(git_repo, "rev-parse", "HEAD")
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "@commit notes.txt hi\n@edit extra.txt x")
        async with actor_running(outpost.claim_actor, deps):
            run = await until_status(deps, run_id)
    assert run["status"] == "succeeded", run
    assert run["resolved_commit"] == head
    assert run["changes"]["commits"] == 2
    assert run["result"]["status"] == "succeeded"
    branch = run["result_branch"]
    assert branch == f"outpost/dispatch/{run_id}"
    assert branch_exists(git_repo, branch)
    assert git(git_repo, "show", f"{branch}:notes.txt") == "hi"
    assert git(git_repo, "show", f"{branch}:extra.txt") == "x"
    assert git(git_repo, "rev-list", "--count", f"{head}..{branch}") == "2"
    assert not deps.worktree(run_id).exists()
    assert str(deps.worktree(run_id)) not in git(git_repo, "worktree", "list")
    assert git(git_repo, "rev-parse", "HEAD") == head, "the repository's own checkout is untouched"


async def test_leftover_edits_are_saved_under_a_users_signing_config_and_failing_hook(real_deps, git_repo):
    """Defect 1: with commit.gpgsign=true (and no working gpg) or a failing pre-commit hook in
    the user's git config, saving the agent's leftovers failed: the run settled succeeded with
    0 commits and the worktree was deleted with the edits in it. Outpost's own commits do not
    depend on the user's signing or hooks."""
    git(git_repo, "config", "commit.gpgsign", "true")
    git(git_repo, "config", "gpg.program", "false")   # a signer that always fails
    hooks = git_repo / ".git" / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "pre-commit").write_text("#!/bin/sh\nexit 1\n")
    (hooks / "pre-commit").chmod(0o755)
    deps = real_deps()
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "@edit notes.txt kept")
        async with actor_running(outpost.claim_actor, deps):
            run = await until_status(deps, run_id)
    assert run["status"] == "succeeded" and run["changes"]["commits"] == 1, run
    assert git(git_repo, "show", f"{run['result_branch']}:notes.txt") == "kept"


LOCKS_THE_INDEX = outpost.AgentProfile("locker", ("sh", "-c", 'echo edited > notes.txt; '
                                                               'touch "$(git rev-parse --git-dir)/index.lock"'))


async def test_a_leftover_save_that_fails_keeps_the_worktree_and_fails_the_run(tmp_path, store, git_repo):
    """Defect 1: if saving still fails, the worktree is kept, the run fails with the reason and
    an attention item names the worktree's path; nothing is deleted with edits in it."""
    deps = make_deps(tmp_path / "data", store=store, clock=outpost.WallClock(),
                     agents=(outpost.demo_profile(), LOCKS_THE_INDEX))
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "edit and lock", agent="locker")
        async with actor_running(outpost.claim_actor, deps):
            run = await until_status(deps, run_id)
    worktree = deps.worktree(run_id)
    assert run["status"] == "failed", run
    assert "could not be saved" in run["error"] and str(worktree) in run["error"]
    assert (worktree / "notes.txt").read_text() == "edited\n"
    (item,) = [a for a in call(store, store.list_attention, True) if a["kind"] == "worktree_kept"]
    assert item["run_id"] == run_id and str(worktree) in item["detail"]


async def test_run_fail_needs_you_and_workdir(real_deps, git_repo):
    deps = real_deps()
    with trio.fail_after(30):
        failed = await queue_dispatch(deps, git_repo, "@print before\n@fail boom")
        asked = await queue_dispatch(deps, git_repo, "@needs-you Which DB?")
        in_sub = await queue_dispatch(deps, git_repo, "@edit here.txt y", workdir="sub")
        no_dir = await queue_dispatch(deps, git_repo, "@print never", workdir="nope/deeper")
        async with actor_running(outpost.claim_actor, deps):
            runs = {rid: await until_status(deps, rid) for rid in (failed, asked, in_sub, no_dir)}
    assert runs[failed]["status"] == "failed" and "boom" in runs[failed]["error"]
    assert runs[failed]["exit_code"] == 1
    assert runs[asked]["status"] == "needs_you"
    assert runs[asked]["result"] == {"status": "needs_you", "question": "Which DB?",
                                     "session_id": runs[asked]["agent_report"]["session_id"]}
    assert runs[asked]["question"] == "Which DB?"
    assert runs[in_sub]["status"] == "succeeded"
    assert git(git_repo, "show", f"{runs[in_sub]['result_branch']}:sub/here.txt") == "y"
    assert runs[no_dir]["status"] == "failed"
    assert "workdir" in runs[no_dir]["error"] and "nope/deeper" in runs[no_dir]["error"]
    assert "workdir" in outpost.read_log(deps.log_path(no_dir))[0]
    assert not any(deps.worktree(rid).exists() for rid in runs)


async def test_run_timeout_fails_and_ends_the_process(real_deps, git_repo):
    deps = real_deps()
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "@sleep 30", limits={"timeout_seconds": 1})
        async with actor_running(outpost.claim_actor, deps):
            started = time.monotonic()
            run = await until_status(deps, run_id)
            elapsed = time.monotonic() - started
    assert run["status"] == "failed"
    assert run["error"].startswith("timeout")
    assert elapsed < 1 + deps.grace_s + 5
    pid = (await deps.transaction(deps.store.runs.launch_info, run_id))["pid"]
    assert pid and not group_alive(pid)


async def test_run_cancel_ends_a_running_run_and_a_queued_one_never_starts(real_deps, git_repo):
    deps = real_deps(max_running=1)
    store = deps.store
    with trio.fail_after(30):
        running = await queue_dispatch(deps, git_repo, "@sleep 30")
        waiting = await queue_dispatch(deps, git_repo, "@print never")
        async with actor_running(outpost.claim_actor, deps):
            await until(lambda: deps.live.has_process(running))
            pid = deps.live.get(running).pid
            cancelled_queued = await deps.transaction(store.runs.control_run, waiting, "cancel", deps.clock.now())
            assert cancelled_queued["status"] == "cancelled"
            await deps.transaction(store.runs.control_run, running, "cancel", deps.clock.now())
            deps.live.get(running).cancel()
            deps.claim_wake.poke()
            run = await until_status(deps, running)
            with pytest.raises(outpost.Conflict):
                await deps.transaction(store.runs.control_run, running, "cancel", deps.clock.now())
    assert run["status"] == "cancelled"
    assert not group_alive(pid)
    never = await get_run(deps, waiting)
    assert never["status"] == "cancelled" and never["started_at"] is None
    assert not deps.log_path(waiting).exists()


async def test_profile_timeout_caps_the_run_limit(real_deps, git_repo, tmp_path, store):
    config = outpost.Config(data_dir=tmp_path / "capped", agents=(
        outpost.AgentProfile("demo", outpost.demo_profile().command, timeout_seconds=1),))
    deps = outpost.Deps(config=config, store=store, clock=outpost.WallClock(), token="t", grace_s=1.0)
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "@sleep 30", limits={"timeout_seconds": 3600})
        async with actor_running(outpost.claim_actor, deps):
            run = await until_status(deps, run_id)
    assert run["status"] == "failed" and run["error"].startswith("timeout")


async def test_run_missing_agent_command_fails_and_the_actor_keeps_going(real_deps, git_repo):
    deps = real_deps(max_running=1)
    with trio.fail_after(30):
        broken = await queue_dispatch(deps, git_repo, "@print hi", agent="missing")
        later = await queue_dispatch(deps, git_repo, "@print still here")
        async with actor_running(outpost.claim_actor, deps):
            bad = await until_status(deps, broken)
            good = await until_status(deps, later)
    assert bad["status"] == "failed"
    assert "/nonexistent/agent" in bad["error"] and "could not start" in bad["error"]
    assert good["status"] == "succeeded"
    assert "still here" in outpost.read_log(deps.log_path(later))[0]


async def test_run_repository_deleted_after_queueing(real_deps, git_repo, tmp_path):
    deps = real_deps()
    doomed = tmp_path / "doomed"
    shutil.copytree(git_repo, doomed)
    with trio.fail_after(30):
        unresolved = await queue_dispatch(deps, doomed, "@print hi", resolve=False)
        resolved = await queue_dispatch(deps, doomed, "@print hi")
        shutil.rmtree(doomed)
        async with actor_running(outpost.claim_actor, deps):
            first = await until_status(deps, unresolved)
            second = await until_status(deps, resolved)
    assert first["status"] == "failed" and "does not exist" in first["error"]
    assert str(doomed) in first["error"]
    # Resolved at queue time (as the API and the cron actor do): still a clear failure.
    assert second["status"] == "failed" and second["error"]
    assert str(doomed) in second["error"]


async def test_git_that_cannot_start_at_settlement_fails_its_run_and_not_the_daemon(real_deps, git_repo,
                                                                                      monkeypatch):
    """Found by attack: with the machine's processes at their limit (another run's fork bomb under a
    shared TasksMax), the git that counts a run's commits could not fork; its LaunchError left the
    run supervisor and took the claim actor, and the daemon, down. The run is failed, its worktree
    kept, and the next run starts."""
    deps = real_deps()
    real = outpost.count_commits
    failing = {"left": 1}

    async def count_commits(*args):
        if failing["left"]:
            failing["left"] -= 1
            raise outpost.LaunchError("could not run git: [Errno 11] Resource temporarily unavailable")
        return await real(*args)
    monkeypatch.setattr(outpost, "count_commits", count_commits)
    with trio.fail_after(30):
        starved = await queue_dispatch(deps, git_repo, "@edit notes.txt x")
        async with actor_running(outpost.claim_actor, deps):
            run = await until_status(deps, starved)
            after = await until_status(deps, await queue_dispatch(deps, git_repo, "@print next"))
    assert run["status"] == "failed"
    assert run["error"].startswith("the run's commits could not be counted (could not run git: [Errno 11]")
    assert after["status"] == "succeeded"


async def test_run_source_ref_deleted_after_queueing(real_deps, git_repo):
    deps = real_deps()
    git(git_repo, "branch", "feature")
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "@print hi", resolve=False, source_ref="feature")
        git(git_repo, "branch", "-D", "feature")
        async with actor_running(outpost.claim_actor, deps):
            run = await until_status(deps, run_id)
    assert run["status"] == "failed"
    assert "feature" in run["error"] and "does not resolve" in run["error"]
    assert run["resolved_commit"] is None


async def test_cancelling_the_actor_interrupts_the_run_and_keeps_its_edits(real_deps, git_repo):
    deps = real_deps()
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "@edit wip.txt half done\n@sleep 30")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.claim_actor, deps)
            await until(lambda: (deps.worktree(run_id) / "wip.txt").exists())
            pid = deps.live.get(run_id).pid
            assert pid and group_alive(pid)
            nursery.cancel_scope.cancel()
    run = await get_run(deps, run_id)
    assert run["status"] == "failed" and run["error"] == "interrupted"
    assert not group_alive(pid)
    assert git(git_repo, "show", f"{run['result_branch']}:wip.txt") == "half done"
    assert run["changes"]["commits"] == 1
    assert not deps.worktree(run_id).exists()
    assert len(deps.live) == 0


async def test_agent_environment_has_run_id_and_no_secrets(real_deps, git_repo, monkeypatch):
    monkeypatch.setenv("OUTPOST_API_TOKEN", "secret-token-value")
    monkeypatch.setenv("SECRET_OF_THE_DAEMON", "nope")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    deps = real_deps()
    with trio.fail_after(30):
        plain = await queue_dispatch(deps, git_repo, "dump", agent="envdump")
        leaky = await queue_dispatch(deps, git_repo, "dump", agent="leaky")
        async with actor_running(outpost.claim_actor, deps):
            runs = [await until_status(deps, rid) for rid in (plain, leaky)]
    for run in runs:
        assert run["status"] == "succeeded", run
        env = dict(line.split("=", 1) for line in
                   git(git_repo, "show", f"{run['result_branch']}:env.txt").splitlines() if "=" in line)
        assert env["OUTPOST_RUN_ID"] == run["id"]
        assert "OUTPOST_API_TOKEN" not in env
        assert "secret-token-value" not in env.values()
        assert "NOTIFY_SOCKET" not in env
        assert not any(k.startswith("WATCHDOG_") for k in env)
    plain_env = git(git_repo, "show", f"{runs[0]['result_branch']}:env.txt")
    assert "SECRET_OF_THE_DAEMON" not in plain_env


def test_a_log_over_1_mib_keeps_its_head_and_its_end_with_the_cut_counted(tmp_path):
    """docs/http-api.md: over 1 MiB the log keeps the first 256 KiB and the last 768 KiB with one line
    between them, so a long run's result and error (its end) are never what is lost."""
    sink = outpost.LogSink(tmp_path / "run.log", lambda: T0)
    lines = [f"line {i:07d} {'x' * 40}\n".encode() for i in range(60_000)]   # about 3.2 MB
    for line in lines:
        sink.write(line)
    sink.write(b'{"type": "result", "result": "THE END"}\n')
    sink.close()
    data = (tmp_path / "run.log").read_bytes()
    total = sum(map(len, lines)) + len(b'{"type": "result", "result": "THE END"}\n')
    head, marker, tail = data[:outpost.LOG_HEAD_BYTES], *data[outpost.LOG_HEAD_BYTES:].split(b"\n", 2)[1:]
    assert head == b"".join(lines)[:outpost.LOG_HEAD_BYTES]
    cut = int(marker.decode().removeprefix("[... ").removesuffix(" bytes cut ...]"))
    assert len(head) + cut + len(tail) == total and len(tail) <= outpost.LOG_TAIL_BYTES
    assert tail.endswith(b'{"type": "result", "result": "THE END"}\n')
    assert len(data) <= outpost.MAX_LOG_BYTES + 100


class Ticking:
    """A wall clock a test moves: ``now`` is T0 plus ``seconds``."""

    def __init__(self):
        self.seconds = 0

    def now(self):
        return T0 + timedelta(seconds=self.seconds)


def lines_with_times(blocks: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """timed_log's blocks as (second, line) pairs."""
    return [(shown, line) for shown, text in blocks for line in text.splitlines(keepends=True)]


def test_each_log_line_keeps_the_second_it_began_through_the_cut(tmp_path):
    """Issue 36: the run page shows when each line began. A 3 MiB log whose line N is printed at
    second N // 1000: after the cut, every whole line of its head and its tail still reads its own
    second, and the kept part's first (partial) line the second it was printed in."""
    clock = Ticking()
    sink = outpost.LogSink(tmp_path / "run.log", clock.now)
    for i in range(60_000):
        clock.seconds = i // 1000
        line = f"line {i:07d} {'x' * 40}\n".encode()
        sink.write(line[:7])   # a line arrives in pieces; it began with the first
        clock.seconds += 0.4
        sink.write(line[7:])
    sink.close()
    path = tmp_path / "run.log"
    marks = outpost.read_line_times(path)
    assert len(marks) < 200, "one mark per second of output, not per line"
    blocks = outpost.timed_log(path.read_bytes(), marks, "UTC")
    assert "".join(text for _, text in blocks) == path.read_text()
    assert len(blocks) == len({shown for shown, _ in blocks}) < 200, "one block per second"
    lines = lines_with_times(blocks)
    cut_at = next(n for n, (_, text) in enumerate(lines) if text.startswith("[... "))
    assert 0 < cut_at < len(lines) - 1000
    whole = [(shown, text) for n, (shown, text) in enumerate(lines) if n not in (cut_at - 1, cut_at, cut_at + 1)]
    for shown, text in whole:
        number = int(text.split()[1])
        assert shown == f"{T0 + timedelta(seconds=number // 1000):%H:%M:%S}", text
    partial = lines[cut_at + 1][1]   # the first kept bytes: the end of a line printed before the cut
    following = int(lines[cut_at + 2][1].split()[1])
    assert lines[cut_at + 1][0] == f"{T0 + timedelta(seconds=(following - 1) // 1000):%H:%M:%S}", partial
    assert lines[-1] == ("08:00:59", f"line 0059999 {'x' * 40}\n")


def test_a_log_line_time_is_shown_in_the_zone_asked_and_a_log_without_times_has_none(tmp_path):
    clock = Ticking()
    sink = outpost.LogSink(tmp_path / "run.log", clock.now)
    sink.write(b"one\n")
    clock.seconds = 5
    sink.write(b"two\r\nthree")   # two lines begin together; a carriage return is no line's end
    clock.seconds = 9
    sink.write(b" goes on\n")   # no line begins here
    sink.close()
    path = tmp_path / "run.log"
    assert outpost.timed_log(path.read_bytes(), outpost.read_line_times(path), "Asia/Kolkata") == [
        ("13:30:00", "one\n"), ("13:30:05", "two\r\nthree goes on\n")]
    outpost.log_times_path(path).write_text("0 99999999999999999999\n0 253402300800\nx y\n4 1796112000\n")
    assert outpost.timed_log(b"one\ntwo\n", outpost.read_line_times(path), "UTC") == [
        ("", "one\n"), ("08:00:00", "two\n")], "a hand-written .times cannot break the page"
    outpost.log_times_path(path).unlink()
    assert outpost.timed_log(b"no\ntimes", outpost.read_line_times(path), "UTC") == [("", "no\ntimes")]


@pytest.mark.parametrize("total", [
    outpost.MAX_LOG_BYTES + 1, 1_228_800, outpost.MAX_LOG_BYTES + outpost.LOG_TAIL_BYTES - 1,
    outpost.MAX_LOG_BYTES + outpost.LOG_TAIL_BYTES, 3 * 1024 * 1024,
], ids=["1 MiB + 1", "1.2 MB", "1.75 MiB - 1", "1.75 MiB", "3 MiB"])
def test_a_log_over_1_mib_keeps_exactly_its_first_256_kib_and_its_last_768_kib(tmp_path, total):
    """docs/http-api.md, byte for byte: whatever the size over 1 MiB and however the output arrives
    (chunks of 1 byte to 64 KiB), the log is the first 256 KiB, one line counting the bytes
    cut, and the last 768 KiB."""
    written = b"".join(b"%09d\n" % i for i in range(total // 10 + 1))[:total]
    sink = outpost.LogSink(tmp_path / "run.log", lambda: T0)
    sizes, at = itertools.cycle([1, 7, 100, 4096, 65536, 333]), 0
    while at < total:
        step = next(sizes)
        sink.write(written[at:at + step])
        at += step
    sink.close()
    data = (tmp_path / "run.log").read_bytes()
    head, rest = data[:outpost.LOG_HEAD_BYTES], data[outpost.LOG_HEAD_BYTES:]
    marker = re.match(rb"\n\[\.\.\. (\d+) bytes cut \.\.\.\]\n", rest)
    assert marker is not None, rest[:80]
    tail = rest[marker.end():]
    assert head == written[:outpost.LOG_HEAD_BYTES]
    assert len(tail) == outpost.LOG_TAIL_BYTES and tail == written[-outpost.LOG_TAIL_BYTES:]
    assert int(marker[1]) == total - outpost.LOG_HEAD_BYTES - outpost.LOG_TAIL_BYTES


@pytest.mark.skipif(not outpost.agent_isolation("auto").active, reason="bubblewrap does not work here "
                    "(.ci/run installs the bubblewrap package)")
async def test_an_isolated_agent_cannot_read_the_api_token_or_the_database(tmp_path, git_repo):
    """Defect 20: an agent runs as the daemon's user; under bubblewrap the data dir is hidden
    from it except its own worktree, so the token and the database are out of its reach."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "api-token").write_text("THE-SECRET-TOKEN\n")
    store = outpost.Store(data / "outpost.sqlite3")
    script = f"cat {data}/api-token {data}/outpost.sqlite3 > loot.txt 2>&1; echo wrote > own.txt"
    prying = outpost.AgentProfile("prying", ("sh", "-c", script))
    deps = make_deps(data, store=store, clock=outpost.WallClock(), agents=(prying,),
                     isolation=outpost.agent_isolation("auto"))
    with trio.fail_after(30):
        run_id = await queue_dispatch(deps, git_repo, "look around", agent="prying")
        async with actor_running(outpost.claim_actor, deps):
            run = await until_status(deps, run_id)
    assert run["status"] == "succeeded" and run["changes"]["commits"] == 1, run
    loot = git(git_repo, "show", f"{run['result_branch']}:loot.txt")
    assert "THE-SECRET-TOKEN" not in loot and "SQLite format" not in loot and "No such file" in loot
    assert git(git_repo, "show", f"{run['result_branch']}:own.txt") == "wrote"   # its worktree stays writable
    store.close()


def test_without_isolation_the_start_line_says_agents_are_not_isolated(monkeypatch):
    assert "not isolated" in outpost.agent_isolation("never").message
    monkeypatch.setenv("PATH", "/nonexistent")   # no bwrap to be found
    auto = outpost.agent_isolation("auto")
    assert not auto.active and "not isolated" in auto.message and "bubblewrap" in auto.message
    with pytest.raises(outpost.ConfigError, match="always"):
        outpost.agent_isolation("always")


def test_with_a_bubblewrap_that_cannot_block_user_namespaces_the_start_says_what_an_agent_can_do(monkeypatch):
    """Bubblewrap before 0.8 has no --disable-userns: agents stay isolated, and the start line
    says that an agent can lift its own caps."""
    monkeypatch.setattr(outpost, "bubblewrap_problem",
                        lambda namespaces: "bwrap: Unknown option --disable-userns" if "--disable-userns" in namespaces
                        else None)
    older = outpost.agent_isolation("auto")
    assert older.active and not older.no_userns and "lift its own caps" in older.message
    assert "Unknown option --disable-userns" in older.message
    sandbox = outpost.Sandbox(Path("/d"), Path("/w"), Path("/r"), Path("/p"), None, no_userns=older.no_userns)
    assert "--unshare-user" not in sandbox.argv(["true"]) and "--unshare-pid" in sandbox.argv(["true"])
    assert "--disable-userns" in outpost.Sandbox(Path("/d"), Path("/w"), Path("/r"), Path("/p"), None).argv(["true"])


async def test_paused_time_does_not_count_against_the_timeout(autojump_clock, tmp_path):
    """Defect 2: paused at once with a 3 s timeout, a run was failed "timeout" while still
    paused. Paused time is not run time: the timeout fires 3 s of running after the resume."""
    live = outpost.LiveRun("out_paused", trio.CancelScope())
    ended: dict = {}

    async def no_op(pid: int) -> None:
        pass

    async def run() -> None:
        ended["result"] = await outpost.run_agent_process(
            ["sleep", "600"], cwd=tmp_path, env=dict(os.environ), stdin_text=None, timeout_s=3,
            log_path=tmp_path / "run.log", now=lambda: T0, live=live, on_spawn=no_op, grace_s=0.1)
        ended["at"] = trio.current_time()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while live.pid is None:
                await trio.sleep(0.001)
            live.pause()
            paused_at = trio.current_time()
            await trio.sleep(4.5)
            assert ended == {}, "the paused run timed out"
            live.resume()
    assert ended["result"].timed_out
    assert ended["at"] - paused_at >= 4.5 + 2.9


async def test_run_pause_releases_the_slot_and_resume_waits_for_one(real_deps, git_repo):
    deps = real_deps(max_running=1)
    store = deps.store
    with trio.fail_after(30):
        paused = await queue_dispatch(deps, git_repo, "@sleep 3\n@print resumed")
        other = await queue_dispatch(deps, git_repo, "@sleep 60\n@print other")   # holds the slot until cancelled
        async with actor_running(outpost.claim_actor, deps):
            await until(lambda: deps.live.has_process(paused))
            await deps.transaction(store.runs.control_run, paused, "pause", deps.clock.now())
            deps.live.get(paused).pause()
            deps.claim_wake.poke()
            assert (await get_run(deps, paused))["status"] == "paused"
            # The slot is free: the other queued run starts although max_running is 1.
            await until_status(deps, other, {"running"})
            # Resume waits for a free slot: the other run holds the only one until it is cancelled.
            await deps.transaction(store.runs.control_run, paused, "resume", deps.clock.now())
            deps.claim_wake.poke()
            await trio.sleep(0.5)
            assert (await get_run(deps, paused))["status"] == "paused"
            assert (await get_run(deps, other))["status"] == "running"
            await deps.transaction(store.runs.control_run, other, "cancel", deps.clock.now())
            deps.live.signal(other, "cancel")
            b = await until_status(deps, other)
            a = await until_status(deps, paused)
    assert a["status"] == "succeeded" and b["status"] == "cancelled"
    assert instant(a["started_at"]) < instant(b["started_at"])
    assert instant(a["finished_at"]) > instant(b["finished_at"])
    assert "resumed" in outpost.read_log(deps.log_path(paused))[0]


class HeldFetch(outpost.Mirrors):
    """Mirrors whose next fetch waits until the test lets it go: a run's worktree that is
    still being prepared, for as long as the test likes."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.hold: trio.Event | None = None
        self.holding = trio.Event()

    async def fetched(self, repository: str) -> str:
        if self.hold is not None:
            hold, self.hold = self.hold, None
            self.holding.set()
            await hold.wait()
        return await super().fetched(repository)


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat: T is stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_run_paused_while_its_worktree_is_prepared_starts_stopped_and_frees_its_slot(tmp_path, store, git_repo):
    """Defect 7: a run that read ``running`` while its worktree was prepared answered 409 to a
    pause. Now the pause is recorded, the slot is free at once, and the agent is stopped the
    moment it exists; resume continues it."""
    mirrors = HeldFetch(tmp_path / "data" / "mirrors")
    deps = make_deps(tmp_path / "data", store=store, clock=outpost.WallClock(), mirrors=mirrors, grace_s=1.0,
                     inline_db=False)
    deps = dataclasses.replace(deps, config=dataclasses.replace(deps.config, max_running=1))
    api = Api(deps, git_repo)
    with trio.fail_after(30):
        held = await queue_dispatch(deps, git_repo, "@print resumed")
        other = await queue_dispatch(deps, git_repo, "@print other")
        release = mirrors.hold = trio.Event()
        async with actor_running(outpost.claim_actor, deps):
            await mirrors.holding.wait()   # admitted, its worktree not made yet
            assert (await api.get(f"/v1/outpost/runs/{held}")).body["status"] == "running"
            paused = await api.post(f"/v1/outpost/runs/{held}/control", {"action": "pause"})
            assert paused.status == 200, paused.body
            assert paused.body["status"] == "paused"
            # Its slot is free: the other run starts and ends although max_running is 1.
            assert (await until_status(deps, other))["status"] == "succeeded"
            release.set()
            live = await until(lambda: deps.live.get(held))
            pid = await until(lambda: live.pid)
            await until(lambda: process_state(pid) == "T")   # stopped, never ran on
            assert (await api.get(f"/v1/outpost/runs/{held}")).body["status"] == "paused"
            assert "resumed" not in outpost.read_log(deps.log_path(held))[0]
            resumed = await api.post(f"/v1/outpost/runs/{held}/control", {"action": "resume"})
            assert resumed.status == 200, resumed.body
            run = await until_status(deps, held)
    assert run["status"] == "succeeded"
    assert "resumed" in outpost.read_log(deps.log_path(held))[0]


# --- recovery at boot ---------------------------------------------------------------------------------

def spawn_orphan() -> subprocess.Popen:
    """A process group like an agent's that survived its daemon; a thread reaps it when it dies
    (the test process is its parent, unlike init for a real orphan)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


async def test_recover_at_boot_settles_running_runs_and_ends_their_process_group(tmp_path, store, git_repo):
    deps = make_deps(tmp_path / "data", store=store, clock=outpost.WallClock(), token="t", inline_db=True)
    now = datetime.now(UTC)
    survivor = spawn_orphan()
    stranger = spawn_orphan()     # a live process whose start time does not match: pid reuse
    try:
        with trio.fail_after(30):
            alive = await queue_dispatch(deps, git_repo, "@sleep 60")
            reused = await queue_dispatch(deps, git_repo, "@sleep 60")
            waiting = await queue_dispatch(deps, git_repo, "@print later")
            for run_id, proc, start in ((alive, survivor, outpost.process_start_time(survivor.pid)),
                                        (reused, stranger, "1")):
                assert call(store, store.runs.admit_next, 100, now)
                assert call(store, store.runs.mark_spawned, run_id, proc.pid, start, (store.node, 1))
            assert call(store, store.access.begin_idempotent, "half-done", "fp1", now) is None
            assert call(store, store.access.begin_idempotent, "done", "fp2", now) is None
            call(store, store.access.finish_idempotent, "done", 202, {"body": {"run_id": waiting}, "headers": {}})
            await outpost.recover_at_boot(deps)
        for run_id in (alive, reused):
            run = call(store, store.runs.get_run, run_id)
            assert (run["status"], run["error"]) == ("failed", "interrupted")
        survivor.wait(5)
        assert survivor.returncode == -signal.SIGTERM
        assert stranger.poll() is None, "a reused pid is not ours to kill"
        assert call(store, store.runs.get_run, waiting)["status"] == "queued"
        # The in-flight key is forgotten (reserved afresh); the finished one still replays.
        assert call(store, store.access.begin_idempotent, "half-done", "fp1", now) is None
        assert call(store, store.access.begin_idempotent, "done", "fp2", now) == (202, {"body": {"run_id": waiting},
                                                                              "headers": {}})
    finally:
        for proc in (survivor, stranger):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


async def test_a_run_admitted_as_the_daemon_stops_goes_back_to_the_queue(tmp_path, store, git_repo):
    """Shutdown between an admission and its supervisor's start (the torture's clean stop caught it:
    the run was left running with nobody to run or settle it until the next start)."""
    deps = make_deps(tmp_path / "data", store=store, clock=outpost.WallClock(), token="t")
    run_id = await queue_dispatch(deps, git_repo, "@print later")
    assert call(store, store.runs.admit_next, 1, deps.clock.now()) == (run_id, False)
    with trio.CancelScope() as stopping:
        stopping.cancel()   # the runs nursery is cancelled: the supervisor starts cancelled
        await outpost.run_supervisor(deps, run_id)
    run = call(store, store.runs.get_run, run_id)
    assert (run["status"], run["started_at"], run["node"]) == ("queued", None, None)
    assert call(store, store.runs.admit_next, 1, deps.clock.now()) == (run_id, False)   # admitted again later

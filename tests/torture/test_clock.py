"""The wall clock stepped back an hour and forward a day (an injected clock, MockClock time):
no occurrence fires twice, no storm, no stall."""

from __future__ import annotations

from datetime import timedelta

import trio
from conftest import T0, SteppedClock, normalized

import outpost


async def test_clock_steps_back_an_hour_and_forward_a_day(autojump_clock, tmp_path, store, git_repo, monkeypatch):
    async def no_git(repository, ref):   # resolving refs would wait on a real git process
        return "0" * 40
    monkeypatch.setattr(outpost, "resolve_ref", no_git)
    clock = SteppedClock(T0)
    config = outpost.Config(data_dir=tmp_path, agents=(outpost.demo_profile(),))
    deps = outpost.Deps(config=config, store=store, clock=clock, token="t", inline_db=True)
    definition = normalized(git_repo, concurrency_policy="always_enqueue")
    sid = store.transaction(store.schedules.create_schedule, definition, T0)[0]["id"]

    def ledger():
        return store.transaction(store.schedules.occurrences, sid, 10_000)[0]

    with trio.fail_after(10 * 86400):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.cron_actor, deps)
            await trio.sleep(3600 + 30)
            assert len(ledger()) == 12                       # 08:05 .. 09:00

            clock.offset -= timedelta(hours=1)               # back an hour: 08:00 again
            await trio.sleep(2 * 3600)                       # wall 08:00 -> 10:00
            due = [o["due_at"] for o in ledger()]
            assert len(due) == len(set(due)) == 24           # 09:05 .. 10:00 once each, nothing twice

            clock.offset += timedelta(days=1)                # forward a day
            await trio.sleep(outpost.CRON_MAX_SLEEP_S + 60)  # noticed within one longest sleep
            runs = store.transaction(store.runs.list_runs, sid, None, 500, None)[0]["runs"]
            catch_ups = [r for r in runs if r["trigger"] == "catch_up"]
            assert len(catch_ups) == 1, "a day of missed slots folds into one catch-up: no storm"
            assert 24 * 12 <= catch_ups[0]["missed_count"] <= 24 * 12 + 1   # + the slot due as it noticed
            before = len(ledger())
            await trio.sleep(3600)                           # no stall: regular fires go on
            assert len(ledger()) == before + 12
            due = [o["due_at"] for o in ledger()]
            assert len(due) == len(set(due))
            nursery.cancel_scope.cancel()

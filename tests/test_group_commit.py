"""Group commit (docs/development.md, issue 15): store calls that arrive while a commit is in flight run
together in the next transaction, one commit for all, and each caller still gets exactly its
own answer, only after the commit that holds its write.

These tests use the real writer thread (no ``inline_db``): a store call that waits on a
``threading.Event`` holds the writer while the others queue behind it."""

from __future__ import annotations

import sqlite3
import threading

import pytest
import trio
import trio.testing
from conftest import T0, make_deps, normalized

import outpost


def held(gate: threading.Event):
    """A store call that keeps the writer thread busy until ``gate`` opens."""
    def hold() -> str:
        assert gate.wait(10), "the test never opened the gate"
        return "held"
    return hold


def schedule_names(store: outpost.Store) -> list[str]:
    return sorted(s["name"] for s in store.transaction(store.schedules.list_schedules)[0])


def create_now(store: outpost.Store, name: str) -> str:
    """Inside a transaction: a schedule named ``name``; its name."""
    return store.schedules.create_schedule(normalized("/srv/app", name=name), T0)["name"]


def create(deps: outpost.Deps, name: str):
    return deps.transaction(deps.store.schedules.create_schedule, normalized("/srv/app", name=name), T0)


async def hold_writer(deps: outpost.Deps, nursery: trio.Nursery, gate: threading.Event, answers: dict) -> None:
    async def first() -> None:
        answers["first"] = await deps.transaction(held(gate))
    nursery.start_soon(first)
    await trio.testing.wait_all_tasks_blocked()


async def test_calls_that_arrive_during_a_commit_share_the_next_one(tmp_path):
    deps = make_deps(tmp_path)
    gate, answers = threading.Event(), {}

    async def make(name: str) -> None:
        answers[name] = (await create(deps, name))["name"]
    async with trio.open_nursery() as nursery:
        await hold_writer(deps, nursery, gate, answers)
        for i in range(10):
            nursery.start_soon(make, f"s{i}")
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert answers == {"first": "held", **{f"s{i}": f"s{i}" for i in range(10)}}
    assert deps.writer.sizes == {1: 1, 10: 1}   # two commits answered eleven calls
    assert schedule_names(deps.store) == sorted(f"s{i}" for i in range(10))


async def test_a_failing_call_gets_its_own_error_and_the_others_writes_commit(tmp_path):
    """The middle call writes, then fails: its write is gone, its caller gets its error, and
    the calls before and after it in the group commit. Pony's cache is not trusted across the
    failure: the call after it reads the database's value, not the failed call's."""
    deps = make_deps(tmp_path)
    store = deps.store
    gate, answers = threading.Event(), {}
    victim = store.transaction(store.schedules.create_schedule, normalized("/srv/app", name="victim"), T0)[0]["id"]

    def rename_then_fail() -> None:
        store.db.Schedule[victim].name = "renamed-by-a-failed-call"
        outpost.orm.flush()
        raise outpost.Conflict("refused after writing")

    def read_name() -> str:
        return store.db.Schedule[victim].name

    async def record(key: str, fn) -> None:
        try:
            answers[key] = await deps.transaction(fn)
        except outpost.OutpostError as exc:
            answers[key] = exc
    async with trio.open_nursery() as nursery:
        await hold_writer(deps, nursery, gate, answers)
        nursery.start_soon(record, "before", lambda: create_now(store, "a"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(record, "failing", rename_then_fail)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(record, "reader", read_name)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(record, "after", lambda: create_now(store, "b"))
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert answers["before"] == "a" and answers["after"] == "b"
    assert isinstance(answers["failing"], outpost.Conflict) and "refused after writing" in str(answers["failing"])
    assert answers["reader"] == "victim"
    assert schedule_names(store) == ["a", "b", "victim"]


async def test_a_failed_commit_answers_every_caller_of_the_group_and_writes_nothing(tmp_path, monkeypatch):
    deps = make_deps(tmp_path)
    store = deps.store
    gate, answers = threading.Event(), {}
    real = store.transaction

    def full_disk(fn, *args, **kwargs):
        if fn is outpost._run_group:   # the group's commit fails as a full disk does
            raise outpost.orm.dbapiprovider.OperationalError(Exception("database or disk is full"))
        return real(fn, *args, **kwargs)
    monkeypatch.setattr(store, "transaction", full_disk)

    async def make(name: str) -> None:
        try:
            answers[name] = await create(deps, name)
        except outpost.StoreUnavailable as exc:
            answers[name] = exc
    async with trio.open_nursery() as nursery:
        await hold_writer(deps, nursery, gate, answers)
        for name in ("x", "y", "z"):
            nursery.start_soon(make, name)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert all(isinstance(answers[n], outpost.StoreUnavailable) for n in ("x", "y", "z")), answers
    monkeypatch.undo()
    assert schedule_names(store) == []


async def test_a_call_cancelled_while_it_waits_is_withdrawn_and_never_written(tmp_path):
    deps = make_deps(tmp_path)
    gate, answers = threading.Event(), {}
    async with trio.open_nursery() as nursery:
        await hold_writer(deps, nursery, gate, answers)
        nursery.start_soon(create, deps, "kept")
        await trio.testing.wait_all_tasks_blocked()
        scope = trio.CancelScope()

        async def cancelled() -> None:
            with scope:
                await create(deps, "withdrawn")
        nursery.start_soon(cancelled)
        await trio.testing.wait_all_tasks_blocked()
        assert len(deps.writer.queue) == 2
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert len(deps.writer.queue) == 1
        gate.set()
    assert schedule_names(deps.store) == ["kept"]


async def test_a_call_already_in_a_running_group_commits_even_if_its_caller_is_cancelled(tmp_path):
    """Like a worker thread that has started: the write it carries completes, and the caller
    is answered only once it has."""
    deps = make_deps(tmp_path)
    gate, second_gate, answers = threading.Event(), threading.Event(), {}
    async with trio.open_nursery() as nursery:
        await hold_writer(deps, nursery, gate, answers)
        scope = trio.CancelScope()

        async def grouped() -> None:
            with scope:
                answers["grouped"] = await deps.transaction(held(second_gate))
        async def leader() -> None:
            answers["leader"] = (await create(deps, "led"))["name"]
        nursery.start_soon(leader)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(grouped)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()   # the leader's group (its call and the held one) goes to the writer thread
        while deps.writer.queue or not deps.writer.sizes:
            await trio.sleep(0.001)
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert "grouped" not in answers and "leader" not in answers   # nobody answered before the commit
        second_gate.set()
    assert answers == {"first": "held", "leader": "led", "grouped": "held"}
    assert deps.writer.sizes == {1: 1, 2: 1}


@pytest.mark.parametrize("size", [1, 3])
def test_store_transactions_returns_each_calls_result_in_order(store, size):
    calls = [lambda i=i: store.schedules.create_schedule(normalized("/srv/app", name=f"n{i}"),
                                                         T0)["name"] for i in range(size)]
    written = store.transactions(calls)
    assert [w.result for w in written] == [f"n{i}" for i in range(size)]
    assert all(w.wrote and w.error is None for w in written)


def test_a_call_of_a_group_reads_what_the_calls_before_it_wrote_in_plain_sql(store):
    """Pony's objects of one call are not the next call's: a row an earlier call loaded and a
    later call rewrote in plain SQL reads as rewritten."""
    sid = store.transaction(store.schedules.create_schedule, normalized("/srv/app", name="old"), T0)[0]["id"]
    loaded = []

    def load():
        loaded.append(store.db.Schedule[sid])
        return loaded[0].name

    def rename():
        store.db.execute('UPDATE "Schedule" SET name = \'new\' WHERE id = $sid', {"sid": sid})

    written = store.transactions([load, rename, lambda: store.db.Schedule[sid].name])
    assert [w.result for w in written] == ["old", None, "new"]


def test_calls_that_touch_nothing_share_a_group_with_those_that_do(store):
    written = store.transactions([lambda: "nothing read", lambda: store.schedules.list_schedules(), lambda: 3])
    assert [w.result for w in written] == ["nothing read", [], 3]
    assert [w.error for w in written] == [None, None, None]


def test_a_database_locked_by_another_process_fails_the_group_once_not_each_call_again(tmp_path, monkeypatch):
    """A lock held past the busy timeout is the database's error, not a call's: every call of
    the group gets it after one wait (the API answers 503), none is run again into the same lock."""
    monkeypatch.setattr(outpost, "BUSY_TIMEOUT_MS", 50)
    store = outpost.Store(tmp_path / "locked.sqlite3")
    outside = sqlite3.connect(tmp_path / "locked.sqlite3", isolation_level=None)
    outside.execute("BEGIN EXCLUSIVE")
    tries = []
    real = store.transaction

    def counting(fn, *args, **kwargs):
        tries.append(fn)
        return real(fn, *args, **kwargs)
    monkeypatch.setattr(store, "transaction", counting)
    written = store.transactions([lambda i=i: create_now(store, f"s{i}") for i in range(3)])
    assert all(outpost.cannot_write(w.error) for w in written), written
    assert len(tries) == 1
    outside.execute("ROLLBACK")
    outside.close()
    monkeypatch.undo()
    assert schedule_names(store) == []
    store.close()


async def test_a_leader_cancelled_on_its_way_to_the_writer_still_runs_and_answers_its_group(tmp_path, monkeypatch):
    """The group a cancelled caller leads is run anyway: the calls it took (others' among
    them) are answered, nobody waits forever for a group that never reached the thread."""
    deps = make_deps(tmp_path)
    gate, answers = threading.Event(), {}
    leader_scope = trio.CancelScope()
    real_run_sync = trio.to_thread.run_sync

    async def cancelled_on_the_way(fn, *args, **kwargs):
        if len(args[0]) == 2:   # the leader's group: its own call and the follower's
            leader_scope.cancel()
        return await real_run_sync(fn, *args, **kwargs)
    monkeypatch.setattr(trio.to_thread, "run_sync", cancelled_on_the_way)

    async def leader() -> None:
        with leader_scope:
            answers["leader"] = (await create(deps, "led"))["name"]

    async def follower() -> None:
        answers["follower"] = (await create(deps, "followed"))["name"]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hold_writer(deps, nursery, gate, answers)
            nursery.start_soon(leader)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(follower)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert answers["follower"] == "followed"
    assert schedule_names(deps.store) == ["followed", "led"]   # the leader's call ran: it had been taken

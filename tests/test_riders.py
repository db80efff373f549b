"""Every wakeup reaches a run (shared/API.md 7.3): a wakeup merged into another (``coalesced``)
rides that wakeup's run; when the wakeup it rides ends without carrying it to a good end, the
rider is queued again on its own if its reason still holds, else it ends with its own reason.

The five cases issue 34 found, each against the real Store, and a property test of random
interleavings of enqueue, merge, claim, fail, retry, reassign, move and cancel.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import hypothesis.strategies as st
import trio
from conftest import (
    MINUTE,
    PROFILES,
    T0,
    at,
    call,
    dispatch,
    instant,
    new_agent,
    new_store,
    new_task,
    office_run,
    set_settings,
    settle,
    until,
    wakeup,
    wakeups,
)
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_office import edit_task, enqueue, fail_and_reschedule, move, retry_due, routine_wake

import outpost

CHILDREN = outpost.WakeupSource.TASK_CHILDREN_COMPLETED


def coordinator_with_two_epics(office) -> tuple[str, list[str], list[str]]:
    """A coordinator whose two epics' children completed 1 s apart: one wakeup carries the other.
    Returns (coordinator, epics, [carrier, rider])."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    epics = [new_task(office, f"Epic {i}", at(i), assignee_agent_id=lead) for i in range(2)]
    for i in range(2):   # its first look at each epic
        for run_id in dispatch(office, at(10 + i)):
            settle(office, run_id, "succeeded", at(10 + i))
    ids = [enqueue(office, lead, CHILDREN, {"task_id": e}, at(60 + i)) for i, e in enumerate(epics)]
    assert [wakeup(office, i)["status"] for i in ids] == ["queued", "coalesced"]
    return lead, epics, ids


def runs_on(office, run_ids: list[str]) -> list[str | None]:
    return [office_run(office, run_id)["task_id"] for run_id in run_ids]


def test_a_rider_of_a_run_cancelled_before_it_started_is_queued_again(office):
    """Case 1: the carrier's epic is reassigned before its run starts; that run is cancelled,
    and the other epic's wake runs on its own."""
    lead, epics, (carrier, rider) = coordinator_with_two_epics(office)
    (run_id,) = dispatch(office, at(66))
    assert wakeup(office, rider)["run_id"] == run_id
    other = new_agent(office, "Other")
    edit_task(office, epics[0], at(70), assignee_agent_id=other)
    assert call(office, office.runs.get_run, run_id)["status"] == "cancelled"
    w = wakeup(office, rider)
    assert (w["status"], w["coalesced_into"], w["run_id"]) == ("queued", None, None)
    assert w["payload"] == {"task_id": epics[1]} and w["source"] == "task_children_completed"
    assert wakeup(office, carrier)["coalesced_count"] == 1
    runs = dispatch(office, at(71))
    assert epics[1] in runs_on(office, runs), "the second epic's wake reaches a run"
    assert wakeup(office, rider)["status"] == "claimed"


def test_a_rider_of_a_failed_run_whose_retry_ends_task_terminal_is_queued_again(office):
    """Case 2: the run fails, the carrier's epic is moved to DONE: its retry ends task_terminal
    and the rider runs."""
    lead, epics, (carrier, rider) = coordinator_with_two_epics(office)
    w = fail_and_reschedule(office, carrier, at(66))
    assert w["status"] == "queued" and wakeup(office, rider)["status"] == "coalesced", "it rides the retry"
    move(office, epics[0], "DONE", at(70))
    (run_id,) = dispatch(office, retry_due(w))
    assert (wakeup(office, carrier)["status"], wakeup(office, carrier)["cancel_reason"]) == ("cancelled",
                                                                                               "task_terminal")
    assert runs_on(office, [run_id]) == [epics[1]]
    assert wakeup(office, rider)["run_id"] == run_id


def test_a_rider_of_a_retry_cancelled_as_retry_stale_assignee_is_queued_again(office):
    """Case 3: the carrier's epic is reassigned after the failure."""
    lead, epics, (carrier, rider) = coordinator_with_two_epics(office)
    fail_and_reschedule(office, carrier, at(66))
    other = new_agent(office, "Other")
    edit_task(office, epics[0], at(70), assignee_agent_id=other)
    assert wakeup(office, carrier)["cancel_reason"] == "retry_stale_assignee"
    assert wakeup(office, rider)["status"] == "queued"
    assert epics[1] in runs_on(office, dispatch(office, at(71)))


def test_a_users_wake_merged_into_a_failed_routine_run_runs_when_the_retry_is_idle_skipped(office):
    """Case 4: a user's Wake now merged into a worker's unstarted routine run; the run fails, the
    worker's task is moved to DONE; at the retry the idle skip ends the routine's wake only."""
    worker = new_agent(office, "Worker", cooldown_sec=0, skip_idle_wakeups=True)
    tid = new_task(office, "Something to do", assignee_agent_id=worker)
    for run_id in dispatch(office, at(1)):
        settle(office, run_id, "succeeded", at(1))
    routine = routine_wake(office, worker, at(MINUTE))
    (run_id,) = dispatch(office, at(MINUTE))
    user = enqueue(office, worker, outpost.WakeupSource.USER, {"user_id": "dashboard"}, at(MINUTE + 1))
    assert (wakeup(office, user)["status"], wakeup(office, user)["run_id"]) == ("coalesced", run_id)
    settle(office, run_id, "failed", at(MINUTE + 2), error="network timeout", exit_code=1)
    move(office, tid, "DONE", at(MINUTE + 3))
    runs = dispatch(office, retry_due(wakeup(office, routine)))
    assert wakeup(office, routine)["note"] == "no actionable tasks (idle skip)"
    (user_run,) = runs
    assert wakeup(office, user)["run_id"] == user_run and office_run(office, user_run)["task_id"] is None


def test_a_rider_of_a_wakeup_that_escalates_is_queued_again(office):
    """Case 5: a lone coordinator's heartbeat fails past its retries and escalates; the user's
    wake merged into it is worked on its own."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    beat = routine_wake(office, lead, at(0))
    (run_id,) = dispatch(office, at(0))
    user = enqueue(office, lead, outpost.WakeupSource.USER, {"user_id": "dashboard", "context": "look"}, at(1))
    assert (wakeup(office, user)["coalesced_into"], wakeup(office, user)["run_id"]) == (beat, run_id)
    settle(office, run_id, "failed", at(2), error="network timeout", exit_code=1)
    w = wakeup(office, beat)
    for _ in range(outpost.MAX_RETRY_COUNT):
        assert wakeup(office, user)["status"] == "coalesced", "it rides every retry"
        now = retry_due(w)
        w = fail_and_reschedule(office, beat, now)
    assert w["status"] == "failed" and "escalated" in w["note"]
    u = wakeup(office, user)
    assert (u["status"], u["coalesced_into"], u["payload"]) == ("queued", None,
                                                                 {"user_id": "dashboard", "context": "look"})
    (run_id,) = dispatch(office, now + timedelta(seconds=1))
    assert "look" in office_run(office, run_id)["assembled_prompt"]


def test_a_rider_whose_own_task_is_done_ends_with_its_own_reason(office):
    """The others end with their own cancel reason: a rider whose epic is DONE too is not queued."""
    lead, epics, (carrier, rider) = coordinator_with_two_epics(office)
    fail_and_reschedule(office, carrier, at(66))
    move(office, epics[1], "DONE", at(68))
    other = new_agent(office, "Other")
    edit_task(office, epics[0], at(70), assignee_agent_id=other)
    w = wakeup(office, rider)
    assert (w["status"], w["cancel_reason"]) == ("cancelled", "task_terminal")
    assert [x["status"] for x in wakeups(office, lead, source="task_children_completed")] == ["cancelled"] * 2


def test_riders_of_a_run_that_succeeded_stay_coalesced_into_it(office):
    lead, epics, (carrier, rider) = coordinator_with_two_epics(office)
    (run_id,) = dispatch(office, at(66))
    settle(office, run_id, "succeeded", at(70))
    assert [wakeup(office, i)["status"] for i in (carrier, rider)] == ["finished", "coalesced"]
    assert dispatch(office, at(80)) == []


def test_the_window_holds_a_burst_of_children_completed_until_it_closes(office):
    """Five task_children_completed within 3 s, with the claim actor looking after each, make one
    wakeup and one run with coalesced_count 5; the dispatcher's next look is the window's end."""
    lead = new_agent(office, "Lead", role="coordinator", cooldown_sec=0)
    epics = [new_task(office, f"Epic {i}", at(i), assignee_agent_id=lead) for i in range(5)]
    for run_id in dispatch(office, at(10)):
        settle(office, run_id, "succeeded", at(10))
    for _ in range(4):   # the first looks at the other epics, one run each (their own tasks)
        for run_id in dispatch(office, at(11)):
            settle(office, run_id, "succeeded", at(11))
    ids = []
    for i, epic in enumerate(epics):
        ids.append(enqueue(office, lead, CHILDREN, {"task_id": epic}, at(60 + 0.6 * i)))
        assert dispatch(office, at(60 + 0.6 * i)) == []
    assert call(office, office.office.next_wakeup_at, at(63)) == at(65)
    assert dispatch(office, at(64.9)) == []
    (run_id,) = dispatch(office, at(65))
    assert wakeup(office, ids[0])["coalesced_count"] == 5
    assert [wakeup(office, i)["run_id"] for i in ids] == [run_id] * 5


async def test_the_claim_actor_waits_out_the_window_and_makes_one_run_of_a_burst(autojump_clock, mock_deps,
                                                                                 git_repo):
    """With the real claim actor (nudged at every change, as the web layer nudges it): three
    epics' children done 1.5 s apart give the coordinator one run, started once the window of
    the first has closed, carrying all three."""
    set_settings(mock_deps.store, repository=str(git_repo))
    store, clock = mock_deps.store, mock_deps.clock
    lead = new_agent(store, "Lead", clock.now(), role="coordinator", cooldown_sec=0)
    epics = [new_task(store, f"Epic {i}", clock.now(), assignee_agent_id=lead) for i in range(3)]
    children = [new_task(store, f"Part {i}", clock.now(), parent_id=e) for i, e in enumerate(epics)]
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outpost.claim_actor, mock_deps, mock_deps.claim_wake.rx)
            await until(lambda: all(w["status"] == "finished" for w in wakeups(store, lead)))
            first_done = clock.now()
            for child in children:
                move(store, child, "DONE", clock.now())
                mock_deps.claim_wake.poke()
                await trio.sleep(1.5)
            burst = await until(lambda: [w for w in wakeups(store, lead, source="task_children_completed")
                                         if w["status"] == "finished"])
            nursery.cancel_scope.cancel()
    (carrier,) = burst
    assert carrier["coalesced_count"] == 3
    run = office_run(store, carrier["run_id"])
    assert instant(run["queued_at"]) >= first_done + timedelta(seconds=outpost.COALESCING_WINDOW_S)
    assert all(e in run["assembled_prompt"] for e in epics)
    assert len({w["run_id"] for w in wakeups(store, lead, source="task_children_completed")}) == 1


# --- random interleavings ------------------------------------------------------------------------------

LIVE = ("queued", "claimed")


def carried_well(office, carrier: dict) -> bool:
    """The carrier's run ended well (succeeded or needs you): its riders were carried."""
    if carrier["status"] != "finished" or not carrier["run_id"]:
        return False
    return call(office, office.runs.get_run, carrier["run_id"])["status"] in ("succeeded", "needs_you")


class Interleavings(RuleBasedStateMachine):
    """Two agents (a coordinator and a worker), three tasks, wakeups of every kind a user or an
    event makes, and every way a run ends. After each step: no wakeup is ``coalesced`` into a
    carrier that ended without carrying it; a rider that ended did so for its own reason."""

    def __init__(self):
        super().__init__()
        import tempfile
        from pathlib import Path
        self.dir = tempfile.TemporaryDirectory()
        self.office = new_store(Path(self.dir.name))
        set_settings(self.office, repository=str(Path(self.dir.name) / "repo"))
        self.now = T0
        self.before: dict[str, dict] = {}

    @initialize()
    def people_and_tasks(self):
        self.lead = new_agent(self.office, "Lead", role="coordinator", cooldown_sec=0)
        self.worker = new_agent(self.office, "Worker", cooldown_sec=0)
        self.agents = [self.lead, self.worker]
        self.tasks = [new_task(self.office, f"Task {i}", self.now, assignee_agent_id=self.agents[i % 2])
                      for i in range(3)]
        self.before = self.snapshot()

    def tick(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now

    def snapshot(self) -> dict[str, dict]:
        return {w["id"]: w for w in wakeups(self.office)}

    @rule(who=st.integers(0, 1), kind=st.sampled_from(["user", "children", "comment", "routine"]),
          task=st.integers(0, 2), gap=st.sampled_from([0.5, 2, 7]))
    def enqueue(self, who, kind, task, gap):
        agent, now = self.agents[who], self.tick(gap)
        if kind == "user":
            enqueue(self.office, agent, outpost.WakeupSource.USER, {"user_id": "u"}, now)
        elif kind == "routine":
            routine_wake(self.office, agent, now, f"r{who}")
        else:
            t = call(self.office, self.office.office.get_task, self.tasks[task])
            if t["assignee_agent_id"] and t["state"] not in ("DONE", "CANCELLED"):
                source = CHILDREN if kind == "children" else outpost.WakeupSource.COMMENT
                payload = {"task_id": t["id"]} | ({"comment_id": f"c{now.timestamp()}"} if kind == "comment" else {})
                enqueue(self.office, t["assignee_agent_id"], source, payload, now)

    @rule(gap=st.sampled_from([0, 6, 3 * 3600]))
    def claim(self, gap):
        dispatch(self.office, self.tick(gap), PROFILES)

    @rule(how=st.sampled_from(["succeeded", "failed", "cancelled", "needs_you"]), which=st.integers(0, 3))
    def end_a_run(self, how, which):
        open_runs = sorted(call(self.office, self.office.runs.own_runs_in, ["queued", "running"]))
        if open_runs:
            run_id = open_runs[which % len(open_runs)]
            extra = {"error": "boom", "exit_code": 1} if how == "failed" else {}
            settle(self.office, run_id, how, self.tick(1), **extra)

    @rule(task=st.integers(0, 2), who=st.integers(0, 2))
    def reassign(self, task, who):
        t = call(self.office, self.office.office.get_task, self.tasks[task])
        if t["state"] not in ("DONE", "CANCELLED"):
            edit_task(self.office, t["id"], self.tick(1), assignee_agent_id=(self.agents + [None])[who])

    @rule(task=st.integers(0, 2), state=st.sampled_from(["DONE", "CANCELLED", "IN_PROGRESS"]))
    def move(self, task, state):
        t = call(self.office, self.office.office.get_task, self.tasks[task])
        if t["state"] not in ("DONE", "CANCELLED"):
            move(self.office, t["id"], state, self.tick(1))

    @invariant()
    def no_rider_outlives_its_carrier(self):
        if not self.before:
            return
        now = self.snapshot()
        for w in now.values():
            if w["status"] == "coalesced":
                carrier = now[w["coalesced_into"]]
                assert carrier["status"] in LIVE or carried_well(self.office, carrier), (w, carrier)
            was = self.before.get(w["id"])
            if was is not None and was["status"] == "coalesced" and w["status"] not in ("coalesced", *LIVE):
                # a rider that ended did so for its own reason, now true
                task = call(self.office, self.office.wakeups.task_facts, w["task_id"], w["workspace_id"]) \
                    if w["task_id"] else None
                assert w["status"] == "cancelled" and w["cancel_reason"], w
                assert outpost.stale_reason(task, w["agent_id"], w["reason"]) is not None, w
        self.before = now

    def teardown(self):
        """Quiet: every run succeeds and every retry comes due; nothing is left waiting."""
        for _ in range(12):
            for run_id in call(self.office, self.office.runs.own_runs_in, ["queued", "running"]):
                settle(self.office, run_id, "succeeded", self.tick(1))
            dispatch(self.office, self.tick(3 * 3600), PROFILES)
        left = [w for w in wakeups(self.office) if w["status"] in LIVE]
        assert left == [], left
        self.office.close()
        self.dir.cleanup()


Interleavings.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_random_interleavings_leave_no_rider_behind = Interleavings.TestCase

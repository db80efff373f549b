"""A run's timeline (API.md 15): the steps of its launch, to the millisecond, through the real
daemon; and ``outpost runs log --follow``, which streams a live log until the run settles."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime

from conftest import OUTPOST_PY, YEARLY, definition, git
from test_system import create_schedule, fire, port_of, wait_status

import outpost

MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def test_a_run_that_brought_its_branch_back_shows_all_seven_steps_in_order(server_factory, git_repo):
    server = server_factory()
    with server.client() as client:
        schedule = create_schedule(client, definition(
            git_repo, name="timeline", brief="@sleep 0.3\n@print first\n@sleep 0.3\n@commit notes.txt hi",
            timing=YEARLY))
        run = wait_status(client, fire(client, schedule["id"])["run_id"])
        assert run["status"] == "succeeded" and run["changes"]["commits"] == 1
        assert git(git_repo, "show", f"{run['result_branch']}:notes.txt") == "hi"
        steps = run["steps"]
    assert [s["step"] for s in steps] == ["queued", "worktree_ready", "agent_started", "first_output",
                                          "agent_exited", "branch_back", "settled"]
    assert all(MS.match(s["at"]) for s in steps), steps
    at = [datetime.fromisoformat(s["at"]) for s in steps]
    assert at == sorted(at)
    # The agent slept 0.3 s before its first line and 0.3 s after it: the instants are real ones.
    assert (at[3] - at[2]).total_seconds() >= 0.25 and (at[4] - at[3]).total_seconds() >= 0.25
    assert steps[0]["at"].startswith(run["queued_at"][:19]) and steps[-1]["at"].startswith(run["finished_at"][:19])


def test_a_run_without_commits_and_without_output_shows_only_its_steps(server_factory, git_repo):
    server = server_factory()
    with server.client() as client:
        schedule = create_schedule(client, definition(git_repo, name="quiet", brief="@sleep 0", timing=YEARLY))
        run = wait_status(client, fire(client, schedule["id"])["run_id"])
    # The demo agent always prints its closing status: it has a first output, and no branch came back.
    assert [s["step"] for s in run["steps"]] == ["queued", "worktree_ready", "agent_started", "first_output",
                                                 "agent_exited", "settled"]


def test_runs_log_follow_prints_what_arrives_after_it_started_and_exits_when_the_run_settles(
        server_factory, git_repo):
    server = server_factory()
    with server.client() as client:
        schedule = create_schedule(client, definition(
            git_repo, name="follow", brief="@print before\n@sleep 3\n@print after-the-start", timing=YEARLY))
        run_id = fire(client, schedule["id"])["run_id"]
        env = {k: v for k, v in os.environ.items() if k not in ("OUTPOST_API_TOKEN", "OUTPOST_PORT")}
        env["OUTPOST_PORT"] = str(port_of(server))
        follow = subprocess.Popen([sys.executable, str(OUTPOST_PY), "--data-dir", str(server.data_dir), "runs",
                                   "log", run_id, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        first = follow.stdout.readline()   # "before" is printed while the run still sleeps
        assert first == "before\n"
        assert client.get(f"/v1/outpost/runs/{run_id}").json()["status"] == "running"
        started = time.monotonic()
        out, err = follow.communicate(timeout=30)
        assert follow.returncode == 0, err
        assert "after-the-start\n" in out and time.monotonic() - started > 1
        assert '"status": "succeeded"' in out   # the log's end: the demo agent's closing status
        assert client.get(f"/v1/outpost/runs/{run_id}").json()["status"] in outpost.SETTLED_RUN_STATUSES

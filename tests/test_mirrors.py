"""Repositories by URL (docs/fleet.md): a bare mirror per node under <data dir>/mirrors, fetched
before source_ref resolves, the result branch pushed back when the run settles. End to end with
a real `outpost serve` and a real remote (a bare repository reached by file://)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from conftest import git, make_repo, wait_for

import outpost


@pytest.mark.parametrize("url", ["https://github.com/o/r.git", "ssh://git@host:22/o/r", "git@github.com:o/r.git",
                                 "file:///srv/repos/r.git"])
def test_a_git_url_is_a_repository(url):
    assert outpost.normalize_dispatch({"brief": "x", "repository": url, "agent": "demo"}, outpost.datetime.now(
        outpost.UTC), agents=["demo"])["repository"] == url


@pytest.mark.parametrize("text", ["relative/path", "ftp://host/r.git", "host:path",
                                  "https://x-access-token:ghp_secret@github.com/o/r.git",
                                  "https://ghp_secret@github.com/o/r.git", "ssh://git:secret@host/o/r"])
def test_neither_a_path_nor_a_git_url_is_refused(text):
    with pytest.raises(outpost.ValidationFailed) as caught:
        outpost.normalize_dispatch({"brief": "x", "repository": text, "agent": "demo"}, outpost.datetime.now(
            outpost.UTC), agents=["demo"])
    assert caught.value.errors[0]["field"] == "repository"


@pytest.fixture
def remote(tmp_path: Path) -> tuple[Path, Path]:
    """A bare repository (the "remote") and a working clone of it to push new commits from."""
    work = make_repo(tmp_path / "work")
    bare = tmp_path / "remote.git"
    git(tmp_path, "clone", "--quiet", "--bare", str(work), str(bare))
    git(work, "remote", "add", "origin", str(bare))
    return bare, work


def dispatch(client: httpx.Client, repository: str, brief: str) -> httpx.Response:
    return client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": uuid.uuid4().hex},
                       json={"brief": brief, "repository": repository, "agent": "demo"})


def settled(client: httpx.Client, run_id: str) -> dict:
    run = client.get(f"/v1/outpost/runs/{run_id}").json()
    return run if run["status"] not in ("queued", "running") else {}


def test_a_run_of_a_url_works_in_a_mirror_and_pushes_its_branch_back(server_factory, remote, tmp_path):
    bare, work = remote
    url = f"file://{bare}"
    server = server_factory(data_dir=tmp_path / "data")
    with server.client() as client:
        reply = dispatch(client, url, "@commit notes.txt from the fleet")
        assert reply.status_code == 202, reply.text
        run = wait_for(lambda: settled(client, reply.json()["run_id"]), timeout_s=30)
        assert (run["status"], run["repository"], run["changes"]["commits"]) == ("succeeded", url, 1)
        assert run["resolved_commit"] == git(work, "rev-parse", "HEAD")
        # the branch is on the remote, with the agent's commit
        assert git(bare, "show", f"{run['result_branch']}:notes.txt") == "from the fleet"
        mirrors = list((tmp_path / "data" / "mirrors").iterdir())
        assert len(mirrors) == 1 and mirrors[0].name.startswith("remote-") and mirrors[0].name.endswith(".git")

        # a new commit upstream: the next run starts from it (fetched before source_ref resolves)
        (work / "later.txt").write_text("later\n")
        git(work, "add", "-A")
        git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "later")
        git(work, "push", "-q", "origin", "main")
        next_id = dispatch(client, url, "@print hi").json()["run_id"]
        again = wait_for(lambda: settled(client, next_id), timeout_s=30)
        assert again["resolved_commit"] == git(work, "rev-parse", "HEAD")
        kinds = {a["kind"] for a in client.get("/v1/outpost/attention?state=all").json()["attention"]}
        assert "push_failed" not in kinds


def test_a_push_that_fails_raises_an_attention_item_and_keeps_the_branch(server_factory, remote, tmp_path):
    bare, _ = remote
    hook = bare / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\necho 'protected: no pushes here' >&2\nexit 1\n")
    hook.chmod(0o755)
    url = f"file://{bare}"
    server = server_factory(data_dir=tmp_path / "data")
    with server.client() as client:
        reply = dispatch(client, url, "@commit notes.txt kept")
        run = wait_for(lambda: settled(client, reply.json()["run_id"]), timeout_s=30)
        assert run["status"] == "succeeded"   # the agent's work succeeded; only the push did not
        items = [a for a in client.get("/v1/outpost/attention").json()["attention"] if a["kind"] == "push_failed"]
        assert len(items) == 1 and items[0]["run_id"] == run["id"]
        assert "protected: no pushes here" in items[0]["detail"]
    mirror = next((tmp_path / "data" / "mirrors").iterdir())
    assert git(mirror, "show", f"{run['result_branch']}:notes.txt") == "kept"
    assert git(bare, "branch", "--list", run["result_branch"]) == ""


def test_an_unreachable_url_is_refused_at_dispatch_with_git_s_words(server_factory, tmp_path):
    server = server_factory(data_dir=tmp_path / "data")
    with server.client() as client:
        reply = dispatch(client, f"file://{tmp_path}/nowhere.git", "@print hi")
    assert reply.status_code == 422, reply.text
    problem = reply.json()
    assert problem["errors"][0]["field"] == "repository" and "cannot fetch" in problem["detail"]


def test_runs_of_a_url_this_appliance_cannot_reach_fail_without_feeding_the_failure_streak(
        server_factory, remote, tmp_path):
    """Defect 9b: a single appliance that could not fetch a schedule's URL failed its runs as
    the agent's own failures, and three of them auto-paused the schedule. Now each fails with the
    reason, and the streak is left as it was (docs/fleet.md: a fetch that fails never counts)."""
    bare, _ = remote
    url = f"file://{bare}"
    server = server_factory(data_dir=tmp_path / "data")
    with server.client() as client:
        definition = {"name": "far", "brief": "@print hi", "repository": url, "agent": "demo",
                      "timing": {"kind": "cron", "expression": "0 0 1 1 *", "timezone": "UTC"}}
        composed = client.post("/v1/outpost/schedules/compose", json=definition).json()
        sched = client.post("/v1/outpost/schedules", headers={"Idempotency-Key": uuid.uuid4().hex},
                            json={"definition": composed["definition"], "confirmation": composed["confirmation"]})
        assert sched.status_code == 201, sched.text
        sid = sched.json()["id"]
        bare.rename(tmp_path / "gone.git")   # the remote cannot be reached any more
        runs = []
        for _ in range(outpost.AUTO_PAUSE_STREAK):
            revision = client.get(f"/v1/outpost/schedules/{sid}").json()["revision"]
            fired = client.post(f"/v1/outpost/schedules/{sid}/control", json={"action": "fire"},
                                headers={"Idempotency-Key": uuid.uuid4().hex, "If-Match": str(revision)}).json()
            assert fired["outcome"] == "admitted", fired
            runs.append(wait_for(lambda run_id=fired["run_id"]: settled(client, run_id), timeout_s=30))
        schedule = client.get(f"/v1/outpost/schedules/{sid}").json()
        kinds = [a["kind"] for a in client.get("/v1/outpost/attention").json()["attention"]]
    assert {r["status"] for r in runs} == {"failed"}
    assert all(r["error"].startswith(f"repository unavailable: cannot fetch {url}") for r in runs), runs[0]["error"]
    assert (schedule["failure_streak"], schedule["enabled"], schedule["auto_paused"]) == (0, True, False)
    assert "auto_pause" not in kinds

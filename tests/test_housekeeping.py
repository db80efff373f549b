"""API.md 11, the first two bullets: empty result branches go at settlement, and housekeeping
(``[settings] keep_days``, the daily pass, ``POST /v1/outpost/housekeeping``, ``outpost gc``)."""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import T0, Api, call, git, make_deps, until

import outpost


def branch_exists(repo: Path, branch: str) -> bool:
    return bool(git(repo, "branch", "--list", branch))


async def run_to_end(deps: outpost.Deps, run_id: str) -> dict:
    """The claim actor runs ``run_id`` to its settlement; its attention is raised as the
    notification actor would."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.claim_actor, deps, deps.claim_wake.rx)
        deps.claim_wake.poke()
        view = await until(lambda: (r := call(deps.store, deps.store.runs.get_run, run_id))["status"]
                           in ("succeeded", "failed", "needs_you", "cancelled") and r)
        await until(lambda: deps.live.get(run_id) is None)   # its supervisor has finished (the branch)
        nursery.cancel_scope.cancel()
    call(deps.store, deps.store.runs.notify_run, run_id, deps.clock.now())
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

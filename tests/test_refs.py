"""Refs (issue 15): while the daemon serves, refs resolve through one resident
``git cat-file --batch-check`` per repository, never a process per question; it is started on
demand, restarted when it dies and ended at shutdown. Real git repositories in a temp dir."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import trio
from conftest import git, make_repo

import outpost


def commit(repo: Path, message: str) -> str:
    git(repo, "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-q", "--allow-empty", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def no_git_processes(monkeypatch):
    """Counts every one-shot process trio starts (the rev-parse path)."""
    started = []
    real = trio.run_process

    async def counting(argv, **kwargs):
        started.append(argv)
        return await real(argv, **kwargs)
    monkeypatch.setattr(trio, "run_process", counting)
    return started


async def test_a_resident_cat_file_answers_every_question_and_sees_new_commits(tmp_path, no_git_processes):
    repo = make_repo(tmp_path / "repo")
    refs = outpost.Refs()
    async with refs.resident():
        first = await refs.resolve(str(repo), "main")
        assert first == git(repo, "rev-parse", "main")
        pid = refs.cat_files[str(repo)].process.pid
        second = commit(repo, "two")
        assert await refs.resolve(str(repo), "main") == second
        git(repo, "branch", "feature")
        git(repo, "pack-refs", "--all")
        third = commit(repo, "three")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "tag", "-a", "v1", "-m", "annotated", "feature")
        assert await refs.resolve(str(repo), "main") == third
        assert await refs.resolve(str(repo), "v1") == second   # an annotated tag names its commit
        assert await refs.resolve(str(repo), "HEAD~1") == second
        assert refs.cat_files[str(repo)].process.pid == pid
        process = refs.cat_files[str(repo)].process
    assert no_git_processes == []
    assert process.returncode is not None   # ended with the daemon
    assert refs.cat_files == {}


async def test_a_cat_file_that_died_is_started_again(tmp_path):
    repo = make_repo(tmp_path / "repo")
    refs = outpost.Refs()
    async with refs.resident():
        await refs.resolve(str(repo), "main")
        dead = refs.cat_files[str(repo)].process
        dead.kill()
        await dead.wait()
        assert await refs.resolve(str(repo), "main") == git(repo, "rev-parse", "main")
        assert refs.cat_files[str(repo)].process.pid != dead.pid


async def test_what_cat_file_cannot_answer_is_refused_with_the_same_words(tmp_path):
    repo = make_repo(tmp_path / "repo")
    plain = tmp_path / "plain"
    plain.mkdir()
    refs = outpost.Refs()
    async with refs.resident():
        with pytest.raises(outpost.RepositoryUnavailable, match="source_ref 'nope' does not resolve"):
            await refs.resolve(str(repo), "nope")
        with pytest.raises(outpost.RepositoryUnavailable, match="is not a git repository"):
            await refs.resolve(str(plain), "main")
        with pytest.raises(outpost.RepositoryUnavailable, match="does not exist"):
            await refs.resolve(str(tmp_path / "gone"), "main")
        assert await refs.resolve(str(repo), "main") == git(repo, "rev-parse", "main")   # still answering


async def test_outside_the_daemon_each_question_is_one_rev_parse(tmp_path, no_git_processes):
    repo = make_repo(tmp_path / "repo")
    refs = outpost.Refs()
    assert await refs.resolve(str(repo), "main") == git(repo, "rev-parse", "main")
    assert [argv[3 + len(outpost.GIT_NO_HOOKS)] for argv in no_git_processes] == ["rev-parse"]
    assert refs.cat_files == {}


async def test_a_question_cut_short_retires_its_cat_file_and_the_next_one_starts_another(tmp_path):
    """A question cancelled while it waits leaves its answer unread in the pipe: that process is
    never asked again, and the next question starts another (a silent process stands in for a
    cat-file that has not answered yet)."""
    repo = make_repo(tmp_path / "repo")
    refs = outpost.Refs()
    async with refs.resident():
        silent = outpost.CatFile(await trio.lowlevel.open_process(
            ["sleep", "30"], stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        refs.cat_files[str(repo)] = silent
        with trio.move_on_after(0.2):   # it never answers: only the cancel ends the wait
            await silent.ask("main^{commit}")
        assert not silent.alive()
        assert await refs.resolve(str(repo), "main") == git(repo, "rev-parse", "main")
        assert refs.cat_files[str(repo)] is not silent
